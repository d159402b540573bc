"""Per-node attention backend resolution (DESIGN §8).

Pure function of the node's dims, dtype, the target (device capabilities, installed library
versions, page size) and the requested backend, so it is unit-tested with mocked targets. Every
decision keeps the reason it was taken and why each preferred backend was rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..custom_ops.backend_registry import BackendDecision, DeviceInfo, Target, all_backends, get_backend
from ..custom_ops.mla_dims import MLADims

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


def resolve_backend(
    layer: str,
    dims: MLADims,
    dtype: torch.dtype,
    target: Target,
    requested: str,
    preference: Mapping[str, Sequence[str]],
    allow_fallback: bool = False,
) -> BackendDecision:
    """Pick the backend for one node.

    `requested` is "auto" or a backend name. An explicit backend that fails its check is an error
    unless `allow_fallback`, in which case resolution continues down the `auto` order.
    """
    rejected: list[tuple[str, str]] = []
    if requested != "auto":
        res = get_backend(requested).check(dims, dtype, target)
        if res.ok:
            return BackendDecision(layer, dims, requested, requested, f"requested explicitly; {res.reason}")
        if not allow_fallback:
            raise BackendResolutionError(
                f"{layer}: backend {requested!r} cannot serve this node ({dims.short()}, {dtype}, "
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
    for name in order:
        if name == requested:
            continue
        res = get_backend(name).check(dims, dtype, target)
        if res.ok:
            how = "fallback" if requested != "auto" else "auto"
            return BackendDecision(layer, dims, requested, name, f"{how}: first accepted in {key} order; {res.reason}",
                                   tuple(rejected))
        rejected.append((name, res.reason))
    lines = "; ".join(f"{b}: {r}" for b, r in rejected)
    raise BackendResolutionError(f"{layer}: no backend can serve {dims.short()} {dtype} on {target.short()}: {lines}")
