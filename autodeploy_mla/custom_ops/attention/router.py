"""The attention router: which backend path serves a node's decode steps and its prefill steps.

The anchors split the question the same way: vLLM keeps the MLA decode backends apart from a separate
prefill-backend selector, and FlashInfer records its backend auto-selection as an immutable trace.
Here every MLA node resolves to one backend (transforms/backend_resolution.py, from the per-device
preference order); that backend's session then holds the node's two paths:

- a **decode path** (decode-only steps) and a **prefill path** (steps with prefill tokens), each a
  `Path` with its reason, described at set-up (`BackendSession.paths`) and shown per node in the
  build report;
- a **route per step**, chosen here from facts the backends declare (the handoff backend a session
  resolved through the registry, the policy's thresholds, each path's measured cost in
  `prefill_cost.PrefillCostFacts`), and recorded in the session's `RouteLog`: counters per route and
  a bounded trace of the last steps, immutable records (`Route`).

Pure functions of their arguments; the log belongs to a session (the model's), never to this module.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .mla_dims import MLADims
from .prefill_cost import PrefillCostFacts, path_costs

StepKind = Literal["decode", "prefill"]
#: steps the route trace keeps by default (the counters keep every step)
DEFAULT_TRACE_STEPS = 64


@dataclass(frozen=True)
class Path:
    """How one kind of step of a node runs: the backend whose op attends, and why."""

    backend: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"backend": self.backend, "reason": self.reason}


@dataclass(frozen=True)
class NodePaths:
    """A node's decode path and prefill path, as its session will route them."""

    decode: Path
    prefill: Path

    def to_dict(self) -> dict[str, Any]:
        return {"decode": self.decode.to_dict(), "prefill": self.prefill.to_dict()}


@dataclass(frozen=True)
class Route:
    """The route one step of one node config took: its kind, the backend whose op ran it, the path
    inside that backend (e.g. "absorbed", "expand", "expand+fa3"), and why."""

    kind: StepKind
    backend: str
    path: str
    reason: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.backend}:{self.path}"


class RouteLog:
    """One session's record of its routes: a counter per route key and the last `trace_steps` routes
    (with the step number and the node config they were for)."""

    def __init__(self, trace_steps: int = DEFAULT_TRACE_STEPS) -> None:
        if trace_steps < 0:
            raise ValueError(f"RouteLog.trace_steps={trace_steps}: must be >= 0 (0: counters only)")
        self.steps = 0
        self.counts: Counter[str] = Counter()
        self.trace: deque[tuple[int, str, Route]] = deque(maxlen=trace_steps)

    def next_step(self) -> None:
        self.steps += 1

    def record(self, config: str, route: Route) -> None:
        self.counts[route.key] += 1
        if self.trace.maxlen:
            self.trace.append((self.steps, config, route))

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "counts": dict(self.counts),
                "trace": [{"step": s, "config": c, "kind": r.kind, "backend": r.backend, "path": r.path,
                           "reason": r.reason} for s, c, r in self.trace]}


# ----------------------------------------------------------------------------- step routes
def route_decode(owner: str, handoff: str, num_seqs: int, handoff_max_seqs: int,
                 fast_decode_handoffs: Sequence[str]) -> Route:
    """A decode-only step of a backend that may hand small decode batches to `handoff`: there when
    `handoff` is a declared fast decode backend and the batch has at most `handoff_max_seqs` sequences
    (FlashInferPolicy.decode_fallback_max_seqs; measured in docs/benchmarks/e2e_roofline.md)."""
    if handoff in fast_decode_handoffs and num_seqs <= handoff_max_seqs:
        return Route("decode", handoff, "handoff", f"decode step of {num_seqs} sequence(s) routed to {handoff} "
                                                   f"(decode_fallback_max_seqs={handoff_max_seqs})")
    return Route("decode", owner, "absorbed", f"decode step of {num_seqs} sequence(s) on {owner}")


def route_prefill(owner: str, handoff: str, mode: str, fast_prefill_handoffs: Sequence[str], dims: MLADims,
                  qo_lens: torch.Tensor, kv_lens: torch.Tensor, facts: PrefillCostFacts) -> Route:
    """A step with prefill tokens of a backend with an absorbed prefill that may hand it to `handoff`'s
    expanded prefill: by policy `mode` ("flashinfer": stay, "fallback": hand off, "auto": where
    `handoff` is a declared fast prefill backend and the cost facts estimate its expanded path cheaper
    for this step's query and kv lengths under the node's dims)."""
    if mode == "fallback":
        return Route("prefill", handoff, "handoff", f"step with prefill tokens routed to {handoff} (prefill=fallback)")
    if mode == "auto" and handoff in fast_prefill_handoffs:
        absorbed, expanded = path_costs(dims, qo_lens, kv_lens, facts)
        if expanded < absorbed:
            return Route("prefill", handoff, "handoff",
                         f"step with prefill tokens routed to {handoff}: estimated {expanded:.0f} us expanded vs "
                         f"{absorbed:.0f} us absorbed per layer")
    return Route("prefill", owner, "absorbed", f"step with prefill tokens on {owner} ({mode})")


def route_handoff_for_safety(kind: StepKind, handoff: str, why: str) -> Route:
    """A step the owner must not run (a kernel limit), handed to `handoff` whatever the policy."""
    return Route(kind, handoff, "handoff", why)


def triton_prefill_route(backend: str, path: str, fa3: bool, why: str = "") -> Route:
    """The Triton op's route of a step with prefill tokens: "expand" (own kernel or FA3 attention) or
    "absorb", by its cost rule (triton_mla/tuning.choose_prefill_path)."""
    name = "expand+fa3" if path == "expand" and fa3 else path
    return Route("prefill", backend, name, why or f"cost rule: {name}")


__all__ = ["DEFAULT_TRACE_STEPS", "NodePaths", "Path", "Route", "RouteLog", "StepKind", "route_decode",
           "route_handoff_for_safety", "route_prefill", "triton_prefill_route"]
