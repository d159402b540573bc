"""Where a model's start-up time goes: one typed value for the build report, `autodeploy build` and the
server's log (issue 42, item 2).

Phases, in the order they run:
- caches: where the compile caches live (runtime/compile_cache.py), set up before anything compiles;
- load: the eager model (built from a config with random weights, or a checkpoint read);
- passes: each graph pass (export, matching, fusion, cache insertion, piecewise split), as recorded;
- runner: the model runner (paged caches allocated, backend sessions, compile groups);
- compile: Dynamo + AOTAutograd + Inductor, per compile group (runtime/compiled_groups.py): compiles,
  seconds, and the FX-graph / AOTAutograd cache hits and misses they caused. Compiles happen inside
  warm-up (or the first steps without one), so their seconds are part of the warm-up's;
- capture: CUDA graphs captured per kind (decode graphs, mixed graphs, piecewise pieces) and their
  seconds, compile time excluded; also part of the warm-up's;
- warm-up: `ModelRunner.warmup` in total, with each warm step's seconds.
`total_seconds` = load + passes + runner + warm-up: the time to a model that serves without compiling
or capturing anything more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .compile_cache import CompileCaches

CAPTURE_KINDS = ("decode_graph", "mixed_graph", "piecewise")
#: A group compiles dynamic in T once and once more for one token; more means its members differ in
#: something Dynamo guards (a stride, an aliasing pattern): `lines()` says so.
MAX_COMPILES_PER_GROUP = 2


@dataclass(frozen=True)
class CompileSummary:
    """Compiling the static pieces, over all compile groups, and per group."""

    backend: str  # torch.compile backend of the static pieces ("none": not compiled)
    pieces: int  # static pieces
    groups: int  # compile groups (compiled callables)
    compiles: int
    seconds: float
    backend_seconds: float
    cache: dict[str, int] = field(default_factory=dict)  # summed cache counters (fxgraph_cache_hit, ...)
    per_group: tuple[dict[str, Any], ...] = ()
    token_dims: str = ""  # how the token-dependent inputs were found (runtime/piece_shapes.py)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "pieces": self.pieces, "groups": self.groups, "compiles": self.compiles,
                "seconds": round(self.seconds, 4), "backend_seconds": round(self.backend_seconds, 4),
                "cache": dict(self.cache), "per_group": list(self.per_group), "token_dims": self.token_dims}


@dataclass(frozen=True)
class CaptureSummary:
    """CUDA graphs captured so far: per kind, how many, their seconds (compiles excluded), failures."""

    count: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.count.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def to_dict(self) -> dict[str, Any]:
        return {"count": dict(self.count), "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                "failed": dict(self.failed), "total": self.total, "total_seconds": round(self.total_seconds, 4)}


@dataclass(frozen=True)
class StartupReport:
    """Every start-up phase's seconds (module docstring); `to_dict()` is the report's `startup` section."""

    caches: Optional[CompileCaches]
    load_seconds: float
    load_what: str  # "config (random weights)", "checkpoint <path>", "module given"
    passes: tuple[tuple[str, float], ...]
    runner_seconds: float
    compile: CompileSummary
    capture: CaptureSummary
    warmup_seconds: Optional[float]  # None: not warmed up yet
    warm_steps: dict[str, float] = field(default_factory=dict)

    @property
    def passes_seconds(self) -> float:
        return sum(s for _, s in self.passes)

    @property
    def total_seconds(self) -> float:
        return self.load_seconds + self.passes_seconds + self.runner_seconds + (self.warmup_seconds or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "caches": self.caches.to_dict() if self.caches is not None else None,
            "load": {"seconds": round(self.load_seconds, 4), "what": self.load_what},
            "passes": {"seconds": round(self.passes_seconds, 4),
                       "per_pass": {name: round(s, 4) for name, s in self.passes}},
            "runner": {"seconds": round(self.runner_seconds, 4)},
            "compile": self.compile.to_dict(),
            "capture": self.capture.to_dict(),
            "warmup": {"seconds": None if self.warmup_seconds is None else round(self.warmup_seconds, 4),
                       "steps": dict(self.warm_steps)},
            "total_seconds": round(self.total_seconds, 4),
        }

    def lines(self) -> list[str]:
        """What `autodeploy build` / `serve` print after the warm-up (the passes are printed as they run)."""
        c = self.compile
        cache = ", ".join(f"{k} {v}" for k, v in sorted(c.cache.items())) or "no cache lookups"
        out = [f"load {self.load_seconds:.2f}s ({self.load_what}); passes {self.passes_seconds:.2f}s; "
               f"runner {self.runner_seconds:.2f}s"]
        if c.backend != "none":
            out.append(f"compile ({c.backend}): {c.pieces} static pieces in {c.groups} groups, {c.compiles} compiles, "
                       f"{c.seconds:.2f}s ({cache})")
            many = [g for g in c.per_group if g.get("compiles", 0) > MAX_COMPILES_PER_GROUP]
            if many:
                out.append("compile: more than 2 compiles in group(s) " + ", ".join(
                    f"{g['group']} (pieces {g['pieces']}: {g['compiles']})" for g in many) +
                    ": their members fail each other's Dynamo guards (TORCH_LOGS=recompiles says which); past "
                    "torch._dynamo.config.recompile_limit they run uncompiled")
        cap = self.capture
        if cap.total or any(cap.failed.values()):
            kinds = ", ".join(f"{k} {cap.count.get(k, 0)} in {cap.seconds.get(k, 0.0):.2f}s"
                              for k in CAPTURE_KINDS if cap.count.get(k) or cap.failed.get(k))
            failed = sum(cap.failed.values())
            out.append(f"capture: {cap.total} CUDA graphs ({kinds})" + (f", {failed} failed" if failed else ""))
        if self.warmup_seconds is not None:
            out.append(f"warm-up {self.warmup_seconds:.2f}s; ready after {self.total_seconds:.2f}s")
        if self.caches is not None:
            out.append(self.caches.summary())
        return out


__all__ = ["CAPTURE_KINDS", "MAX_COMPILES_PER_GROUP", "CaptureSummary", "CompileSummary", "StartupReport"]
