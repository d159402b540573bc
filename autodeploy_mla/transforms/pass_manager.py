"""The pass manager: orders and validates the pipeline once, then runs it.

`parse_pipeline(config.transforms)` is called by `optimize()` before any build work: it validates
every pass's options (unknown passes and options are errors that list the valid ones), puts every
registered pass in its declared stage order (the YAML map only carries options), and checks that
each enabled pass's `requires` are enabled. `run_pipeline` then runs the enabled passes; after a
graph pass it lints and recompiles the graph, and re-propagates shapes where the pass declared it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import ValidationError

from ..config.loader import ConfigError
from . import passes  # noqa: F401  (registers the built-in passes)
from .context import BuildContext, PassRecord
from .fx_utils import refresh_shapes
from .registry import PassInfo, PassOptions, registered_passes


class PassError(RuntimeError):
    """A pass failed or left the graph inconsistent; the message names the pass."""


@dataclass(frozen=True)
class Pipeline:
    """The validated pipeline: every registered pass in run order, with its typed options."""

    steps: tuple[tuple[PassInfo, PassOptions], ...]

    def options(self, name: str) -> PassOptions:
        for info, opts in self.steps:
            if info.name == name:
                return opts
        raise KeyError(f"no pass {name!r} in the pipeline")

    def enabled(self, name: str) -> bool:
        return any(info.name == name and opts.enabled for info, opts in self.steps)

    def order(self) -> list[str]:
        return [info.name for info, _ in self.steps]


def parse_pipeline(transforms: Mapping[str, Any]) -> Pipeline:
    """Validate `transforms` (pass name -> options) against the registry; ConfigError listing every problem."""
    known = registered_passes()
    valid = ", ".join(sorted(known))
    problems: list[str] = []
    opts_by_name: dict[str, PassOptions] = {}
    for name, raw in transforms.items():
        if name not in known:
            problems.append(f"unknown transform {name!r}; valid transforms: {valid}")
            continue
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            problems.append(f"transforms.{name} must be a mapping of options, got {raw!r}")
            continue
        info = known[name]
        try:
            opts_by_name[name] = info.options.model_validate(dict(raw))
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"])
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = f"unknown option; valid options: {', '.join(info.options.model_fields)}"
                problems.append(f"transforms.{name}{'.' + loc if loc else ''}: {msg}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    # passes of one stage are independent of each other; name order makes the pipeline the same
    # whichever module registered first
    order = sorted(known.values(), key=lambda p: (p.stage, p.name))
    steps = tuple((info, opts_by_name.get(info.name) or info.options()) for info in order)
    enabled = {info.name for info, opts in steps if opts.enabled}
    for info, opts in steps:
        if not opts.enabled:
            continue
        for req in info.requires:
            if req not in enabled:
                problems.append(f"transforms.{info.name} needs transforms.{req}, which is disabled; enable it "
                                f"or set transforms.{info.name}.enabled: false")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return Pipeline(steps)


def run_pipeline(ctx: BuildContext, pipeline: Pipeline,
                 on_pass: Optional[Callable[[PassRecord], None]] = None) -> list[PassRecord]:
    for info, opts in pipeline.steps:
        if not opts.enabled:
            rec = PassRecord(info.name, False, 0.0, "disabled")
        else:
            t0 = time.perf_counter()
            before = set(ctx.gm.graph.nodes) if info.refresh_shapes == "missing" and ctx.gm is not None else None
            result = info.fn(ctx, opts)
            if info.needs_graph:
                if ctx.gm is None:
                    raise PassError(f"pass {info.name!r} left no graph; is `export` enabled?")
                ctx.gm.graph.lint()
                # No recompile here: no pass runs the module's Python code (they read and rewrite the
                # graph; shape refresh interprets it node by node), and regenerating the code of a
                # 27-layer graph after every pass cost ~0.13 s each (~1.5 s of a V2-Lite build on the
                # CI host, benchmarks/diagnostics/pass_times.py). Once, after the last pass, below.
                if info.refresh_shapes:
                    try:
                        new = None if before is None else {n for n in ctx.gm.graph.nodes if n not in before}
                        refresh_shapes(ctx.gm, new)
                    except Exception as exc:
                        raise PassError(f"pass {info.name!r}: the rewritten graph does not type-check "
                                        f"({type(exc).__name__}: {exc})") from exc
            rec = PassRecord(info.name, True, time.perf_counter() - t0, result.summary, result.details)
        ctx.history.append(rec)
        if on_pass is not None:
            on_pass(rec)
    if ctx.gm is not None:
        ctx.gm.recompile()
    return ctx.history
