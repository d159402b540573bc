"""PLACEHOLDER (KERNELS branch): the source op `torch.ops.autodeploy.fp8_block_linear`.

The GRAPH branch owns this module (its version dequantizes with `format.dequantize`); this minimal
copy exists only so the backend ops and the resolution pass can be built and tested here. It has
exactly the agreed signature and meaning: y = x @ dequantize(weight, weight_scale_inv).T + bias,
computed in x.dtype. Take the GRAPH branch's file at merge.
"""

from __future__ import annotations

from typing import Optional

import torch

from .emulation import check_block_weight, dequantize_blocks


@torch.library.custom_op("autodeploy::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: Optional[torch.Tensor],
                     block_n: int, block_k: int) -> torch.Tensor:
    """Reference: dequantize the blocks to x.dtype, then a plain linear."""
    w = dequantize_blocks(weight, weight_scale_inv, block_n, block_k, x.dtype)
    return torch.nn.functional.linear(x, w, bias)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale_inv, bias, block_n, block_k):
    check_block_weight("fp8_block_linear", weight, weight_scale_inv, block_n, block_k)
    return x.new_empty(*x.shape[:-1], weight.shape[0])
