"""Triton kernels of the `triton` MLA backend (docs/triton_backend.md explains the design).

Six kernels, all over the flat token batch and the paged latent cache
`cache[num_pages, page_size, R + Dr]` (viewed flat as `[num_pages * page_size, R + Dr]`):

- `append_kernel`: writes each new token's [latent | rope key] into its slot (`cache_loc`); with an
  FP8 cache (QUANT) it divides by the layer's scales and saturates at ±448 before the cast.
- `absorbed_attn_kernel`: absorbed attention for decode and for the "absorb" prefill path. A program
  owns BLOCK_Q query tokens of one sequence x BLOCK_H heads (rows) and one split-K chunk of the
  sequence's history; every KV tile it loads is shared by all its rows. Rows past the last head or
  the sequence's last query are masked (never dropped: the head grid is a ceil-division). Causality
  is per row: query i of a sequence sees positions < input_pos + i + 1.
- `absorbed_attn_heads_on_n_kernel`: the same attention with the products transposed, for decode:
  S^T = KV·Q^T and O^T += KV^T·P^T, so the KV tile is the MMA's M side (64 rows, a full Hopper wgmma)
  and the heads (x query tokens) its N side (8..64 wide): 20 or 32 heads waste no padded rows, both
  products read the one tile, and whole tiles inside one page arrive by TMA. With an e4m3 cache and
  bf16 queries the MMAs run in fp16 (e4m3 -> fp16 is one hardware conversion; bf16 is not).
- `split_reduce_kernel`: flash-decoding combine of the split-K partials by log-sum-exp
  (`split_reduce_heads_kernel`: several heads per program, for the many-heads decode's large batches).
- `gather_kv_kernel`: copies the prefill sequences' whole history (prefix + new tokens) out of the
  pages into a flat `[sum kv_len, R + Dr]` buffer, for the "expand" prefill path.
- `expanded_prefill_kernel`: FlashAttention-style causal attention on K/V expanded by kv_b_proj
  (per head: K = [k_nope | k_pe], V), for the "expand" prefill path.

Softmax runs in base 2 (scores are pre-multiplied by scale * log2(e)); lse partials are base 2.
An FP8 cache is converted to the query dtype as each tile is loaded; its scales enter as the two
score multipliers (latent, rope) and one output multiplier, never as a dequantised copy.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_helpers import dot

FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3 magnitude (cache_format.FP8_MAX)
P_SCALE = tl.constexpr(256.0)  # softmax probabilities (<= 1) times this before their e4m3 cast


# Run-time counts and offsets are not specialised on (==1, %16): one compiled kernel serves every
# batch size and step.
@triton.jit
def _round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: the
    interpreter's own fp32 -> e4m3 cast (triton 3.6/3.9) drops the carry when rounding up crosses a
    power of two (1.9375 -> 1.0), so interpreted kernels cast only values this already made exact."""
    bits = y.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (y + 24576.0) - 24576.0  # 1.5 * 2^14: rounds to a multiple of 2^-9 (e4m3's subnormal step)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def _to_cache(x, inv_scale, CACHE, QUANT: tl.constexpr, EXACT_CAST: tl.constexpr):
    if QUANT:
        y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
        if EXACT_CAST:
            y = _round_e4m3(y)
        return y.to(CACHE.dtype.element_ty)
    else:
        return x.to(CACHE.dtype.element_ty)


