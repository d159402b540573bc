"""One op per FP8 linear backend, all with the source op's signature:

    torch.ops.autodeploy.fp8_block_linear_<backend>(x, weight, weight_scale_inv, bias, block_n, block_k)

`resolve_fp8_linear` rewrites each `fp8_block_linear` node into the op its descriptor (backends.py)
accepted. Every op takes x of any leading dims ([..., K]), returns [..., N] in x.dtype, and launches
nothing on shapes its descriptor's `check()` refuses (the op re-checks what it cannot serve and raises
with the reason instead of launching).

- `torch`: dequantize the weight to x.dtype and run a plain linear (W8A16, activations unquantized):
  runs anywhere; on a GPU it materializes a 16-bit copy of one weight per call.
- `triton`: activations quantized per token and K block (act_quant.py), our W8A8 GEMM (gemm_triton.py).
- `scaled_mm`: the same activation quantization, then cuBLAS's block-scaled FP8 GEMM through
  `torch.nn.functional.scaled_mm` (activations `BlockWise1x128`, weight `BlockWise128x128`).
- `flashinfer`: FlashInfer's SM90 block-scale GEMM `fp8_blockscale_gemm_sm90`, which quantizes the
  bf16 activations itself (per token and 128 columns) and reads the checkpoint's [N/128, K/128] scales.
- `cublas_triton`: per call, by the number of tokens T (x's rows, a shape: known on the host, no
  sync; each CUDA-graph bucket has one T, so a captured step always replays the same path):
  `scaled_mm` for T >= CUBLAS_MIN_TOKENS, the Triton path below. A node of the graph sees prefill
  and decode steps alike, so one backend per node has to be good at both; on the H200 neither
  single kernel was (docs/benchmarks/fp8_weights_kernels.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..triton_helpers import interpreting
from .act_quant import HAS_TRITON as _ACT_TRITON
from .act_quant import ScaleMajor, act_quant, act_quant_reference
from .emulation import check_block_weight, dequantize_blocks
from .gemm_triton import triton_block_linear

#: the block both library backends (cuBLAS block scaling, FlashInfer SM90) are built for
LIBRARY_BLOCK = (128, 128)
#: `cublas_triton`: tokens from which cuBLAS runs. Measured on the H200 (docs/benchmarks/fp8_weights_kernels.md,
#: 2026-11-29, DeepSeek-V3 and V2-Lite shapes): at T <= 64 Triton (act_quant + GEMM) was as fast as cuBLAS or
#: faster on every shape; from T = 128 cuBLAS was faster on all but the narrow ones (N <= 2112, where the two
#: were within 3 us), up to 1.9x at T 2048 / 8192. 65 puts Triton's split-K decode configs (M <= 64) below
#: and cuBLAS above.
CUBLAS_MIN_TOKENS = 65


def quantize_activations(x2: torch.Tensor, group: int, scale_major: ScaleMajor = "k") -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant's kernel where Triton runs (CUDA, or the interpreter), its torch reference elsewhere."""
    if _ACT_TRITON and (x2.device.type == "cuda" or interpreting()) and group >= 16 and not group & (group - 1):
        return act_quant(x2, group, scale_major)
    q, s = act_quant_reference(x2, group)
    return q, (s if scale_major == "k" else s.t().contiguous().t())


def _fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, name: str):
    check_block_weight(name, weight, scale, block_n, block_k)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[-1]} columns, the weight {weight.shape[1]}")
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _library_block(name: str, block_n: int, block_k: int) -> None:
    if (block_n, block_k) != LIBRARY_BLOCK:
        raise ValueError(f"{name}: serves block size {LIBRARY_BLOCK} only, got ({block_n}, {block_k})")


# ----------------------------------------------------------------------------- torch
@torch.library.custom_op("autodeploy::fp8_block_linear_torch", mutates_args=())
def fp8_block_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                           bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize_blocks(weight, weight_scale_inv, block_n, block_k, x.dtype), bias)


@fp8_block_linear_torch.register_fake
def _(x, weight, weight_scale_inv, bias, block_n, block_k):
    return _fake(x, weight, weight_scale_inv, block_n, block_k, "fp8_block_linear_torch")


# ----------------------------------------------------------------------------- triton
@torch.library.custom_op("autodeploy::fp8_block_linear_triton", mutates_args=())
def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                            bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    return triton_block_linear(x, weight, weight_scale_inv, bias, block_n, block_k)


@fp8_block_linear_triton.register_fake
def _(x, weight, weight_scale_inv, bias, block_n, block_k):
    return _fake(x, weight, weight_scale_inv, block_n, block_k, "fp8_block_linear_triton")


