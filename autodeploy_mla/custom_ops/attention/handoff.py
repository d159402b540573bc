"""Running one step of a node on another registered backend's cached op.

FlashInfer's backends hand some steps, whole, to another op (prefill steps their kernel must not
run, or that another kernel runs faster). `resolve_fallback` picks that op once per config at
setup — the first backend of an order that is registered, takes a subset of the caller's metadata
and accepts every node — and `call_fallback` runs it with the caller's inputs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .registry import BackendSession, SessionSpec, Target, all_backends
from .cache_format import CacheScales
from .mla_dims import MLADims
from .contract import MLAInputs
from .step_context import active_sessions, using_sessions


@dataclass(frozen=True)
class Fallback:
    name: str
    op: Any
    metadata: tuple[str, ...]
    #: what call_fallback runs: the backend's `direct_call` where it offers one (its implementation
    #: without the dispatcher: the handing op already runs eagerly on real tensors, so a second trip
    #: through the custom-op machinery only costs host time, ~0.1 ms of a prefill layer), else `op`
    call: Optional[Any] = None

    def __post_init__(self) -> None:
        if self.call is None:
            object.__setattr__(self, "call", self.op)


def resolve_fallback(dims_list: Sequence[MLADims], dtype: torch.dtype, target: Target, order: Sequence[str],
                     available_metadata: Sequence[str], cache_dtype: Optional[torch.dtype] = None) -> Fallback:
    """First backend of `order` that is registered, takes a subset of `available_metadata` and accepts
    every node and its cache dtype (default: `dtype`); ValueError listing why each was passed over
    otherwise."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    registry = all_backends()
    tried = []
    for name in order:
        be = registry.get(name)
        if be is None:
            tried.append(f"{name}: not registered")
            continue
        if not set(be.metadata) <= set(available_metadata):
            tried.append(f"{name}: needs metadata {sorted(set(be.metadata) - set(available_metadata))}")
            continue
        bad = [r.reason for d in dims_list if not (r := be.check(d, dtype, target)).ok
               or not (r := be.check_cache(d, dtype, cache_dtype, target)).ok]
        if bad:
            tried.append(f"{name}: {bad[0]}")
            continue
        return Fallback(name, be.cached_op, tuple(be.metadata), be.direct_call or be.cached_op)
    raise ValueError("no fallback backend for the steps this backend hands off: " + ("; ".join(tried) or "none given"))


def fallback_sessions(configs: Mapping[Any, Fallback], spec: SessionSpec) -> tuple[dict[str, BackendSession], str]:
    """Per-model sessions of the fallback backends (their plans, workspaces and kernels then serve the
    steps handed to them, as they serve their own nodes), made with the caller's spec and the model's
    policy of that backend (`spec.policy_of`) when one fallback serves every config; else none (the fallback op then runs without a session of its own,
    as before). Returns (sessions by backend name, why none)."""
    names = {fb.name for fb in configs.values()}
    if len(names) != 1:
        return {}, f"configs fall back to {sorted(names) or 'nothing'}: no fallback session"
    name = names.pop()
    try:
        return {name: all_backends()[name].setup(spec, spec.policy_of(name))}, ""
    except (ValueError, RuntimeError) as exc:  # the fallback's own check of the whole spec
        return {}, f"{name} session not made: {exc}"


def call_fallback(fb: Fallback, x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                  scale: Optional[float], scales: CacheScales,
                  session: Optional[BackendSession] = None) -> torch.Tensor:
    """Run the fallback op on the caller's inputs; with `session`, inside the step's sessions plus it."""
    args = (*x, *(meta[m] for m in fb.metadata), mla_cache, scale, scales.latent, scales.rope)
    if session is None:
        return fb.call(*args)
    with using_sessions({**active_sessions(), fb.name: session}):
        return fb.call(*args)
