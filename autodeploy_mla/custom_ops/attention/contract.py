"""The one cached-op contract every backend shares (DESIGN §6), written once.

    <backend>_mla_with_cache(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight,
                             *metadata, mla_cache, scale=None,
                             latent_scale=1.0, rope_scale=1.0) -> [1, T, N, Dv]

`define_cached_op(name, metadata, impl)` builds that schema from a backend's metadata tuple,
registers the op with the cache write declared (`Tensor(a!) mla_cache`), registers the shared fake
implementation, and calls `impl(x, meta, mla_cache, scale, cache_scales)` with the five MLA inputs
as `MLAInputs`, the metadata as a name -> tensor mapping and the cache's dequantisation scales as
`CacheScales`, so no backend repeats the 19-argument signature or re-packs its metadata by hand.

The cache holds the activations' dtype or FP8 e4m3 (cache_format.py); `latent_scale` /
`rope_scale` are the FP8 cache's per-layer scales (1.0 and unused for other dtypes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import torch

from .cache_format import FP8_DTYPE, UNIT_SCALES, CacheScales, cache_dtype_name, is_fp8, quantize_rows
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


#: impl(x, metadata by name, mla_cache, scale, cache scales) -> out [1, T, N, Dv]
CachedImpl = Callable[[MLAInputs, Mapping[str, torch.Tensor], torch.Tensor, Optional[float], CacheScales],
                      torch.Tensor]


def cached_op_schema(metadata: tuple[str, ...]) -> str:
    args = [f"Tensor {n}" for n in (*MLA_INPUTS, *metadata)]
    return (f"({', '.join(args)}, Tensor(a!) {CACHE_ARG}, float? scale=None, float latent_scale=1.0, "
            "float rope_scale=1.0) -> Tensor")


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
    if mla_cache.dtype != x.q_nope.dtype and not is_fp8(mla_cache.dtype):
        raise MLAShapeError(
            f"{op}: mla_cache dtype {cache_dtype_name(mla_cache.dtype)} is neither the activations' "
            f"{cache_dtype_name(x.q_nope.dtype)} nor {cache_dtype_name(FP8_DTYPE)}; allocate the cache in the "
            "model dtype or as FP8 (runtime.kv_cache_dtype)."
        )
    return dims


def append_to_paged_cache(mla_cache: torch.Tensor, x: MLAInputs, cache_loc: torch.Tensor,
                          scales: CacheScales = UNIT_SCALES) -> None:
    """Write every token's [latent | rope key] into its cache slot (padded tokens hit the scratch page),
    quantised to FP8 with `scales` when the cache is FP8."""
    t = x.compressed_kv.shape[1]
    flat = mla_cache.view(-1, mla_cache.shape[-1])
    new = quantize_rows(x.compressed_kv[0], x.kpe[0, :, 0], mla_cache.dtype, scales)
    if is_fp8(flat.dtype):  # index_copy_ has no FP8 kernel on CPU: copy the bytes
        flat, new = flat.view(torch.uint8), new.view(torch.uint8)
    flat.index_copy_(0, cache_loc[:t].long(), new)


def cached_kernel(name: str, metadata: tuple[str, ...], impl: CachedImpl) -> Callable[..., torch.Tensor]:
    """The op's implementation with the shared positional signature: what the dispatcher calls, and
    what a runtime may call directly for an eager op (the lean path: no dispatcher on the way)."""
    n_meta = len(metadata)
    cache_at = len(MLA_INPUTS) + n_meta

    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        # The dispatcher passes what the caller passed: trailing defaults may be absent.
        x = tuple.__new__(MLAInputs, args[:5])
        meta = dict(zip(metadata, args[5:cache_at]))
        rest = dict(zip(("scale", "latent_scale", "rope_scale"), args[cache_at + 1:]))
        rest.update(kwargs)
        pair = (float(rest.get("latent_scale", 1.0)), float(rest.get("rope_scale", 1.0)))
        scales = UNIT_SCALES if pair == (1.0, 1.0) else CacheScales(*pair)
        return impl(x, meta, args[cache_at], rest.get("scale"), scales)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = impl.__doc__
    return kernel


def define_cached_op(name: str, metadata: tuple[str, ...], impl: CachedImpl) -> Any:
    """Register `torch.ops.autodeploy.<name>` with the shared signature; returns the op packet."""
    return define_cached_op_and_kernel(name, metadata, impl)[0]


def define_cached_op_and_kernel(name: str, metadata: tuple[str, ...],
                                impl: CachedImpl) -> tuple[Any, Callable[..., torch.Tensor]]:
    """`define_cached_op`, also returning the implementation it registered (`cached_kernel`), which
    a backend offers as its `direct_call` for runtimes that call eager ops without the dispatcher."""
    cache_at = len(MLA_INPUTS) + len(metadata)
    kernel = cached_kernel(name, metadata, impl)

    def fake(*args: Any, **kwargs: Any) -> torch.Tensor:
        x = tuple.__new__(MLAInputs, args[:5])
        dims = check_cached_inputs(name, x, args[cache_at])
        return x.q_nope.new_empty(1, x.q_nope.shape[1], dims.num_heads, dims.v_head_dim)

    op = torch.library.custom_op(f"autodeploy::{name}", kernel, mutates_args=(CACHE_ARG,),
                                 schema=cached_op_schema(metadata))
    op.register_fake(fake)
    label = f"autodeploy::{name}"

    def direct(*args: Any, **kwargs: Any) -> torch.Tensor:
        # called without the dispatcher, the op would be invisible to torch.profiler: name its range
        # as the dispatcher would, only while a profiler runs (one bool read otherwise)
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(label):
                return kernel(*args, **kwargs)
        return kernel(*args, **kwargs)

    direct.__name__ = direct.__qualname__ = name
    direct.__doc__ = kernel.__doc__
    return getattr(torch.ops.autodeploy, name), direct
