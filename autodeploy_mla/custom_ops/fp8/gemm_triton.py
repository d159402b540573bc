"""Triton W8A8 block-FP8 GEMM: y[M, N] = sum over K blocks of x_scale[m, kb] * w_scale[nb, kb] *
(x_fp8[m, kb-block] . w_fp8[n, kb-block]) (+ bias), fp32 accumulation, output in the model dtype.

Design (DeepSeek-V3's recipe, on tensor cores):
- One `tl.dot` per K tile on the e4m3 codes, started from zero, then scaled by the tile's activation
  scales (a column per row) and weight scales (a row per output column) and added into an fp32
  accumulator. The K tile divides the K block, so one scale pair covers it; restarting the dot per
  tile is also the "promotion" DeepSeek describes: Hopper's FP8 MMA accumulates with reduced
  precision, so partial sums are moved into fp32 every 128 columns of K at the latest.
- The weight is read in its checkpoint layout [N, K] (K contiguous: the K-major B operand FP8 MMA
  wants on SM90); the activations are quantized just before (act_quant.py), [M, K] row-major. A
  variant that quantized them inside the GEMM (saving that launch at decode sizes) was measured on
  the H200 and removed: every N tile redid its rows' division, which made it 1.5-8x slower than the
  separate launch at T 1-64 (docs/benchmarks/fp8_weights_kernels.md).
- Prefill sizes (M > 64): 128 x 128 output tiles, grouped launch order so consecutive programs share
  weight tiles in L2. Decode sizes (M <= 64): 16-64 row tiles and split-K so that even a layer with
  few output tiles puts every SM to streaming its share of the weight; the fp32 partial sums of the
  splits are added (with the bias, cast to the output dtype) by a second small kernel.

Launch configs are pure functions of (M, N, K) (`gemm_config`), untuned until the H200 benchmark
(`python -m benchmarks.kernels.fp8_gemm --tune`) has measured them. Under TRITON_INTERPRET=1 the FP8
products are computed in fp32 from the same codes (exact), which is how the CPU tests check the
kernel's indexing and scaling against the emulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..triton_helpers import interpreting, pow2
from .act_quant import act_quant
from .emulation import check_block_weight

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    TRITON_IMPORT_ERROR = ""
except ImportError as e:  # pragma: no cover - exercised only without triton
    triton = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = str(e)

#: SMs assumed when sizing split-K off a GPU (interpreter tests): an H200's
DEFAULT_SMS = 132


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def gemm_config(m: int, n: int, k: int, group_k: int, compiled: bool, num_sms: int = DEFAULT_SMS) -> GemmConfig:
    """The launch config for an [m, k] x [n, k]^T product with activation groups of `group_k` columns."""
    if not compiled:  # the interpreter: small tiles keep it quick; split-K exercised by explicit configs in tests
        return GemmConfig(16, 32, min(group_k, 32), 1, 4, 1, 1)
    bk = min(group_k, 128)
    if m <= 64:  # decode: stream the weight with enough programs for every SM
        bm, bn, warps, stages = min(64, max(16, pow2(m))), 64, 4, 4
    elif m <= 256:
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 4
    tiles = -(-m // bm) * -(-n // bn)
    k_tiles = -(-k // bk)
    split = 1
    if tiles < num_sms and k_tiles >= 4:
        split = min(-(-2 * num_sms // tiles), k_tiles // 2)
        split = -(-k_tiles // -(-k_tiles // split))  # no empty split
    return GemmConfig(bm, bn, bk, max(1, split), 8, warps, stages)


if HAS_TRITON:

    @triton.jit
    def fp8_dot(a, b, INTERPRETED: tl.constexpr):
        # the interpreter multiplies the same e4m3 codes in fp32 (exact products, fp32 sums)
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def w8a8_block_gemm_kernel(
        A, AS, W, WS, BIAS, C,
        M, N, K, split_k,
        stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_wsk, stride_cs, stride_cm,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr,
    ):
        """One BLOCK_M x BLOCK_N output tile over this program's share of the K tiles. Not SPLIT: C is the
        output (bias added, cast); SPLIT: C is the fp32 workspace [split_k, M, N] (split_k a run-time
        value, so split counts share one compile)."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows_in_group
        pid_n = (pid % per_group) // rows_in_group

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = offs_m < M
        nmask = offs_n < N
        m64 = offs_m.to(tl.int64)
        n64 = offs_n.to(tl.int64)
        ar_k = tl.arange(0, BLOCK_K)
        k_tiles = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_tiles, split_k)
        kt0 = pid_k * per_split
        kt1 = tl.minimum(kt0 + per_split, k_tiles)
        a_rows = A + m64[:, None] * stride_am
        w_cols = W + n64[None, :] * stride_wn
        as_rows = AS + m64 * stride_asm
        ws_cols = WS + (offs_n // GROUP_N).to(tl.int64) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kt in range(kt0, kt1):
            offs_k = kt * BLOCK_K + ar_k
            kmask = offs_k < K
            a = tl.load(a_rows + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_cols + offs_k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            kb = (kt * BLOCK_K) // GROUP_K
            a_s = tl.load(as_rows + kb * stride_ask, mask=mmask, other=0.0)
            w_s = tl.load(ws_cols + kb * stride_wsk, mask=nmask, other=0.0)
            acc += fp8_dot(a, w, INTERPRETED) * a_s[:, None] * w_s[None, :]
        cmask = mmask[:, None] & nmask[None, :]
        if not SPLIT:
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(C + m64[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty), mask=cmask)
        else:
            tl.store(C + pid_k * stride_cs + m64[:, None] * stride_cm + offs_n[None, :], acc, mask=cmask)

    @triton.jit
    def splitk_sum_kernel(P, BIAS, C, M, N, stride_ps, split_k, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """C[m, n] = sum over splits of P[s, m, n] (+ bias[n]), cast to C's dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(split_k):
            acc += tl.load(P + s * stride_ps + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


def _split_sum(c: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    m, n = out.shape
    block = 1024
    splitk_sum_kernel[(-(-m * n // block),)](c, bias if bias is not None else c, out, m, n, c.stride(0), c.shape[0],
                                             HAS_BIAS=bias is not None, BLOCK=block)


def w8a8_block_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: Optional[torch.Tensor], block_n: int, block_k: int, out_dtype: torch.dtype,
                    config: Optional[GemmConfig] = None) -> torch.Tensor:
    """[M, N] `out_dtype` from quantized activations (act_quant with group == block_k) and a block-FP8
    weight; `config` overrides the launch config (benchmarks, tests)."""
    if not HAS_TRITON:
        raise RuntimeError(f"the Triton FP8 GEMM needs triton ({TRITON_IMPORT_ERROR}); pip install 'triton>=3.4'")
    m, k = x_fp8.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    dev = x_fp8.device
    compiled = dev.type == "cuda" and not interpreting()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if compiled else DEFAULT_SMS
    cfg = config or gemm_config(m, n, k, block_k, compiled, sms)
    if block_k % cfg.block_k:
        raise ValueError(f"GemmConfig.block_k={cfg.block_k} must divide the weight's K block {block_k}")
    has_bias = bias is not None
    grid_mn = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    c = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=dev)
    w8a8_block_gemm_kernel[(grid_mn, cfg.split_k)](
        x_fp8, x_scale, weight, weight_scale, bias if has_bias else x_scale, c,
        m, n, k, cfg.split_k,
        x_fp8.stride(0), x_scale.stride(0), x_scale.stride(1), weight.stride(0), weight_scale.stride(0),
        weight_scale.stride(1), c.stride(0) if cfg.split_k > 1 else 0, n,
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SPLIT=cfg.split_k > 1, HAS_BIAS=has_bias, INTERPRETED=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        _split_sum(c, bias, out)
    return out


def triton_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                        block_n: int, block_k: int, config: Optional[GemmConfig] = None) -> torch.Tensor:
    """The whole W8A8 linear: quantize x ([..., K]) per token and block_k group (one act_quant launch),
    then the GEMM."""
    check_block_weight("fp8_block_linear_triton", weight, weight_scale, block_n, block_k)
    if weight.stride(1) != 1:
        raise ValueError("fp8_block_linear_triton: the weight must be K-contiguous ([N, K] row-major), got strides "
                         f"{weight.stride()}")
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = act_quant(x.reshape(-1, k), block_k)
    y = w8a8_block_gemm(xq, xs, weight, weight_scale, bias, block_n, block_k, x.dtype, config)
    return y.reshape(*lead, weight.shape[0])


__all__ = ["DEFAULT_SMS", "GemmConfig", "HAS_TRITON", "TRITON_IMPORT_ERROR", "gemm_config", "triton_block_linear",
           "w8a8_block_gemm"]
