"""Pass registry: passes are plain functions registered by name, each with a typed options model.

A pass takes the BuildContext and its validated options and returns a PassResult that says what it
matched or changed. The pipeline order is the order of the YAML `transforms:` map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:
    from .context import BuildContext


class PassOptions(BaseModel):
    """Options every pass has. Subclass per pass; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True


@dataclass
class PassResult:
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


PassFn = Callable[["BuildContext", PassOptions], PassResult]


@dataclass(frozen=True)
class PassInfo:
    name: str
    options: type[PassOptions]
    fn: PassFn
    needs_graph: bool  # run lint + recompile after it


_PASSES: dict[str, PassInfo] = {}


def register_pass(name: str, options: type[PassOptions] = PassOptions, needs_graph: bool = True):
    def deco(fn: PassFn) -> PassFn:
        if name in _PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        _PASSES[name] = PassInfo(name, options, fn, needs_graph)
        return fn

    return deco


def _ensure_loaded() -> None:
    from . import passes  # noqa: F401  (registers the built-in passes)


def get_pass(name: str) -> PassInfo:
    _ensure_loaded()
    if name not in _PASSES:
        raise KeyError(f"unknown transform {name!r}; valid transforms: {', '.join(sorted(_PASSES))}")
    return _PASSES[name]


def all_passes() -> dict[str, PassInfo]:
    _ensure_loaded()
    return dict(_PASSES)


def validate_transform_options(transforms: Mapping[str, Any]) -> None:
    """Raise ValueError naming the bad pass/option and the valid choices."""
    _ensure_loaded()
    problems = []
    for name, opts in transforms.items():
        if name not in _PASSES:
            problems.append(f"unknown transform {name!r}; valid transforms: {', '.join(sorted(_PASSES))}")
            continue
        if opts is None:
            opts = {}
        if not isinstance(opts, Mapping):
            problems.append(f"transforms.{name} must be a mapping of options, got {opts!r}")
            continue
        info = _PASSES[name]
        try:
            info.options.model_validate(dict(opts))
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"])
                msg = err["msg"]
                if err["type"] == "extra_forbidden":
                    msg = f"unknown option; valid options: {', '.join(info.options.model_fields)}"
                problems.append(f"transforms.{name}.{loc}: {msg}")
    if problems:
        raise ValueError("; ".join(problems))


def parse_options(name: str, raw: Mapping[str, Any] | None) -> PassOptions:
    return get_pass(name).options.model_validate(dict(raw or {}))
