"""Pass registry: passes are plain functions registered by name, each with a typed options model
and a declared place in the pipeline.

A pass takes the BuildContext and its validated options and returns a PassResult that says what it
matched or changed. Its place is a `Stage` (AutoDeploy's ordered stages); `requires` names passes
that must be enabled for it to make sense (gather_logits needs the cache insertion's metadata). The
pass manager orders and validates the pipeline once, before any build work (pass_manager.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Union

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from .context import BuildContext


class Stage(IntEnum):
    """Where a pass runs. Passes run in stage order, then by name within a stage (they are independent)."""

    EXPORT = 10  # model -> graph
    PATTERN = 20  # HF attention subgraphs -> torch_mla
    SHARD = 30  # tensor parallelism: split heads / MLPs, insert all-reduces
    WEIGHTS = 40  # fill weightless (skeleton) graphs from the checkpoint
    FUSE = 45  # model subgraphs -> fused ops (MoE experts)
    KERNELS = 48  # source ops -> the kernel backend resolved per node (FP8 linears)
    CACHE = 50  # torch_mla -> backend cached ops + metadata and cache inputs
    OUTPUT = 60  # rewrites of the graph's output (LM head rows)
    COMPILE = 70  # split into pieces for compilation / CUDA graphs; nothing rewrites after this


class PassOptions(BaseModel):
    """Options every pass has. Subclass per pass; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True


@dataclass
class PassResult:
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


PassFn = Callable[["BuildContext", Any], PassResult]


@dataclass(frozen=True)
class PassInfo:
    name: str
    options: type[PassOptions]
    fn: PassFn
    stage: Stage
    requires: tuple[str, ...] = ()
    needs_graph: bool = True  # the manager lints + recompiles the graph after it
    #: the manager re-propagates fake-tensor shapes after it: True (the whole graph: the pass changed
    #: shapes) or "missing" (the nodes the pass added, and what their values change downstream: for
    #: passes that only add nodes and rewire uses, fx_utils.refresh_shapes)
    refresh_shapes: Union[bool, str] = False


_PASSES: dict[str, PassInfo] = {}


def register_pass(name: str, options: type[PassOptions] = PassOptions, *, stage: Stage,
                  requires: tuple[str, ...] = (), needs_graph: bool = True, refresh_shapes: Union[bool, str] = False):
    if refresh_shapes not in (False, True, "missing"):
        raise ValueError(f"pass {name!r}: refresh_shapes={refresh_shapes!r}; expected False, True or 'missing'")
    def deco(fn: PassFn) -> PassFn:
        if name in _PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        _PASSES[name] = PassInfo(name, options, fn, stage, tuple(requires), needs_graph, refresh_shapes)
        return fn

    return deco


def registered_passes() -> dict[str, PassInfo]:
    """Every registered pass (the built-in ones once transforms.passes has been imported)."""
    return dict(_PASSES)
