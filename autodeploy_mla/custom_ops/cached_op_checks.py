"""Input validation shared by every cached MLA op (shapes only: safe under fake tensors, no sync)."""

from __future__ import annotations

import torch

from .mla_dims import MLADims, MLAShapeError, infer_dims


def check_cached_inputs(
    op: str,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    mla_cache: torch.Tensor,
) -> MLADims:
    """Validate the flattened-batch inputs ([1, T, ...] bsnd) and the cache; return the dims."""
    dims, b, _ = infer_dims(op, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, "bsnd")
    if b != 1:
        raise MLAShapeError(
            f"{op}: cached ops run on a flattened token batch — expected batch dim 1 ([1, T, N, D]), "
            f"got q_nope shape {tuple(q_nope.shape)}. Pack sequences along T (SequenceInfo does this)."
        )
    width = dims.kv_lora_rank + dims.qk_rope_head_dim
    if mla_cache.dim() != 3 or mla_cache.shape[-1] != width:
        raise MLAShapeError(
            f"{op}: mla_cache — expected [num_pages, page_size, R+Dr={width}], got {tuple(mla_cache.shape)}."
        )
    if mla_cache.dtype != q_nope.dtype:
        raise MLAShapeError(
            f"{op}: mla_cache dtype {mla_cache.dtype} differs from the activations' {q_nope.dtype}; "
            "allocate the cache in the model dtype."
        )
    return dims


def cached_op_fake(op: str, metadata: tuple[str, ...]):
    """The fake (meta) implementation every cached op shares: validate, return [1, T, N, Dv].

    The cache sits right after the op's metadata arguments (the shared positional signature), so
    its position follows from the backend's metadata tuple instead of a hand-counted index.
    """

    def fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, *rest, **kwargs):
        mla_cache = rest[len(metadata)]
        dims = check_cached_inputs(op, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache)
        return q_nope.new_empty(1, q_nope.shape[1], dims.num_heads, dims.v_head_dim)

    return fake