@triton.jit(do_not_specialize=["num_tokens"])
def append_kernel(
    CKV, KPE, CACHE, CACHE_LOC,
    num_tokens, inv_latent_scale, inv_rope_scale,
    stride_ckv_t, stride_kpe_t, stride_cache_row,
    R: tl.constexpr, DR: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, QUANT: tl.constexpr,
    EXACT_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < num_tokens
    slot = tl.load(CACHE_LOC + offs_t, mask=tmask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    m = tmask[:, None] & (offs_r[None, :] < R)
    x = tl.load(CKV + offs_t.to(tl.int64)[:, None] * stride_ckv_t + offs_r[None, :], mask=m)
    tl.store(CACHE + slot[:, None] * stride_cache_row + offs_r[None, :], _to_cache(x, inv_latent_scale, CACHE, QUANT, EXACT_CAST),
             mask=m)
    if DR > 0:
        offs_d = tl.arange(0, BLOCK_DR)
        md = tmask[:, None] & (offs_d[None, :] < DR)
        y = tl.load(KPE + offs_t.to(tl.int64)[:, None] * stride_kpe_t + offs_d[None, :], mask=md)
        tl.store(CACHE + slot[:, None] * stride_cache_row + R + offs_d[None, :], _to_cache(y, inv_rope_scale, CACHE, QUANT, EXACT_CAST),
                 mask=md)


@triton.jit
def _work_item(CU_SEQLEN, item, B_CAP: tl.constexpr, B_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(sequence, first query) of work item `item` when the items are every sequence's query blocks in
    order, read from the device's cu_seqlen (capacity B_CAP sequences; unused ones have no tokens).
    Items past the last give a sequence index >= B_CAP. A graph captured with a grid over the
    items' upper bound therefore replays correctly for any split of its tokens into sequences."""
    offs = tl.arange(0, B_PAD)
    m = offs < B_CAP
    lo = tl.load(CU_SEQLEN + offs, mask=m, other=0)
    hi = tl.load(CU_SEQLEN + offs + 1, mask=m, other=0)
    nqb = (hi - lo + BLOCK_Q - 1) // BLOCK_Q
    cum = tl.cumsum(nqb, 0)
    b = tl.sum((cum <= item).to(tl.int32), 0)
    first = tl.sum(tl.where(offs == b, cum - nqb, 0), 0)
    return b, (item - first) * BLOCK_Q


@triton.jit
def _absorbed_work(CU_SEQLEN, INPUT_POS, SEQ_LEN, PART_LSE, seq_base, tok_base, chunk_size, stride_pl_t, stride_pl_h,
                   N: tl.constexpr, NUM_HB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
                   SPLIT: tl.constexpr, B_CAP: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """What one program of the absorbed kernels owns. Grid: axis 0 = (query block, head block) with
    head blocks fastest, so the programs that read the same KV tiles run side by side and share them
    through L2; axis 1 = sequence; axis 2 = split. With B_CAP > 0 (a step captured with static
    bounds) axis 0 = (work item, head block) over all sequences (`_work_item`), axis 1 has one
    program, and seq_base / tok_base are 0. Split chunks are cut per program from its own history:
    its kv limit over the grid's splits, at least `chunk_size`, whole tiles (so a graph whose split
    count comes from the cache capacity keeps every split busy at any length, and a ragged batch
    splits every sequence evenly). Lanes (rows or columns) are BLOCK_Q query tokens x
    BLOCK_H heads; lane i of query q sees kv positions < input_pos + q + 1 (`limit`).
    Returns (active, b, pid_s, head, tok, ok, limit, kv_lo, kv_hi, pos0, q0): inactive = a query block
    past the sequence (or past the last item), or (SPLIT) an empty chunk, whose lse = -inf it has
    already stored."""
    pid_qh = tl.program_id(0)
    pid_s = tl.program_id(2)
    hb = pid_qh % NUM_HB
    if B_CAP > 0:
        b, q0 = _work_item(CU_SEQLEN, pid_qh // NUM_HB, B_CAP, B_PAD, BLOCK_Q)
        valid = b < B_CAP
        b = tl.minimum(b, B_CAP - 1)
    else:
        b = seq_base + tl.program_id(1)
        q0 = (pid_qh // NUM_HB) * BLOCK_Q
        valid = True
    q_start = tl.load(CU_SEQLEN + b)
    q_len = tl.load(CU_SEQLEN + b + 1) - q_start
    pos0 = tl.load(INPUT_POS + b)
    seq_len = tl.load(SEQ_LEN + b)
    LANES: tl.constexpr = BLOCK_Q * BLOCK_H
    lane = tl.arange(0, LANES)
    q_idx = q0 + lane // BLOCK_H
    head = hb * BLOCK_H + lane % BLOCK_H
    ok = (head < N) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    limit = pos0 + q_idx + 1
    kv_limit = tl.minimum(seq_len, pos0 + tl.minimum(q_len, q0 + BLOCK_Q))
    per = tl.maximum(tl.cdiv(kv_limit, tl.num_programs(2)), chunk_size)
    chunk_size = tl.cdiv(per, BLOCK_N) * BLOCK_N
    kv_lo = pid_s * chunk_size
    kv_hi = tl.minimum(kv_lo + chunk_size, kv_limit)
    active = valid & (q0 < q_len)
    if SPLIT:
        if active & (kv_lo >= kv_limit):  # static split count, shorter sequence: lse = -inf
            tl.store(PART_LSE + (tok - tok_base) * stride_pl_t + head * stride_pl_h + pid_s,
                     tl.full([LANES], float("-inf"), tl.float32), mask=ok)
        active = active & (kv_lo < kv_limit)
    return active, b, pid_s, head, tok, ok, limit, kv_lo, kv_hi, pos0, q0


@triton.jit(do_not_specialize=["seq_base", "tok_base", "abs_base", "chunk_size"])
def absorbed_attn_kernel(
    Q_ABS, Q_PE, CACHE, PAGE_TABLE, CU_SEQLEN, INPUT_POS, SEQ_LEN,
    LATENT, PART_ACC, PART_LSE, Q_SCALE,
    seq_base, tok_base, abs_base, chunk_size, qk_scale, latent_scale, rope_scale,
    stride_qa_h, stride_qa_t, stride_qp_t, stride_qp_h,
    stride_cache_row, stride_pt_b,
    stride_lat_h, stride_lat_t,
    stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
    N: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_HB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, SCALED: tl.constexpr, FP8_DOT: tl.constexpr,
    EXACT_CAST: tl.constexpr, B_CAP: tl.constexpr = 0, B_PAD: tl.constexpr = 1,
):
    # SCALED: the cache holds x / scale (FP8): scores take latent_scale / rope_scale per part and the
    # attended latent latent_scale. Tiles are converted to the query dtype as they are loaded.
    # FP8_DOT: the queries are e4m3 too (Q_ABS / Q_PE hold q / Q_SCALE[0|1]), so both products run as
    # e4m3 MMAs on the cache tiles as loaded; probabilities go to e4m3 times P_SCALE (so values down
    # to 2^-17 of the row max stay representable) and the accumulator is divided by it at the end.
    active, b, pid_s, head, tok, row_ok, row_limit, kv_lo, kv_hi, pos0, q0 = _absorbed_work(
        CU_SEQLEN, INPUT_POS, SEQ_LEN, PART_LSE, seq_base, tok_base, chunk_size, stride_pl_t, stride_pl_h,
        N, NUM_HB, BLOCK_H, BLOCK_Q, SPLIT, B_CAP, B_PAD, BLOCK_N)
    if not active:
        return
    ROWS: tl.constexpr = BLOCK_Q * BLOCK_H

    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    q = tl.load(Q_ABS + head[:, None] * stride_qa_h + (tok - abs_base)[:, None] * stride_qa_t + offs_r[None, :],
                mask=row_ok[:, None] & rmask[None, :], other=0.0)
    if DR > 0:
        offs_d = tl.arange(0, BLOCK_DR)
        dmask = offs_d < DR
        qpe = tl.load(Q_PE + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_d[None, :],
                      mask=row_ok[:, None] & dmask[None, :], other=0.0)

    if FP8_DOT:
        s_lat = latent_scale * tl.load(Q_SCALE)
        s_rope = rope_scale * tl.load(Q_SCALE + 1)
    else:
        s_lat = latent_scale
        s_rope = rope_scale
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_R], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    pt_row = PAGE_TABLE + b.to(tl.int64) * stride_pt_b
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        pmask = pos < kv_hi
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=pmask, other=0).to(tl.int64)
        row_ptr = CACHE + (page * PAGE_SIZE + pos % PAGE_SIZE) * stride_cache_row
        # Masked loads (other=0): slots past the history may hold anything, NaN included.
        kv = tl.load(row_ptr[:, None] + offs_r[None, :], mask=pmask[:, None] & rmask[None, :], other=0.0)
        kv = kv.to(q.dtype)
        s = dot(q, tl.trans(kv), DOT_PREC)
        if SCALED:
            s = s * s_lat
        if DR > 0:
            kpe = tl.load(row_ptr[:, None] + R + offs_d[None, :], mask=pmask[:, None] & dmask[None, :], other=0.0)
            s_pe = dot(qpe, tl.trans(kpe.to(qpe.dtype)), DOT_PREC)
            if SCALED:
                s_pe = s_pe * s_rope
            s += s_pe
        s = s * qk_scale
        vis = (pos[None, :] < row_limit[:, None]) & pmask[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8_DOT:
            p8 = p * P_SCALE
            if EXACT_CAST:
                p8 = _round_e4m3(p8)
            acc = acc * alpha[:, None] + dot(p8.to(kv.dtype), kv, DOT_PREC)
        else:
            acc = acc * alpha[:, None] + dot(p.to(kv.dtype), kv, DOT_PREC)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if FP8_DOT:
        out = out * (1.0 / P_SCALE)
    if SCALED:
        out = out * latent_scale
    if SPLIT:
        rel = tok - tok_base
        tl.store(PART_ACC + rel[:, None] * stride_pa_t + head[:, None] * stride_pa_h + pid_s * stride_pa_s
                 + offs_r[None, :], out, mask=row_ok[:, None] & rmask[None, :])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(PART_LSE + rel * stride_pl_t + head * stride_pl_h + pid_s, lse, mask=row_ok)
    else:
        tl.store(LATENT + head[:, None] * stride_lat_h + (tok - abs_base)[:, None] * stride_lat_t + offs_r[None, :],
                 out.to(LATENT.dtype.element_ty), mask=row_ok[:, None] & rmask[None, :])


@triton.jit
def _heads_on_n_tile(accT, accT2, m_i, l_i, qT, qT2, qpeT, kv, kv2, kpe, pos, col_limit, kv_hi, latent_scale,
                     rope_scale, qk_scale, DR: tl.constexpr, DOT_PREC: tl.constexpr, SCALED: tl.constexpr,
                     MASKED: tl.constexpr):
    """One KV tile of absorbed_attn_heads_on_n_kernel: scores [BLOCK_N, COLS], softmax down the kv axis."""
    kv = kv.to(qT.dtype)
    kv2 = kv2.to(qT.dtype)
    s = dot(kv, qT, DOT_PREC) + dot(kv2, qT2, DOT_PREC)
    if SCALED:
        s = s * latent_scale
    if DR > 0:
        s_pe = dot(kpe.to(qpeT.dtype), qpeT, DOT_PREC)
        if SCALED:
            s_pe = s_pe * rope_scale
        s += s_pe
    s = s * qk_scale
    if MASKED:
        s = tl.where((pos[:, None] < col_limit[None, :]) & (pos < kv_hi)[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 0)
    p = p.to(kv.dtype)
    accT = accT * alpha[None, :] + dot(tl.trans(kv), p, DOT_PREC)
    accT2 = accT2 * alpha[None, :] + dot(tl.trans(kv2), p, DOT_PREC)
    return accT, accT2, m_new, l_i


@triton.jit(do_not_specialize=["seq_base", "tok_base", "abs_base", "chunk_size"])
def absorbed_attn_heads_on_n_kernel(
    Q_ABS, Q_PE, CACHE, PAGE_TABLE, CU_SEQLEN, INPUT_POS, SEQ_LEN,
    LATENT, PART_ACC, PART_LSE, KV_DESC, KPE_DESC,
    seq_base, tok_base, abs_base, chunk_size, qk_scale, latent_scale, rope_scale,
    stride_qa_h, stride_qa_t, stride_qp_t, stride_qp_h,
    stride_cache_row, stride_pt_b,
    stride_lat_h, stride_lat_t,
    stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
    N: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_HB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, SCALED: tl.constexpr, USE_TMA: tl.constexpr,
    F16: tl.constexpr, B_CAP: tl.constexpr = 0, B_PAD: tl.constexpr = 1, WS: tl.constexpr = False,
):
    # Grid and outputs as absorbed_attn_kernel; columns (BLOCK_Q tokens x BLOCK_H heads) replace rows.
    # The latent is two column chunks [0, C) and [C, 2C), C = BLOCK_C = pow2(R) / 2: a TMA box is at
    # most 256 wide, and each MMA's shared operand stays small.
    # Tiles wholly inside the chunk and below every column's causal limit take the unmasked loop; when
    # a page holds whole tiles (PAGE_SIZE % BLOCK_N == 0; chunks start on BLOCK_N) such a tile is one
    # page and comes by TMA (USE_TMA) or by one base pointer. The last, partial tile is masked.
    # F16: the cache is e4m3 and the MMAs run in fp16 (queries saturated to the fp16 range).
    active, b, pid_s, head, tok, col_ok, col_limit, kv_lo, kv_hi, pos0, q0 = _absorbed_work(
        CU_SEQLEN, INPUT_POS, SEQ_LEN, PART_LSE, seq_base, tok_base, chunk_size, stride_pl_t, stride_pl_h,
        N, NUM_HB, BLOCK_H, BLOCK_Q, SPLIT, B_CAP, B_PAD, BLOCK_N)
    if WS:  # autoWS cannot take the early return's branch: an inactive program runs empty loops, stores nothing
        kv_hi = tl.where(active, kv_hi, kv_lo)
        col_ok = col_ok & active
    else:
        if not active:
            return
    COLS: tl.constexpr = BLOCK_Q * BLOCK_H

    offs_r = tl.arange(0, BLOCK_C)
    offs_r2 = BLOCK_C + offs_r
    rmask = offs_r < R
    rmask2 = offs_r2 < R
    qa = Q_ABS + head[None, :] * stride_qa_h + (tok - abs_base)[None, :] * stride_qa_t
    qT = tl.load(qa + offs_r[:, None], mask=col_ok[None, :] & rmask[:, None], other=0.0)
    qT2 = tl.load(qa + offs_r2[:, None], mask=col_ok[None, :] & rmask2[:, None], other=0.0)
    offs_d = tl.arange(0, BLOCK_DR)
    dmask = offs_d < DR
    qpeT = qT  # placeholder when DR == 0 (never used)
    if DR > 0:
        qpeT = tl.load(Q_PE + tok[None, :] * stride_qp_t + head[None, :] * stride_qp_h + offs_d[:, None],
                       mask=col_ok[None, :] & dmask[:, None], other=0.0)
    if F16:
        qT = tl.minimum(tl.maximum(qT.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        qT2 = tl.minimum(tl.maximum(qT2.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        qpeT = tl.minimum(tl.maximum(qpeT.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([COLS], float("-inf"), tl.float32)
    l_i = tl.zeros([COLS], tl.float32)
    accT = tl.zeros([BLOCK_C, COLS], tl.float32)
    accT2 = tl.zeros([BLOCK_C, COLS], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    pt_row = PAGE_TABLE + b.to(tl.int64) * stride_pt_b
    n_full = tl.maximum((tl.minimum(kv_hi, pos0 + q0 + 1) - kv_lo) // BLOCK_N, 0)
    for t in tl.range(0, n_full, warp_specialize=WS):  # WS: producer/consumer warps (SM90 autoWS)
        start = kv_lo + t * BLOCK_N
        if PAGE_SIZE % BLOCK_N == 0:
            row0 = tl.load(pt_row + start // PAGE_SIZE).to(tl.int64) * PAGE_SIZE + start % PAGE_SIZE
            rows = row0 + offs_n
        else:
            pos = start + offs_n
            rows = tl.load(pt_row + pos // PAGE_SIZE).to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        if USE_TMA:
            kv = KV_DESC.load([row0.to(tl.int32), 0])
            kv2 = KV_DESC.load([row0.to(tl.int32), BLOCK_C])
            kpe = kv  # placeholder when DR == 0 (never used)
            if DR > 0:
                kpe = KPE_DESC.load([row0.to(tl.int32), R])
        else:
            rp = CACHE + rows * stride_cache_row
            kv = tl.load(rp[:, None] + offs_r[None, :], mask=rmask[None, :], other=0.0)
            kv2 = tl.load(rp[:, None] + offs_r2[None, :], mask=rmask2[None, :], other=0.0)
            kpe = kv
            if DR > 0:
                kpe = tl.load(rp[:, None] + R + offs_d[None, :], mask=dmask[None, :], other=0.0)
        accT, accT2, m_i, l_i = _heads_on_n_tile(
            accT, accT2, m_i, l_i, qT, qT2, qpeT, kv, kv2, kpe, start + offs_n, col_limit, kv_hi,
            latent_scale, rope_scale, qk_scale, DR, DOT_PREC, SCALED, False)
    for start in range(kv_lo + n_full * BLOCK_N, kv_hi, BLOCK_N):
        pos = start + offs_n
        pmask = pos < kv_hi
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=pmask, other=0).to(tl.int64)
        rp = CACHE + (page * PAGE_SIZE + pos % PAGE_SIZE) * stride_cache_row
        # Masked loads (other=0): slots past the history may hold anything, NaN included.
        kv = tl.load(rp[:, None] + offs_r[None, :], mask=pmask[:, None] & rmask[None, :], other=0.0)
        kv2 = tl.load(rp[:, None] + offs_r2[None, :], mask=pmask[:, None] & rmask2[None, :], other=0.0)
        kpe = kv
        if DR > 0:
            kpe = tl.load(rp[:, None] + R + offs_d[None, :], mask=pmask[:, None] & dmask[None, :], other=0.0)
        accT, accT2, m_i, l_i = _heads_on_n_tile(
            accT, accT2, m_i, l_i, qT, qT2, qpeT, kv, kv2, kpe, pos, col_limit, kv_hi,
            latent_scale, rope_scale, qk_scale, DR, DOT_PREC, SCALED, True)

    has = l_i > 0.0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    if SCALED:
        inv = inv * latent_scale
    outT = accT * inv[None, :]
    outT2 = accT2 * inv[None, :]
    if SPLIT:
        rel = tok - tok_base
        pa = PART_ACC + rel[None, :] * stride_pa_t + head[None, :] * stride_pa_h + pid_s * stride_pa_s
        tl.store(pa + offs_r[:, None], outT, mask=col_ok[None, :] & rmask[:, None])
        tl.store(pa + offs_r2[:, None], outT2, mask=col_ok[None, :] & rmask2[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(PART_LSE + rel * stride_pl_t + head * stride_pl_h + pid_s, lse, mask=col_ok)
    else:
        la = LATENT + head[None, :] * stride_lat_h + (tok - abs_base)[None, :] * stride_lat_t
        tl.store(la + offs_r[:, None], outT.to(LATENT.dtype.element_ty), mask=col_ok[None, :] & rmask[:, None])
        tl.store(la + offs_r2[:, None], outT2.to(LATENT.dtype.element_ty), mask=col_ok[None, :] & rmask2[:, None])


@triton.jit(do_not_specialize=["tok_base", "abs_base", "num_splits"])
def split_reduce_kernel(
    PART_ACC, PART_LSE, LATENT, CU_SEQLEN,
    tok_base, abs_base, num_splits,
    stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
    stride_lat_h, stride_lat_t,
    R: tl.constexpr, BLOCK_R: tl.constexpr, B_CAP: tl.constexpr = 0,
):
    # B_CAP > 0 (static bounds): rows past the step's last token (cu_seqlen[B_CAP]) had no program
    # and their partials are garbage: they get a zero latent.
    rel = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    live = True
    if B_CAP > 0:
        live = tok_base + rel < tl.load(CU_SEQLEN + B_CAP)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(PART_LSE + rel * stride_pl_t + h * stride_pl_h + s)
        lse = tl.where(live, lse, float("-inf"))
        # Partials of empty chunks were never written: do not read them (0 * NaN = NaN).
        r_lim = tl.where(lse > float("-inf"), R, 0)
        x = tl.load(PART_ACC + rel * stride_pa_t + h * stride_pa_h + s * stride_pa_s + offs_r,
                    mask=offs_r < r_lim, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha + w * x
        l = l * alpha + w
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)
    tl.store(LATENT + h * stride_lat_h + (tok_base + rel - abs_base) * stride_lat_t + offs_r,
             out.to(LATENT.dtype.element_ty), mask=rmask)


@triton.jit(do_not_specialize=["tok_base", "abs_base", "num_splits"])
def split_reduce_heads_kernel(
    PART_ACC, PART_LSE, LATENT,
    tok_base, abs_base, num_splits,
    stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
    stride_lat_h, stride_lat_t,
    R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """split_reduce_kernel for BLOCK_H heads per program (N % BLOCK_H == 0, R a power of two, no
    static bounds), its loads independent of each other: the LSE no longer gates the partial's load
    (an empty split's partial, never written, is read and discarded by `where`). Fewer, wider programs
    with one memory round trip per split: H200, N 128, batch 32, two splits, 11.5 vs 12.6 us."""
    rel = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(PART_LSE + rel * stride_pl_t + h * stride_pl_h + s)
        x = tl.load(PART_ACC + rel * stride_pa_t + h[:, None] * stride_pa_h + s * stride_pa_s + offs_r[None, :])
        x = tl.where((lse > float("-inf"))[:, None], x, 0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * x
        l_sum = l_sum * alpha + w
        m = m_new
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(LATENT + h[:, None] * stride_lat_h + (tok_base + rel - abs_base) * stride_lat_t + offs_r[None, :],
             out.to(LATENT.dtype.element_ty))


@triton.jit
def gather_kv_kernel(
    CACHE, PAGE_TABLE, SEQ_LEN, KV_CU, DST, latent_scale, rope_scale,
    stride_cache_row, stride_pt_b, stride_dst_row,
    W: tl.constexpr, R: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, SCALED: tl.constexpr,
):
    # DST has the query dtype: an FP8 cache is dequantised here (times its scales when SCALED).
    pid = tl.program_id(0)
    b = tl.program_id(1)
    kv_len = tl.load(SEQ_LEN + b)
    if pid * BLOCK_T >= kv_len:
        return
    dst0 = tl.load(KV_CU + b).to(tl.int64)
    pos = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    pmask = pos < kv_len
    page = tl.load(PAGE_TABLE + b.to(tl.int64) * stride_pt_b + pos // PAGE_SIZE, mask=pmask, other=0).to(tl.int64)
    src = CACHE + (page * PAGE_SIZE + pos % PAGE_SIZE) * stride_cache_row
    dst = DST + (dst0 + pos) * stride_dst_row
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        m = pmask[:, None] & (offs_w[None, :] < W)
        x = tl.load(src[:, None] + offs_w[None, :], mask=m)
        if SCALED:
            x = x.to(tl.float32) * tl.where(offs_w < R, latent_scale, rope_scale)[None, :]
        tl.store(dst[:, None] + offs_w[None, :], x.to(DST.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["rows"])
def pack_heads_kernel(
    A, B, DST, rows,
    stride_a_t, stride_a_h, stride_b_t, stride_b_h, stride_d_t, stride_d_h,
    DA: tl.constexpr, DB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
):
    """DST[t, h] = [A[t, h, :DA] | B[t, h, :DB]] for BLOCK_T rows of one head (program axis 1): FA3's q
    ([q_nope | q_pe]) or K ([k_nope | k_pe], B's head stride 0: k_pe is shared by the heads)."""
    h = tl.program_id(1).to(tl.int64)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < rows
    dst = DST + t[:, None] * stride_d_t + h * stride_d_h
    da = tl.arange(0, BLOCK_DA)
    ma = tm[:, None] & (da < DA)[None, :]
    x = tl.load(A + t[:, None] * stride_a_t + h * stride_a_h + da[None, :], mask=ma)
    tl.store(dst + da[None, :], x.to(DST.dtype.element_ty), mask=ma)
    if DB > 0:
        db = tl.arange(0, BLOCK_DB)
        mb = tm[:, None] & (db < DB)[None, :]
        y = tl.load(B + t[:, None] * stride_b_t + h * stride_b_h + db[None, :], mask=mb)
        tl.store(dst + DA + db[None, :], y.to(DST.dtype.element_ty), mask=mb)


@triton.jit
def _expanded_tiles(
    acc, m_i, l_i, qn, qn2, qp, KV, LAT, kv0, k_col, lo, hi, row_limit, qk_scale,
    stride_kv_row, stride_lat_row, KN_DESC, KN2_DESC, V_DESC, KP_DESC,
    DN: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DN2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Online-softmax over key tiles [lo, hi); CAUSAL=False for tiles every row fully sees. The nope
    dims are BLOCK_DN (+ BLOCK_DN2 past them when DN is not a power of two, e.g. 192 = 128 + 64).
    USE_TMA: K/V tiles by tensor descriptor (rows past the sequence are masked out of the scores;
    columns past a padded head dim meet zero query columns or are never stored)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        pmask = pos < hi
        rows = kv0 + pos
        if USE_TMA:
            row0 = (kv0 + start).to(tl.int32)
            kn = KN_DESC.load([row0, k_col])
        else:
            kn = tl.load(KV + rows[:, None] * stride_kv_row + k_col + offs_dn[None, :],
                         mask=pmask[:, None] & (offs_dn[None, :] < DN), other=0.0)
        s = dot(qn, tl.trans(kn), DOT_PREC)
        if BLOCK_DN2 > 0:
            if USE_TMA:
                kn2 = KN2_DESC.load([row0, k_col + BLOCK_DN])
            else:
                offs_dn2 = BLOCK_DN + tl.arange(0, BLOCK_DN2)
                kn2 = tl.load(KV + rows[:, None] * stride_kv_row + k_col + offs_dn2[None, :],
                              mask=pmask[:, None] & (offs_dn2[None, :] < DN), other=0.0)
            s += dot(qn2, tl.trans(kn2), DOT_PREC)
        if DR > 0:
            if USE_TMA:
                kp = KP_DESC.load([row0, R])
            else:
                offs_dr = tl.arange(0, BLOCK_DR)
                kp = tl.load(LAT + rows[:, None] * stride_lat_row + R + offs_dr[None, :],
                             mask=pmask[:, None] & (offs_dr[None, :] < DR), other=0.0)
            s += dot(qp, tl.trans(kp), DOT_PREC)
        s = s * qk_scale
        if CAUSAL:
            s = tl.where((pos[None, :] <= row_limit[:, None]) & pmask[None, :], s, float("-inf"))
        else:
            s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = V_DESC.load([row0, k_col + DN])
        else:
            v = tl.load(KV + rows[:, None] * stride_kv_row + k_col + DN + offs_dv[None, :],
                        mask=pmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def expanded_prefill_kernel(
    Q_NOPE, Q_PE, KV, LAT, CU_SEQLEN, INPUT_POS, KV_CU, OUT, KN_DESC, KN2_DESC, V_DESC, KP_DESC,
    qk_scale,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_kv_row, stride_lat_row, stride_o_t, stride_o_h,
    DN: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DN2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    DOT_PREC: tl.constexpr, HEAVY_FIRST: tl.constexpr, USE_TMA: tl.constexpr,
):
    # grid: (query block, head, prefill sequence); with HEAVY_FIRST the query blocks of a head are
    # numbered from the last, so the causal blocks that see the most keys start first and the short
    # ones fill the tail (a head's blocks stay adjacent: they share its K/V columns in L2). K/V rows
    # of sequence b start at KV_CU[b] in the expanded buffers; its new tokens are the last q_len of
    # its kv_len = input_pos + q_len rows.
    if HEAVY_FIRST:
        mb = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_SEQLEN + b)
    q_len = tl.load(CU_SEQLEN + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    pos0 = tl.load(INPUT_POS + b)
    kv0 = tl.load(KV_CU + b).to(tl.int64)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    tok = (q_start + offs_m).to(tl.int64)
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    qn = tl.load(Q_NOPE + tok[:, None] * stride_qn_t + h * stride_qn_h + offs_dn[None, :],
                 mask=mmask[:, None] & (offs_dn[None, :] < DN), other=0.0)
    qn2 = qn  # placeholder when BLOCK_DN2 == 0 (never used)
    if BLOCK_DN2 > 0:
        offs_dn2 = BLOCK_DN + tl.arange(0, BLOCK_DN2)
        qn2 = tl.load(Q_NOPE + tok[:, None] * stride_qn_t + h * stride_qn_h + offs_dn2[None, :],
                      mask=mmask[:, None] & (offs_dn2[None, :] < DN), other=0.0)
    qp = qn  # placeholder when DR == 0 (never used)
    if DR > 0:
        qp = tl.load(Q_PE + tok[:, None] * stride_qp_t + h * stride_qp_h + offs_dr[None, :],
                     mask=mmask[:, None] & (offs_dr[None, :] < DR), other=0.0)
    k_col = h * (DN + DV)
    row_limit = pos0 + offs_m  # causal: row sees kv positions <= row_limit
    full_end = pos0 + mb * BLOCK_M  # keys below this are visible to every row of the block
    kv_end = pos0 + tl.minimum(q_len, (mb + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, m_i, l_i = _expanded_tiles(
        acc, m_i, l_i, qn, qn2, qp, KV, LAT, kv0, k_col, 0, full_end, row_limit, qk_scale,
        stride_kv_row, stride_lat_row, KN_DESC, KN2_DESC, V_DESC, KP_DESC,
        DN, DV, DR, R, BLOCK_N, BLOCK_DN, BLOCK_DN2, BLOCK_DV, BLOCK_DR, False, DOT_PREC, USE_TMA)
    acc, m_i, l_i = _expanded_tiles(
        acc, m_i, l_i, qn, qn2, qp, KV, LAT, kv0, k_col, full_end, kv_end, row_limit, qk_scale,
        stride_kv_row, stride_lat_row, KN_DESC, KN2_DESC, V_DESC, KP_DESC,
        DN, DV, DR, R, BLOCK_N, BLOCK_DN, BLOCK_DN2, BLOCK_DV, BLOCK_DR, True, DOT_PREC, USE_TMA)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(OUT + tok[:, None] * stride_o_t + h * stride_o_h + offs_dv[None, :], out.to(OUT.dtype.element_ty),
             mask=mmask[:, None] & (offs_dv[None, :] < DV))
