"""Per-node attention backend resolution (DESIGN §8).

Pure function of the node's dims, dtype, cache dtype, the target (device capabilities, installed
library versions, page size) and the requested backend, so it is unit-tested with mocked targets.
Every decision keeps the reason it was taken and why each preferred backend was rejected — for its
dims (`check`) or for the cache dtype (`check_cache`: an FP8 cache is served only by backends whose
kernels read FP8 for those dims).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import torch

from ..custom_ops.attention.registry import BackendDecision, CheckResult, DeviceInfo, Target, all_backends, get_backend
from ..custom_ops.attention.cache_format import cache_dtype_name
from ..custom_ops.attention.mla_dims import MLADims

#: Keys of the `preference:` table: one auto order per device class.
DEVICE_CLASSES: tuple[str, ...] = ("sm100", "sm90", "sm80", "cuda", "cpu")


class BackendResolutionError(ValueError):
    """An explicitly requested backend cannot serve a node (and fallback is off), or none can."""


def arch_key(device: DeviceInfo) -> str:
    """The preference-table key of a device: cpu, sm80 (Ampere/Ada), sm90, sm100 (Blackwell DC), cuda."""
    if device.type != "cuda" or device.sm is None:
        return device.type
    if device.sm in (100, 103):
        return "sm100"
    if device.sm == 90:
        return "sm90"
    if 80 <= device.sm < 90:
        return "sm80"
    return "cuda"


def accepts(name: str, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
    """Backend `name`'s verdict on a node: its dims check, then its cache-dtype check."""
    be = get_backend(name)
    if be.sparse_only:
        return CheckResult(False, "serves sparse MLA (DeepSeek Sparse Attention) layers only; this layer is dense")
    res = be.check(dims, dtype, target)
    if not res.ok:
        return res
    cache = be.check_cache(dims, dtype, cache_dtype, target)
    if not cache.ok:
        return CheckResult(False, f"{cache_dtype_name(cache_dtype)} cache: {cache.reason}")
    if cache_dtype != dtype:
        return CheckResult(True, f"{res.reason}; {cache.reason}")
    return res


def first_accepted(order: Sequence[str], skip: str, verdict: Callable[[str], CheckResult],
                   rejected: list[tuple[str, str]]) -> tuple[Optional[str], str]:
    """The one resolution loop, for dense and sparse layers alike: the first backend of `order` (other
    than `skip`, already tried) whose `verdict` accepts the node, with the verdict's reason; every one
    refused before it is appended to `rejected` with its reason. (None, "") when none accepts."""
    for name in order:
        if name == skip:
            continue
        res = verdict(name)
        if res.ok:
            return name, res.reason
        rejected.append((name, res.reason))
    return None, ""


def resolve_backend(
    layer: str,
    dims: MLADims,
    dtype: torch.dtype,
    target: Target,
    requested: str,
    preference: Mapping[str, Sequence[str]],
    allow_fallback: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> BackendDecision:
    """Pick the backend for one node.

    `requested` is "auto" or a backend name. An explicit backend that fails its check is an error
    unless `allow_fallback`, in which case resolution continues down the `auto` order. `cache_dtype`
    (default: `dtype`) is the node's paged-cache dtype.
    """
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    what = f"{dims.short()}, {dtype}" + ("" if cache_dtype == dtype else f", {cache_dtype_name(cache_dtype)} cache")
    rejected: list[tuple[str, str]] = []
    if requested != "auto":
        res = accepts(requested, dims, dtype, cache_dtype, target)
        if res.ok:
            return BackendDecision(layer, dims, requested, requested, f"requested explicitly; {res.reason}")
        if not allow_fallback:
            raise BackendResolutionError(
                f"{layer}: backend {requested!r} cannot serve this node ({what}, "
                f"{target.short()}): {res.reason}. Choose another backend, use `auto`, or set "
                "insert_cached_mla_attention.allow_fallback: true."
            )
        rejected.append((requested, res.reason))
    key = arch_key(target.device)
    order = list(preference.get(key, ()))
    if not order:
        raise BackendResolutionError(
            f"{layer}: no backend preference for device class {key!r}; add "
            f"insert_cached_mla_attention.preference.{key} (known backends: {', '.join(all_backends())})."
        )
    name, why = first_accepted(order, requested, lambda b: accepts(b, dims, dtype, cache_dtype, target), rejected)
    if name is not None:
        how = "fallback" if requested != "auto" else "auto"
        return BackendDecision(layer, dims, requested, name, f"{how}: first accepted in {key} order; {why}",
                               tuple(rejected))
    lines = "; ".join(f"{b}: {r}" for b, r in rejected)
    raise BackendResolutionError(f"{layer}: no backend can serve {what} on {target.short()}: {lines}")
