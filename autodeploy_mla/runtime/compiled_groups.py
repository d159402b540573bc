"""One torch.compile'd callable per compile group (runtime/piece_groups.py), shared by its pieces.

`CompiledGroup` compiles the representative's canonical graph `forward(x0.., w0..)`; `GroupMember` is
what a static piece runs: `group(inputs, its own weights)`. One code object per group means Dynamo's
cache is per group: a member whose inputs and weights pass the guards of an existing entry (same
shapes, strides, dtypes — weights are plain inputs, never guarded by identity) runs it without
compiling. The counting backend wrapped around the real one (`torch._dynamo.lookup_backend`) records
every compile: count, seconds, and the Inductor / AOTAutograd cache hits and misses it caused.

Dynamic shapes. With `dynamic=None` Dynamo specialises a graph to the first token count it meets and
compiles it again, dynamic in T, at the second: two compiles per graph (three with T = 1, which Dynamo
always specialises). Instead, until the group has compiled once at a token count >= 2, the inputs and
dims that vary with T (runtime/piece_shapes.py) are marked dynamic on each call (tensor dims with
`maybe_mark_dynamic`, int inputs through `torch.compiler.config.dynamic_sources`): the first compile is
already dynamic in T and static in every other dim, and later token counts hit it. T = 1 still gets its own specialised graph (one more compile per group).
The warm-up runs the largest step first (ModelRunner.warmup), so that first compile, whose size hints
Inductor tunes its kernels' block sizes with, sees the largest token count, as before.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .piece_groups import CanonicalPiece, CompileGroup
from .piece_shapes import TokenDims

#: torch._dynamo.utils.counters entries that say whether a compile was served from the on-disk caches.
CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                  ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
                  ("aot_autograd", "autograd_cache_miss"), ("aot_autograd", "autograd_cache_bypass"))


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[kind][name]) for kind, name in CACHE_COUNTERS}


@dataclass
class GroupStats:
    """What compiling one group cost: backend compiles (Dynamo graphs handed to AOTAutograd + Inductor),
    the wall seconds of the calls that compiled (Dynamo trace + backend + first run), the backend's own
    seconds, and the cache counters' increments during those compiles."""

    compiles: int = 0
    seconds: float = 0.0
    backend_seconds: float = 0.0
    cache: dict[str, int] = field(default_factory=dict)
    #: the token-dependent inputs named to Dynamo (None: none were derivable; Dynamo decided)
    dynamic_sources: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"compiles": self.compiles, "seconds": round(self.seconds, 4),
                "backend_seconds": round(self.backend_seconds, 4), "cache": dict(self.cache),
                "dynamic_sources": self.dynamic_sources}


class CompiledGroup:
    """The compiled callable of one compile group, and what compiling it cost."""

    def __init__(self, group: CompileGroup, canonical: CanonicalPiece, backend: str) -> None:
        self.group = group
        self.backend = backend
        self.num_inputs = canonical.num_inputs
        self.stats = GroupStats()
        #: set by the runner once the first step's shapes are known (piece_shapes.static_token_dims)
        self.token_dims: Optional[TokenDims] = None
        self._dynamic_done = False
        self._inner: Callable[..., Any] = torch._dynamo.lookup_backend(backend)
        # A copy with its own generated code: Dynamo keeps its cache and dynamic-shape state per code
        # object, so two runners over one split (tests, benchmarks) never share compiles or counts.
        self._gm = torch.fx.GraphModule(canonical.gm, copy.deepcopy(canonical.gm.graph), "CompiledGroup")
        self._fn = torch.compile(self._gm.forward, backend=self._compile, fullgraph=True, dynamic=None)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The torch.compile backend: the real one, counted and timed."""
        before = _cache_counters()
        t0 = time.perf_counter()
        try:
            return self._inner(gm, example_inputs)
        finally:
            self.stats.compiles += 1
            self.stats.backend_seconds += time.perf_counter() - t0
            for k, v in _cache_counters().items():
                if v != before[k]:
                    self.stats.cache[k] = self.stats.cache.get(k, 0) + v - before[k]

    def sources(self, args: tuple[Any, ...]) -> str:
        """`dynamic_sources` for this call: the token-dependent int inputs that are >= 2 here (whole
        sources: the form every torch >= 2.8 reads; tensor dims are marked on the tensors instead,
        `mark_token_dims`)."""
        dims = self.token_dims
        if dims is None:
            return ""
        return ",".join(f"L['x{i}']" for i in dims.ints if isinstance(args[i], int) and args[i] >= 2)

    def mark_token_dims(self, args: tuple[Any, ...]) -> list[str]:
        """Mark the token dims of this call's tensors dynamic (`maybe_mark_dynamic`: Dynamo may still
        specialise one it must); size-1 dims stay specialised, as Dynamo would anyway. Returns what was
        marked. (torch 2.11 ignores the `L['x']:dim` form of `dynamic_sources`: on the H200 the first
        compile came out static at 2048 tokens and every group compiled three times.)"""
        dims = self.token_dims
        marked: list[str] = []
        if dims is None:
            return marked
        for i, ds in dims.tensors:
            a = args[i]
            if isinstance(a, torch.Tensor):
                for d in ds:
                    if d < a.dim() and a.shape[d] >= 2:
                        torch._dynamo.maybe_mark_dynamic(a, d)
                        marked.append(f"L['x{i}']:{d}")
        return marked

    def __call__(self, args: tuple[Any, ...], params: tuple[torch.Tensor, ...]) -> Any:
        n = self.stats.compiles
        t0 = time.perf_counter()
        sources, marked = "", []
        if not self._dynamic_done:
            sources, marked = self.sources(args), self.mark_token_dims(args)
        with torch.compiler.config.patch(dynamic_sources=sources) if sources else nullcontext():
            out = self._fn(*args, *params)
        if self.stats.compiles != n:
            self.stats.seconds += time.perf_counter() - t0
            if sources or marked:
                self._dynamic_done = True
                self.stats.dynamic_sources = ",".join(x for x in (sources, *marked) if x)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**self.group.to_dict(), **self.stats.to_dict(),
                "token_dims": self.token_dims.to_dict() if self.token_dims is not None else None}


class GroupMember(nn.Module):
    """A static piece run through its group's compiled graph with its own weights (held by reference)."""

    def __init__(self, group: CompiledGroup, params: tuple[torch.Tensor, ...], keep_outputs: Optional[int]) -> None:
        super().__init__()
        self._group = [group]  # a list: keep the group out of nn.Module child registration
        self.params = params
        self.keep_outputs = keep_outputs

    @property
    def group(self) -> CompiledGroup:
        return self._group[0]

    def forward(self, *args: Any) -> Any:
        out = self._group[0](args, self.params)
        return out if self.keep_outputs is None else out[: self.keep_outputs]


__all__ = ["CACHE_COUNTERS", "CompiledGroup", "GroupMember", "GroupStats"]