# ----------------------------------------------------------------------------- cuBLAS through torch
def scaled_mm_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: Optional[torch.Tensor]) -> torch.Tensor:
    """cuBLAS block-scaled FP8 GEMM. Scale layouts torch's ScaledBlas.cpp requires for (1x128 x 128x128):
    activations' [M, ceil(K/128)] with strides (1, M) (act_quant writes them so); the weight's
    [round_up(ceil(K/128), 4), ceil(N/128)] with strides (1, that row count): the checkpoint's scale
    padded to a multiple of 4 K blocks (a copy only when ceil(K/128) % 4 != 0), transposed (a view)."""
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    # cuBLAS has no block-scaled algorithm for M = 1 on the H200 (CUBLAS_STATUS_NOT_SUPPORTED from its
    # heuristic, 2026-11-29; M = 16 and 64 ran): rows are padded to a multiple of 16 (decode-sized
    # activations only: a copy of at most 15 extra rows)
    pad_m = -m % 16
    if pad_m:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad_m))
    xq, xs = quantize_activations(x2, LIBRARY_BLOCK[1], "t")
    kb = weight_scale.shape[1]
    pad = -kb % 4
    ws = torch.nn.functional.pad(weight_scale, (0, pad)) if pad else weight_scale.contiguous()
    y = scaled_mm(xq, weight.t(), xs, ScalingType.BlockWise1x128, ws.t(), ScalingType.BlockWise128x128,
                  swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=x.dtype)
    if pad_m:
        y = y[:m]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


@torch.library.custom_op("autodeploy::fp8_block_linear_scaled_mm", mutates_args=())
def fp8_block_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                               bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    check_block_weight("fp8_block_linear_scaled_mm", weight, weight_scale_inv, block_n, block_k)
    _library_block("fp8_block_linear_scaled_mm", block_n, block_k)
    return scaled_mm_block_linear(x, weight, weight_scale_inv, bias)


@fp8_block_linear_scaled_mm.register_fake
def _(x, weight, weight_scale_inv, bias, block_n, block_k):
    return _fake(x, weight, weight_scale_inv, block_n, block_k, "fp8_block_linear_scaled_mm")


# ----------------------------------------------------------------------------- cuBLAS for prefill, Triton for decode
def uses_cublas(x: torch.Tensor) -> bool:
    """Whether `cublas_triton` runs cuBLAS for this input: its token count, from the shape alone."""
    k = x.shape[-1]
    return (x.numel() // k if k else 0) >= CUBLAS_MIN_TOKENS


@torch.library.custom_op("autodeploy::fp8_block_linear_cublas_triton", mutates_args=())
def fp8_block_linear_cublas_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                                   bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    check_block_weight("fp8_block_linear_cublas_triton", weight, weight_scale_inv, block_n, block_k)
    _library_block("fp8_block_linear_cublas_triton", block_n, block_k)
    if uses_cublas(x):
        return scaled_mm_block_linear(x, weight, weight_scale_inv, bias)
    return triton_block_linear(x, weight, weight_scale_inv, bias, block_n, block_k)


@fp8_block_linear_cublas_triton.register_fake
def _(x, weight, weight_scale_inv, bias, block_n, block_k):
    return _fake(x, weight, weight_scale_inv, block_n, block_k, "fp8_block_linear_cublas_triton")


# ----------------------------------------------------------------------------- FlashInfer SM90
def flashinfer_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor]) -> torch.Tensor:
    """FlashInfer's `fp8_blockscale_gemm_sm90` on bf16 activations (it quantizes them itself)."""
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except ImportError as e:
        raise RuntimeError(f"fp8_block_linear_flashinfer: this FlashInfer has no fp8_blockscale_gemm_sm90 ({e}); "
                           "use fp8_linear backend triton or scaled_mm") from e
    lead, k = x.shape[:-1], x.shape[-1]
    y = fp8_blockscale_gemm_sm90(input=x.reshape(-1, k).contiguous(), weight=weight, input_scale=None,
                                 weight_scale=weight_scale, out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


@torch.library.custom_op("autodeploy::fp8_block_linear_flashinfer", mutates_args=())
def fp8_block_linear_flashinfer(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                                bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    check_block_weight("fp8_block_linear_flashinfer", weight, weight_scale_inv, block_n, block_k)
    _library_block("fp8_block_linear_flashinfer", block_n, block_k)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_block_linear_flashinfer: bf16 activations only, got {x.dtype}")
    return flashinfer_block_linear(x, weight, weight_scale_inv, bias)


@fp8_block_linear_flashinfer.register_fake
def _(x, weight, weight_scale_inv, bias, block_n, block_k):
    return _fake(x, weight, weight_scale_inv, block_n, block_k, "fp8_block_linear_flashinfer")


__all__ = ["CUBLAS_MIN_TOKENS", "LIBRARY_BLOCK", "flashinfer_block_linear", "fp8_block_linear_cublas_triton",
           "fp8_block_linear_flashinfer", "fp8_block_linear_scaled_mm", "fp8_block_linear_torch", "fp8_block_linear_triton",
           "quantize_activations", "scaled_mm_block_linear", "uses_cublas"]
