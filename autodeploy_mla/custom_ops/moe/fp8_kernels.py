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


# ----------------------------------------------------------------------------- sorted rows, persistent (prefill)
# The 16-bit op's prefill design (kernels.gather_kernel / up_sorted_kernel / down_sorted_kernel) on FP8
# operands: the activations are quantized once (act_quant, per token and GROUP_K columns, as above) and their
# codes and scales copied into expert order (`gather_fp8_kernel`: [slots, H] codes, [slots, H / GROUP_K]
# scales, zeros in padding slots), so neither GEMM gathers rows by token in its K loop. Both GEMMs are
# persistent (NUM_PROGRAMS programs, one per SM, walk the used row blocks' tiles row block by row block, so
# a block's rows and its expert's weights stay in L2 across its column tiles) and the up GEMM multiplies the
# gate and up rows in one [BLOCK_M, 2 * BLOCK_N] product per K step (the input tile read once, not twice).
# Operands are loaded through plain pointers, not TMA descriptors, so the kernels run under TRITON_INTERPRET=1
# and on any GPU; descriptors (as the 16-bit kernels use on SM90) are the next step once this is measured.
# Opt-in (MoEConfig.persistent_sorted) until the H200 sweep has measured it (benchmarks/moe/sweep_moe_fp8.py).
@triton.jit(do_not_specialize=["n_pairs"])
def gather_fp8_kernel(
    XQ, XS, SORTED, BLOCK_EXPERT, XQ_S, XS_S,
    n_pairs, H, KB,
    stride_xt, stride_xst,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr,
):
    """XQ_S[slot, group pid_h] = XQ[token of slot's pair, group pid_h] and XS_S[slot, pid_h] its scale (0 in
    padding slots), for the row blocks that hold an expert. XQ_S is [slots, H] and XS_S [slots, KB], dense."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M)
    tok = (pairs // TOP_K).to(tl.int64)
    s64 = slots.to(tl.int64)
    offs_h = pid_h * GROUP_K + tl.arange(0, GROUP_K)
    hmask = offs_h < H
    q = tl.load(XQ + tok[:, None] * stride_xt + offs_h[None, :], mask=rmask[:, None] & hmask[None, :], other=0.0)
    tl.store(XQ_S + s64[:, None] * H + offs_h[None, :], q, mask=hmask[None, :])
    s = tl.load(XS + tok * stride_xst + pid_h, mask=rmask, other=0.0)
    tl.store(XS_S + s64 * KB + pid_h, s)


@triton.jit
def up_fp8_sorted_kernel(
    XQ, XS, W, WS, BLOCK_EXPERT, NUM_BLOCKS, OUTQ, OUTS,
    K, N,
    stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_ot, stride_ost,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    MID_DTYPE: tl.constexpr, FP8_MAX_C: tl.constexpr, AMAX_FLOOR_C: tl.constexpr, INTERPRETED: tl.constexpr,
    EVEN: tl.constexpr,
):
    """up_fp8_kernel's result over sorted rows: OUTQ[slot, n], OUTS[slot, group] = quant(act(xs[slot] . W[e, n]) *
    (xs[slot] . W[e, N + n])), xs given as sorted codes XQ [slots, K] and scales XS [slots, K / GROUP_K].

    Persistent over (row block, column tile) tiles of the blocks in use (NUM_BLOCKS, read on the device).
    One [BLOCK_K, 2 * BLOCK_N] weight tile holds the gate rows n and the up rows N + n (column j < BLOCK_N:
    gate row n0 + j, else up row N + n0 + j - BLOCK_N), each column rescaled by its own row's block scale, so
    the gate and up halves need not share a scale block; one product per K step, rescaled by the activation
    scale per row, added into one fp32 accumulator, split into its halves for the epilogue, which is
    up_fp8_kernel's (silu(gate) * up, rounded to MID_DTYPE, quantized per row over the tile: BLOCK_N ==
    GROUP_K, one activation group). Every slot of a used block is written (padding slots hold zeros).
    EVEN: K % BLOCK_K == 0 and N % BLOCK_N == 0 (the real models' dims): the K loop's loads go unmasked."""
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, 2 * BLOCK_N)
    half = offs_c // BLOCK_N  # 0: gate column, 1: up column
    col = offs_c % BLOCK_N
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        e64 = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
        s64 = (pid_m * BLOCK_M + offs_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + col
        cmask = offs_n < N
        rows_w = half * N + offs_n  # [2 * BLOCK_N] rows of w_up[e]
        a_ptr = XQ + s64[:, None] * stride_xt + offs_k[None, :]
        w_ptr = W + e64 * stride_we + rows_w[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        ws_ptr = WS + e64 * stride_wse + (rows_w // GROUP_N) * stride_wsn
        as_ptr = XS + s64 * stride_xst
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // GROUP_K
            if EVEN:
                a = tl.load(a_ptr)
                w = tl.load(w_ptr)
                w_s = tl.load(ws_ptr + kb * stride_wsk)
            else:
                kmask = offs_k < K - k0
                a = tl.load(a_ptr, mask=kmask[None, :], other=0.0)
                w = tl.load(w_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
                w_s = tl.load(ws_ptr + kb * stride_wsk, mask=cmask, other=0.0)
            a_s = tl.load(as_ptr + kb)[:, None]
            acc += fp8_dot(a, w, INTERPRETED) * a_s * w_s[None, :]
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_o < N
        h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
        h = tl.where(nmask[None, :], _round_to(h, MID_DTYPE, INTERPRETED), 0.0)
        amax = tl.maximum(tl.max(tl.abs(h), axis=1), AMAX_FLOOR_C)
        s = tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX_C, tl.float32))
        q = tl.math.div_rn(h, s[:, None])
        q = round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C))  # exact cast below (act_quant.py)
        tl.store(OUTQ + s64[:, None] * stride_ot + offs_o[None, :], q.to(OUTQ.dtype.element_ty), mask=nmask[None, :])
        tl.store(OUTS + s64 * stride_ost + pid_n, s)


@triton.jit(do_not_specialize=["n_pairs"])
def down_fp8_sorted_kernel(
    AQ, AS, W, WS, SORTED, BLOCK_EXPERT, NUM_BLOCKS, TOPK_W, OUT,
    n_pairs, K, N,
    stride_at, stride_ast, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_ot,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    INTERPRETED: tl.constexpr, EVEN: tl.constexpr,
):
    """down_fp8_kernel persistent (tiles as up_fp8_sorted_kernel): OUT[pair, n] = weight[pair] * (A[slot] . W[e, n]),
    A the sorted FP8 intermediate (codes AQ, scales AS; every slot of a used block written by the up kernel).
    EVEN: as up_fp8_sorted_kernel's."""
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        e64 = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
        slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M)
        s64 = slots.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        a_ptr = AQ + s64[:, None] * stride_at + offs_k[None, :]
        w_ptr = W + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        ws_ptr = WS + e64 * stride_wse + (offs_n // GROUP_N) * stride_wsn
        as_ptr = AS + s64 * stride_ast
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // GROUP_K
            if EVEN:
                a = tl.load(a_ptr)
                w = tl.load(w_ptr)
                w_s = tl.load(ws_ptr + kb * stride_wsk)
            else:
                kmask = offs_k < K - k0
                a = tl.load(a_ptr, mask=kmask[None, :], other=0.0)
                w = tl.load(w_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
                w_s = tl.load(ws_ptr + kb * stride_wsk, mask=nmask, other=0.0)
            a_s = tl.load(as_ptr + kb)
            acc += fp8_dot(a, w, INTERPRETED) * a_s[:, None] * w_s[None, :]
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K
        _store_weighted(acc, TOPK_W, OUT, pairs, rmask, offs_n, nmask, stride_ot)
