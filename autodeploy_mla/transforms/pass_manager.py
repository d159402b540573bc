"""Runs the configured passes in order, lints/recompiles the graph after each, and keeps history."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from .context import BuildContext, PassRecord
from .registry import get_pass


class PassError(RuntimeError):
    """A pass failed; the message names the pass."""


def run_passes(ctx: BuildContext, on_pass: Optional[Callable[[PassRecord], None]] = None) -> list[PassRecord]:
    for name, raw in ctx.config.transforms.items():
        info = get_pass(name)
        opts = info.options.model_validate(dict(raw or {}))
        if not opts.enabled:
            rec = PassRecord(name, False, 0.0, "disabled")
        else:
            t0 = time.perf_counter()
            result = info.fn(ctx, opts)
            if info.needs_graph:
                if ctx.gm is None:
                    raise PassError(f"pass {name!r} left no graph; is `export` enabled and first?")
                ctx.gm.graph.lint()
                ctx.gm.recompile()
            rec = PassRecord(name, True, time.perf_counter() - t0, result.summary, result.details)
        ctx.history.append(rec)
        if on_pass is not None:
            on_pass(rec)
    return ctx.history
