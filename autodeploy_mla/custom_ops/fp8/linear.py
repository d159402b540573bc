"""The FP8 source ops: `torch.ops.autodeploy.fp8_block_linear` and `fp8_block_dequantize`.

`fp8_block_linear(x, weight, weight_scale_inv, bias, block_n, block_k)` is what an exported graph
holds for every linear of an FP8 checkpoint (models/fp8_modules.py puts it there): weight
`float8_e4m3fn [N, K]`, `weight_scale_inv float32 [ceil(N/block_n), ceil(K/block_k)]`, output in
x's dtype. Passes see it as a linear (fuse_gemms, shard, match_mla) and `resolve_fp8_linear`
rewrites each node into the backend chosen for it. Its implementation here is the reference:
dequantize the blocks (models/fp8_format.dequantize) and run a linear in x's dtype — what the CPU
runs and what the HF comparison with dequantized weights reproduces exactly in fp32.

`fp8_block_dequantize(weight, scale_inv, block_n, block_k, dtype)` is the real weight of an FP8
weight of any leading dims ([E, N, K] experts included); the FP8 experts forward calls it before
transformers' grouped GEMMs (fuse_moe then swaps the region for an FP8 MoE op), and match_mla
uses it for the 16-bit kv_b_proj that weight absorption needs (folded into a parameter once the
weights are real).

Both check their shapes (a malformed call names the tensor), never synchronise with the host and
mutate nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .format import FP8_DTYPE, dequantize, scale_shape


def check_fp8_weight(op: str, weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int) -> None:
    """ValueError naming the argument unless (weight, scale_inv) is an FP8 weight [..., N, K] and
    its float32 block grid."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{op}: weight must be {FP8_DTYPE}, got {weight.dtype}")
    if scale_inv.dtype != torch.float32:
        raise ValueError(f"{op}: weight_scale_inv must be torch.float32, got {scale_inv.dtype}")
    if block_n <= 0 or block_k <= 0:
        raise ValueError(f"{op}: block_n and block_k must be positive, got {block_n}, {block_k}")
    if weight.dim() < 2:
        raise ValueError(f"{op}: weight must be [..., N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], *scale_shape(n, k, (block_n, block_k)))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{op}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for weight "
                         f"{tuple(weight.shape)} in blocks of [{block_n}, {block_k}]")


def _check_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: Optional[torch.Tensor],
                  block_n: int, block_k: int) -> None:
    check_fp8_weight("fp8_block_linear", weight, scale_inv, block_n, block_k)
    if weight.dim() != 2:
        raise ValueError(f"fp8_block_linear: weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_block_linear: x has {x.shape[-1]} features, the weight takes K={weight.shape[1]}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"fp8_block_linear: x must be a 16/32-bit float tensor, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_block_linear: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")


@torch.library.custom_op("autodeploy::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    """x @ dequantize(weight)^T + bias, in x's dtype (reference: dequantize, then linear)."""
    _check_linear(x, weight, weight_scale_inv, bias, block_n, block_k)
    w = dequantize(weight, weight_scale_inv, (block_n, block_k), x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@fp8_block_linear.register_fake
def _fp8_block_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                           bias: Optional[torch.Tensor], block_n: int, block_k: int) -> torch.Tensor:
    _check_linear(x, weight, weight_scale_inv, bias, block_n, block_k)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("autodeploy::fp8_block_dequantize", mutates_args=())
def fp8_block_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """The real weight [..., N, K] in `dtype` of an FP8 weight and its block scales."""
    check_fp8_weight("fp8_block_dequantize", weight, scale_inv, block_n, block_k)
    return dequantize(weight, scale_inv, (block_n, block_k), dtype)


@fp8_block_dequantize.register_fake
def _fp8_block_dequantize_fake(weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int,
                               dtype: torch.dtype) -> torch.Tensor:
    check_fp8_weight("fp8_block_dequantize", weight, scale_inv, block_n, block_k)
    return weight.new_empty(weight.shape, dtype=dtype)


FP8_LINEAR = torch.ops.autodeploy.fp8_block_linear.default
FP8_DEQUANTIZE = torch.ops.autodeploy.fp8_block_dequantize.default

__all__ = ["FP8_DEQUANTIZE", "FP8_LINEAR", "check_fp8_weight", "fp8_block_dequantize", "fp8_block_linear"]
