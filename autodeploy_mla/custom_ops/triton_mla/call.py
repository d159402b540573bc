"""What one call of the Triton op runs with (`OpCall`): the policy and, from its model's session, the
kernel variants already loaded, the compiled kernels it launches directly and the step's launch
plans; plus the per-model memo tables and the capture test the launchers share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..attention.prefill_kernels import PrefillAttention
from .launch import BoundKernel, LaunchCache
from .policy import TritonPolicy


@dataclass
class OpCall:
    """What one op call runs with: the policy, and from its model's session the kernel variants
    already loaded, the compiled kernels to launch directly and the step's plans. Outside a model step
    (no session) they are None: kernels go through Triton's JIT launcher and nothing is remembered."""

    policy: TritonPolicy
    warmed: Optional[set[tuple[Any, ...]]] = field(default=None)
    launches: Optional[LaunchCache] = field(default=None)
    plans: Optional[dict[tuple[Any, ...], Any]] = field(default=None)
    #: the session's per-cache TMA descriptors
    descriptors: Optional[dict[tuple[Any, ...], Any]] = field(default=None)
    #: the session's (W_kn, W_v) views per kv_b_proj weight
    views: Optional[dict[tuple[Any, ...], Any]] = field(default=None)
    #: entries the two per-model tables above may hold before they are cleared
    memo_limit: int = 64
    #: the session's FlashInfer FA3 prefill (None: the expanded prefill's attention is our kernel)
    fa3: Optional[PrefillAttention] = field(default=None)

    def empty(self, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.policy.poison_buffers:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(*shape, dtype=dtype, device=device)

    def bound(self, fn: Any, constexprs: dict[str, Any]) -> BoundKernel:
        if self.launches is None:
            return BoundKernel(fn, constexprs)
        return self.launches.get(fn, constexprs)

    def plan(self, key: tuple[Any, ...], make: Any) -> Any:
        """The step's plan for `key`: made by `make()` once per step when there is a session."""
        if self.plans is None:
            return make()
        got = self.plans.get(key)
        if got is None:
            got = self.plans[key] = make()
        return got


def capturing_on(dev: torch.device) -> bool:
    """True while a CUDA graph is being captured on `dev`'s stream (then only static bounds may size
    the grid). A CPU op never captures: no CUDA query."""
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def per_model(table: Optional[dict[tuple[Any, ...], Any]], key: tuple[Any, ...], make: Any, limit: int) -> Any:
    """`make()` remembered in a session table for the model's life. The entries hold references to
    the model's tensors (caches, weights): a table is cleared when it outgrows `limit` (about two
    entries per layer), so replaced tensors are never kept alive for long."""
    if table is None:
        return make()
    got = table.get(key)
    if got is None:
        if len(table) >= limit:
            table.clear()
        got = table[key] = make()
    return got
