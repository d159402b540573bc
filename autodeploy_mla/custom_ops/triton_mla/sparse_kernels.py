"""Triton kernels for sparse MLA (DeepSeek Sparse Attention) over the paged caches.

- `index_scores_kernel`: the lightning indexer's score of every cached key for each packed token,
  `sum_h w[t,h] * relu(scale * q[t,h,:] . k[j,:])` in fp32 (-inf where token t may not see key j);
  the top-k over those rows is `torch.topk` (an exact, well-kept selection).
- `sparse_absorbed_kernel`: absorbed MLA attention of one token x BLOCK_H heads over one split of
  the K cache positions its top-k names (-1 = none): each tile of BLOCK_N positions is mapped through
  the page table to cache slots and gathered row by row, then the usual online softmax in base 2. It
  writes the split's unnormalised latent-space partial ([S, T, N, R], fp32) and its (max, sum); the
  caller merges the splits by log-sum-exp and applies W_v. Splits give a decode step of few tokens
  enough programs to fill the GPU.

Both take the token -> sequence map and each token's absolute position, so prefill chunks, decode and
mixed steps are one launch. Any N (heads masked to BLOCK_H), R, Dr (0 allowed), D and top-k.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def index_scores_kernel(
    q_ptr, w_ptr, kcache_ptr, page_table_ptr, tok_seq_ptr, tok_pos_ptr, seq_len_ptr, out_ptr,
    scale, H, D, max_kv, page_size,
    stride_qt, stride_qh, stride_wt, stride_pt, stride_ot,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, KV_ITERS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One token x KV_ITERS tiles of BLOCK_N keys: each tile's keys are read once and scored by all H
    heads (BLOCK_H at a time, re-read from L1/L2), so a program's query is fetched once per tile."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    seq = tl.load(tok_seq_ptr + t)
    pos = tl.load(tok_pos_ptr + t)
    seq_len = tl.load(seq_len_ptr + seq)
    offs_d = tl.arange(0, BLOCK_D)
    for it in range(KV_ITERS):
        kv = (nb * KV_ITERS + it) * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = (kv <= pos) & (kv < seq_len)
        page = tl.load(page_table_ptr + seq * stride_pt + kv // page_size, mask=visible, other=0)
        slot = page.to(tl.int64) * page_size + kv % page_size
        keys = tl.load(kcache_ptr + slot[:, None] * D + offs_d[None, :],
                       mask=visible[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_N, BLOCK_D], cache dtype
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            hm = offs_h < H
            q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                        mask=hm[:, None] & (offs_d[None, :] < D), other=0.0).to(keys.dtype)  # [BLOCK_H, BLOCK_D]
            w = tl.load(w_ptr + t * stride_wt + offs_h, mask=hm, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N], fp32
            acc += tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        acc = tl.where(visible, acc, float("-inf"))
        tl.store(out_ptr + t * stride_ot + kv, acc, mask=kv < max_kv)


@triton.jit
def sparse_absorbed_kernel(
    q_abs_ptr, q_pe_ptr, cache_ptr, topk_ptr, page_table_ptr, tok_seq_ptr, tok_pos_ptr, out_ptr, ml_ptr,
    sm_scale, N, R, DR, K, W, page_size, chunk,
    stride_qt, stride_qh, stride_pt, stride_pht, stride_kt, stride_ptab, stride_os, stride_ot, stride_oh,
    stride_ms, stride_mt,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)  # split of the top-k list: entries [sp * chunk, (sp + 1) * chunk)
    seq = tl.load(tok_seq_ptr + t)
    pos = tl.load(tok_pos_ptr + t)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < N
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    dt = cache_ptr.dtype.element_ty  # products in the cache dtype (bf16: MMAs; fp32: exact with ieee)
    q = tl.load(q_abs_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_r[None, :],
                mask=hm[:, None] & (offs_r[None, :] < R), other=0.0).to(dt)
    qp = tl.load(q_pe_ptr + t * stride_pt + offs_h[:, None] * stride_pht + offs_dr[None, :],
                 mask=hm[:, None] & (offs_dr[None, :] < DR), other=0.0).to(dt)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    k_end = tl.minimum(K, (sp + 1) * chunk)
    for k0 in range(sp * chunk, k_end, BLOCK_N):
        offs_k = k0 + tl.arange(0, BLOCK_N)
        idx = tl.load(topk_ptr + t * stride_kt + offs_k, mask=offs_k < k_end, other=-1)
        valid = (idx >= 0) & (idx <= pos)
        page = tl.load(page_table_ptr + seq * stride_ptab + idx // page_size, mask=valid, other=0)
        slot = page.to(tl.int64) * page_size + idx % page_size
        ckv = tl.load(cache_ptr + slot[:, None] * W + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] < R),
                      other=0.0)  # [BLOCK_N, BLOCK_R]
        kpe = tl.load(cache_ptr + slot[:, None] * W + R + offs_dr[None, :],
                      mask=valid[:, None] & (offs_dr[None, :] < DR), other=0.0)
        s = (tl.dot(q, tl.trans(ckv), input_precision=PRECISION)
             + tl.dot(qp, tl.trans(kpe), input_precision=PRECISION))  # [BLOCK_H, BLOCK_N], fp32
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep zeros finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), ckv, input_precision=PRECISION)
        m_i = m_new
    # unnormalised partial of this split, with its running max (base 2) and sum for the merge
    tl.store(out_ptr + sp * stride_os + t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :], acc,
             mask=hm[:, None] & (offs_r[None, :] < R))
    tl.store(ml_ptr + sp * stride_ms + t * stride_mt + offs_h * 2, m_i, mask=hm)
    tl.store(ml_ptr + sp * stride_ms + t * stride_mt + offs_h * 2 + 1, l_i, mask=hm)
