"""Triton kernels of the block-FP8 MoE experts op (W8A8, as the dense FP8 GEMM: fp8.gemm_triton).

They run over the same expert layout as the 16-bit op (kernels.count_kernel / place_kernel: the
step's (token, k) pairs in expert order, in row blocks of one expert each), so routing, padding and
CUDA-graph safety are the 16-bit op's:

- `up_fp8_kernel`: one program per (128-column group of the intermediate, row block). Gathers its
  rows' FP8 activation codes and scales by token, multiplies by the expert's gate and up rows with a
  rescale per K tile (activation scale per row, weight block scale per column), applies silu(gate) *
  up, rounds it to the model dtype (the intermediate the unfused pipeline would hold) and quantizes
  it in the epilogue: the tile is exactly one activation group (BLOCK_N == GROUP_K), so its per-row
  amax is the group's. The [slots, I] intermediate is written once, already FP8, with its scales.
- `down_fp8_kernel`: the FP8 intermediate times the expert's down rows, rescaled per K tile, times
  each pair's routing weight, into the pair's row of [n, H]; the op sums over top-k as the 16-bit
  op does (ops._sum_over_topk).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..fp8.act_quant import round_to_e4m3
from ..fp8.gemm_triton import fp8_dot
from .kernels import _block_pairs, _store_weighted


@triton.jit
def _round_to(h, MID_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """`h` (fp32) rounded to MID_DTYPE, back in fp32. The interpreter's fp32 -> bf16 cast truncates (triton
    3.6-3.9), so there bf16 is rounded to nearest even on the bits (fp16 and fp32 casts are exact there)."""
    if INTERPRETED and MID_DTYPE == tl.bfloat16:
        raw = h.to(tl.int32, bitcast=True)
        return ((raw + (0x7FFF + ((raw >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
    else:
        return h.to(MID_DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["n_pairs"])
def up_fp8_kernel(
    XQ, XS, W, WS, SORTED, BLOCK_EXPERT, OUTQ, OUTS,
    n_pairs, K, N,
    stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_ot, stride_ost,
    TOP_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MID_DTYPE: tl.constexpr,
    FP8_MAX_C: tl.constexpr, AMAX_FLOOR_C: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """OUTQ[slot, n], OUTS[slot, group] = quant(act(x[tok] . W[e, n]) * (x[tok] . W[e, N + n])) for the
    block's slots, x given as codes XQ [T, K] and scales XS [T, K / GROUP_K]."""
    pid_n = tl.program_id(0)  # fastest: a row block's column tiles run together, its rows stay in L2
    pid_m = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M)
    tok = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    a_ptr = XQ + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptr = W + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptr = g_ptr + N * stride_wn
    ws_e = WS + e64 * stride_wse
    sg_ptr = ws_e + (offs_n // GROUP_N) * stride_wsn
    su_ptr = ws_e + ((N + offs_n) // GROUP_N) * stride_wsn
    xs_ptr = XS + tok * stride_xst
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(g_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        wu = tl.load(u_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        kb = k0 // GROUP_K
        a_s = tl.load(xs_ptr + kb, mask=rmask, other=0.0)[:, None]
        acc_g += fp8_dot(a, wg, INTERPRETED) * a_s * tl.load(sg_ptr + kb * stride_wsk, mask=nmask, other=0.0)[None, :]
        acc_u += fp8_dot(a, wu, INTERPRETED) * a_s * tl.load(su_ptr + kb * stride_wsk, mask=nmask, other=0.0)[None, :]
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up
    h = tl.where(nmask[None, :], _round_to(h, MID_DTYPE, INTERPRETED), 0.0)
    amax = tl.maximum(tl.max(tl.abs(h), axis=1), AMAX_FLOOR_C)
    s = tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX_C, tl.float32))
    q = tl.math.div_rn(h, s[:, None])
    q = round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C))  # exact cast below (act_quant.py)
    s64 = slots.to(tl.int64)
    tl.store(OUTQ + s64[:, None] * stride_ot + offs_n[None, :], q.to(OUTQ.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])
    tl.store(OUTS + s64 * stride_ost + pid_n, s, mask=rmask)


@triton.jit(do_not_specialize=["n_pairs"])
def down_fp8_kernel(
    AQ, AS, W, WS, SORTED, BLOCK_EXPERT, TOPK_W, OUT,
    n_pairs, K, N,
    stride_at, stride_ast, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_ot,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """OUT[pair, n] = weight[pair] * (A[slot] . W[e, n]), A given as FP8 codes AQ and scales AS."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    s64 = slots.to(tl.int64)
    a_ptr = AQ + s64[:, None] * stride_at + offs_k[None, :]
    w_ptr = W + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    ws_ptr = WS + e64 * stride_wse + (offs_n // GROUP_N) * stride_wsn
    as_ptr = AS + s64 * stride_ast
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        kb = k0 // GROUP_K
        a_s = tl.load(as_ptr + kb, mask=rmask, other=0.0)
        w_s = tl.load(ws_ptr + kb * stride_wsk, mask=nmask, other=0.0)
        acc += fp8_dot(a, w, INTERPRETED) * a_s[:, None] * w_s[None, :]
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    _store_weighted(acc, TOPK_W, OUT, pairs, rmask, offs_n, nmask, stride_ot)
