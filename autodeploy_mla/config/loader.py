"""Config layering: packaged default <- model YAML <- user YAMLs <- `--set a.b=c` overrides.

Merging happens on plain dicts (deep merge: maps merge key by key, everything else replaces), then
the result is validated once. The inputs are never mutated.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import ValidationError

from .schema import AppConfig

DEFAULT_YAML = Path(__file__).with_name("default.yaml")
ConfigLayer = Union[str, Path, Mapping[str, Any]]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message lists what is valid."""


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, val in override.items():
        if isinstance(val, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def parse_set_overrides(items: Iterable[str]) -> dict[str, Any]:
    """['runtime.page_size=32', 'transforms.piecewise.enabled=true'] -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY.PATH=VALUE, got {item!r}")
        node = out
        parts = [p.strip() for p in key.split(".")]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def _as_dict(layer: ConfigLayer) -> dict[str, Any]:
    return read_yaml(layer) if isinstance(layer, (str, Path)) else copy.deepcopy(dict(layer))


def load_config(*layers: ConfigLayer, overrides: Iterable[str] = ()) -> AppConfig:
    """Merge the packaged default, then each layer (YAML path or dict), then `--set` overrides."""
    merged = read_yaml(DEFAULT_YAML)
    for layer in layers:
        merged = deep_merge(merged, _as_dict(layer))
    merged = deep_merge(merged, parse_set_overrides(overrides))
    try:
        return AppConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    lines = ["invalid configuration:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "transforms"  # the only top-level validator
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = err["loc"][:-1]
            valid = _valid_keys(parent)
            msg = f"unknown key{f'; valid keys: {valid}' if valid else ''}"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _valid_keys(loc: tuple) -> str:
    model: Any = AppConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return ""
        model = field.annotation
    fields = getattr(model, "model_fields", None)
    return ", ".join(fields) if fields else ""
