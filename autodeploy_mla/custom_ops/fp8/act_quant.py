"""Activation quantization of W8A8 block FP8: per token and per group of `group` columns, on the fly.

DeepSeek's reference inference quantizes every activation that enters an FP8 linear this way: each
token's row is cut into groups of 128 columns (the weight's K block, so one activation scale and one
weight scale cover the same K range), and each group is scaled by `amax / 448` into e4m3 (448 is
e4m3fn's largest finite value). The scale is stored in fp32 and multiplies the dot products back.

`act_quant_reference` (torch, any device) and `act_quant` (one Triton kernel) compute the same
bits: the kernel divides with IEEE round-to-nearest (`div_rn`), not Triton's default approximate
division, so kernel tests can compare codes exactly. One deviation from the reference inference:
`amax` is floored at AMAX_FLOOR, so an all-zero group quantizes to zeros instead of 0/0 = NaN.

`scale_major` picks the layout of the returned scales: "k" ([T, KB] contiguous, what our GEMM reads)
or "t" ([T, KB] with strides (1, T): the token-major layout cuBLAS's 1x128 block scaling requires,
written directly by the kernel so no transpose copy follows).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..triton_helpers import interpreting

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    HAS_TRITON = False

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-10
ScaleMajor = Literal["k", "t"]


def num_groups(k: int, group: int) -> int:
    return -(-k // group)


def _check(name: str, x: torch.Tensor, group: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [T, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: x must be fp32/bf16/fp16, got {x.dtype}")
    if group < 1:
        raise ValueError(f"{name}: group must be >= 1, got {group}")


def act_quant_reference(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [T, K] e4m3, x_scale fp32 [T, ceil(K / group)]): x ~= x_fp8 * x_scale per group.
    A partial last group (K not a multiple of `group`) is scaled by its own columns' amax."""
    _check("act_quant_reference", x, group)
    t, k = x.shape
    kb = num_groups(k, group)
    xf = torch.nn.functional.pad(x.float(), (0, kb * group - k)).view(t, kb, group)
    # divided by a tensor, not the Python number: CUDA torch divides by a scalar as a multiply by its
    # rounded reciprocal (12.25 / 448 came out 1 ulp above 7/256 on the H200), CPU torch and the kernel
    # divide exactly, and a scale 1 ulp off moves codes that sit on a rounding midpoint
    scale = xf.abs().amax(-1).clamp_min(AMAX_FLOOR) / torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(t, kb * group)[:, :k].contiguous(), scale


def _alloc_scale(t: int, kb: int, device: torch.device, scale_major: ScaleMajor) -> torch.Tensor:
    if scale_major == "k":
        return torch.empty(t, kb, dtype=torch.float32, device=device)
    if scale_major == "t":
        return torch.empty(kb, t, dtype=torch.float32, device=device).t()
    raise ValueError(f"act_quant: scale_major={scale_major!r}; valid: 'k', 't'")


if HAS_TRITON:

    @triton.jit
    def round_to_e4m3(v):
        """`v` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32.

        Every cast to fp8 goes through it: the interpreter's fp32 -> fp8 cast (triton 3.6-3.9) does not
        carry a rounded-up mantissa into the exponent (124.3 became 64, not 128), and the compiled cast
        on the H200 differed from torch's in some bits; values already on the e4m3 grid convert exactly. Normal range: round the fp32 mantissa to 3 bits on the integer bits (the carry
        then moves into the exponent by itself); below 2^-6 (e4m3 subnormals, a fixed 2^-9 step): the
        add-and-subtract of 1.5 * 2^14, whose fp32 ulp is 2^-9."""
        raw = v.to(tl.int32, bitcast=True)
        bits = (raw + (0x7FFFF + ((raw >> 20) & 1))) & -1048576  # clear the low 20 mantissa bits, RNE
        normal = bits.to(tl.float32, bitcast=True)
        sub = tl.abs((v + 24576.0) - 24576.0)
        # v's sign bit ORed in (a value that rounds to zero stays -0, as torch's cast keeps it): not `-sub`,
        # which Triton lowers to 0 - sub, and 0 - 0 is +0 (the H200's codes differed from torch's there)
        sub = (sub.to(tl.int32, bitcast=True) | (raw & -2147483648)).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(v) < 0.015625, sub, normal)

    @triton.jit
    def act_quant_kernel(X, Q, S, T, K, stride_xt, stride_qt, stride_st, stride_sk,
                         GROUP: tl.constexpr, BLOCK_T: tl.constexpr, FP8_MAX_C: tl.constexpr,
                         AMAX_FLOOR_C: tl.constexpr):
        """Q[t, g*GROUP:(g+1)*GROUP] = x / s, S[t, g] = s = max(amax, floor) / 448, for BLOCK_T rows."""
        pid_t = tl.program_id(0)
        g = tl.program_id(1)
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = g * GROUP + tl.arange(0, GROUP)
        rmask = rows < T
        mask = rmask[:, None] & (cols < K)[None, :]
        r64 = rows.to(tl.int64)
        x = tl.load(X + r64[:, None] * stride_xt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR_C)
        s = tl.math.div_rn(amax, tl.full([BLOCK_T], FP8_MAX_C, tl.float32))
        q = tl.math.div_rn(x, s[:, None])
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
        # rounded to the e4m3 grid here, so the cast below is exact whatever path the compiler takes
        # to fp8 (on the H200, Triton 3.6's own fp32 -> e4m3 cast differed from torch's in some bits)
        q = round_to_e4m3(q)
        tl.store(Q + r64[:, None] * stride_qt + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + r64 * stride_st + g * stride_sk, s, mask=rmask)


def act_quant(x: torch.Tensor, group: int = 128, scale_major: ScaleMajor = "k") -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of `act_quant_reference` (same bits); `group` must be a power of two >= 16."""
    _check("act_quant", x, group)
    if not HAS_TRITON:
        raise RuntimeError("act_quant needs triton; pip install 'triton>=3.4' (or use act_quant_reference)")
    if group < 16 or group & (group - 1):
        raise ValueError(f"act_quant: group {group} must be a power of two >= 16 (the kernel's tile width)")
    if x.stride(1) != 1:
        x = x.contiguous()
    t, k = x.shape
    kb = num_groups(k, group)
    q = torch.empty(t, k, dtype=FP8_DTYPE, device=x.device)
    s = _alloc_scale(t, kb, x.device, scale_major)
    if t == 0 or k == 0:
        return q, s
    block_t = 1 if interpreting() else (4 if t >= 256 else 1)
    act_quant_kernel[(-(-t // block_t), kb)](x, q, s, t, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                             GROUP=group, BLOCK_T=block_t, FP8_MAX_C=FP8_MAX,
                                             AMAX_FLOOR_C=AMAX_FLOOR,
                                             num_warps=1 if group <= 128 else 4)
    return q, s


__all__ = ["AMAX_FLOOR", "FP8_DTYPE", "FP8_MAX", "act_quant", "act_quant_reference", "num_groups"]
