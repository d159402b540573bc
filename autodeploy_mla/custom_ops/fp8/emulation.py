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


def check_block_weight(name: str, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> None:
    """ValueError naming the offending tensor when `weight` / `scale` are not a block-FP8 pair."""
    if block_n < 1 or block_k < 1:
        raise ValueError(f"{name}: block size ({block_n}, {block_k}) must be positive")
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be [N, K], got shape {tuple(weight.shape)}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape
    want = (-(-n // block_n), -(-k // block_k))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: weight_scale_inv must be [ceil(N/{block_n}), ceil(K/{block_k})] = {list(want)} "
                         f"for a weight of shape {[n, k]}, got {list(scale.shape)}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: weight_scale_inv must be float32, got {scale.dtype}")


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] `dtype`: each block's fp8 codes times its scale (in fp32, then cast)."""
    check_block_weight("dequantize_blocks", weight, scale, block_n, block_k)
    n, k = weight.shape
    s = scale.repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return (weight.float() * s).to(dtype)


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
