"""The one cached-op contract every backend shares (DESIGN §6), written once.

    <backend>_mla_with_cache(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight,
                             *metadata, mla_cache, scale=None) -> [1, T, N, Dv]

`define_cached_op(name, metadata, impl)` builds that schema from a backend's metadata tuple,
registers the op with the cache write declared (`Tensor(a!) mla_cache`), registers the shared fake
implementation, and calls `impl(x, meta, mla_cache, scale)` with the five MLA inputs as `MLAInputs`
and the metadata as a name -> tensor mapping, so no backend repeats the 17-argument signature or
re-packs its metadata by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import torch

from .mla_dims import MLADims, MLAShapeError, infer_dims

MLA_INPUTS: tuple[str, ...] = ("q_nope", "q_pe", "compressed_kv", "kpe", "kv_b_proj_weight")
CACHE_ARG = "mla_cache"


class MLAInputs(NamedTuple):
    """The five MLA tensors of a cached op, flattened-batch bsnd ([1, T, ...])."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    compressed_kv: torch.Tensor
    kpe: torch.Tensor
    kv_b_proj_weight: torch.Tensor


#: impl(x, metadata by name, mla_cache, scale) -> out [1, T, N, Dv]
CachedImpl = Callable[[MLAInputs, Mapping[str, torch.Tensor], torch.Tensor, Optional[float]], torch.Tensor]


def cached_op_schema(metadata: tuple[str, ...]) -> str:
    args = [f"Tensor {n}" for n in (*MLA_INPUTS, *metadata)]
    return f"({', '.join(args)}, Tensor(a!) {CACHE_ARG}, float? scale=None) -> Tensor"


def check_cached_inputs(op: str, x: MLAInputs, mla_cache: torch.Tensor) -> MLADims:
    """Validate the flattened-batch inputs ([1, T, ...] bsnd) and the cache; return the dims.

    Shapes only: safe under fake tensors, never syncs the device."""
    dims, b, _ = infer_dims(op, *x, "bsnd")
    if b != 1:
        raise MLAShapeError(
            f"{op}: cached ops run on a flattened token batch — expected batch dim 1 ([1, T, N, D]), "
            f"got q_nope shape {tuple(x.q_nope.shape)}. Pack sequences along T (SequenceInfo does this)."
        )
    width = dims.kv_lora_rank + dims.qk_rope_head_dim
    if mla_cache.dim() != 3 or mla_cache.shape[-1] != width:
        raise MLAShapeError(
            f"{op}: mla_cache — expected [num_pages, page_size, R+Dr={width}], got {tuple(mla_cache.shape)}."
        )
    if mla_cache.dtype != x.q_nope.dtype:
        raise MLAShapeError(
            f"{op}: mla_cache dtype {mla_cache.dtype} differs from the activations' {x.q_nope.dtype}; "
            "allocate the cache in the model dtype."
        )
    return dims


def append_to_paged_cache(mla_cache: torch.Tensor, x: MLAInputs, cache_loc: torch.Tensor) -> None:
    """Write every token's [latent | rope key] into its cache slot (padded tokens hit the scratch page)."""
    t = x.compressed_kv.shape[1]
    flat = mla_cache.view(-1, mla_cache.shape[-1])
    new = torch.cat([x.compressed_kv[0], x.kpe[0, :, 0]], dim=-1).to(mla_cache.dtype)
    flat.index_copy_(0, cache_loc[:t].long(), new)


def define_cached_op(name: str, metadata: tuple[str, ...], impl: CachedImpl) -> Any:
    """Register `torch.ops.autodeploy.<name>` with the shared signature; returns the op packet."""
    n_meta = len(metadata)
    cache_at = len(MLA_INPUTS) + n_meta

    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        # The dispatcher passes what the caller passed: a trailing default may be absent.
        x = tuple.__new__(MLAInputs, args[:5])
        meta = dict(zip(metadata, args[5:cache_at]))
        scale = args[cache_at + 1] if len(args) > cache_at + 1 else kwargs.get("scale")
        return impl(x, meta, args[cache_at], scale)

    def fake(*args: Any, **kwargs: Any) -> torch.Tensor:
        x = tuple.__new__(MLAInputs, args[:5])
        dims = check_cached_inputs(name, x, args[cache_at])
        return x.q_nope.new_empty(1, x.q_nope.shape[1], dims.num_heads, dims.v_head_dim)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = impl.__doc__
    op = torch.library.custom_op(f"autodeploy::{name}", kernel, mutates_args=(CACHE_ARG,),
                                 schema=cached_op_schema(metadata))
    op.register_fake(fake)
    return getattr(torch.ops.autodeploy, name)
