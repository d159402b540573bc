"""The fp32 emulation of W8A8 block FP8, the oracle of every FP8 kernel test.

It computes what the kernels compute, without their arithmetic shortcuts: activations quantized
exactly as the kernels quantize them (`act_quant_reference`, the same bits), both operands
dequantized to fp32 (codes times their block scale), one fp32 matmul. A kernel then differs from it
only by its summation order and its tensor cores' accumulation, not by any quantization choice, so
a tight tolerance separates a correct kernel from a wrong one.

`dequantize_blocks` is the weight side: `weight_scale_inv[nb, kb]` multiplies the
`block_n x block_k` block at (nb, kb); the last block row/column may be partial.
"""

from __future__ import annotations

from typing import Optional

import torch

from .act_quant import act_quant_reference
from .format import dequantize
from .linear import check_fp8_weight


def check_block_weight(name: str, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> None:
    """ValueError naming the offending tensor when `weight` / `scale` are not a 2-D block-FP8 pair
    (the source op's check, plus: a linear's weight is [N, K])."""
    check_fp8_weight(name, weight, scale, block_n, block_k)
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be [N, K], got shape {tuple(weight.shape)}")


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] `dtype`: each block's fp8 codes times its scale (format.dequantize, after the check)."""
    check_block_weight("dequantize_blocks", weight, scale, block_n, block_k)
    return dequantize(weight, scale, (block_n, block_k), dtype)


def dequantize_activations(x_fp8: torch.Tensor, x_scale: torch.Tensor, group: int) -> torch.Tensor:
    """[T, K] fp32 from per-token, per-group codes and scales."""
    k = x_fp8.shape[-1]
    return x_fp8.float() * x_scale.repeat_interleave(group, -1)[..., :k]


def w8a8_block_linear_emulated(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                               bias: Optional[torch.Tensor], block_n: int, block_k: int,
                               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = quant(x) @ dequant(W).T + bias, fp32 throughout, returned as `out_dtype` (default x.dtype).
    x may have leading dims ([..., K]), as a linear's input does."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, xs = act_quant_reference(x2, block_k)
    y = dequantize_activations(xq, xs, block_k) @ dequantize_blocks(weight, scale, block_n, block_k).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*lead, weight.shape[0])


__all__ = ["check_block_weight", "dequantize_activations", "dequantize_blocks", "w8a8_block_linear_emulated"]
