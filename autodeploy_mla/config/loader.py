"""Config layering: packaged default <- model family YAML <- user YAMLs <- checkpoint <- `--set a.b=c`.

`config_layers(model, configs)` is the one place that turns what a user names — a family, a
checkpoint directory, YAML files, dicts — into ordered layers; `optimize()` and the CLI both use it.
Merging happens on plain dicts (deep merge: maps merge key by key, everything else replaces), then
the result is validated once. The inputs are never mutated.

The model's source is one of `model.path` (a checkpoint) or `model.hf_config` (random weights):
the layer that sets one clears the other, so the last source named wins. A checkpoint directory
given as the model is layered after the config files, so `optimize("/ckpt", "deepseek_v2")` loads
the checkpoint with the family's options rather than the family's tiny random-weight config.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import ValidationError

from .families import available_model_configs, model_config_path
from .schema import AppConfig

DEFAULT_YAML = Path(__file__).with_name("default.yaml")
ConfigLayer = Union[str, Path, Mapping[str, Any]]
_SOURCES = ("path", "hf_config")


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


def resolve_layer(layer: ConfigLayer) -> Union[Path, Mapping[str, Any]]:
    """A config layer as given: a YAML file, a model family's name (its packaged YAML), or a mapping."""
    if isinstance(layer, Mapping):
        return layer
    if not isinstance(layer, (str, Path)):
        raise ConfigError(f"a config layer must be a YAML path, a model family name or a mapping, got {type(layer).__name__}")
    p = Path(layer)
    if p.is_file():
        return p
    family = model_config_path(str(layer))
    if family is not None:
        return family
    raise ConfigError(
        f"config {str(layer)!r}: no such YAML file, and not a model family; families: "
        f"{', '.join(available_model_configs())}"
    )


def model_layer(model: Union[str, Path]) -> tuple[Union[Path, dict[str, Any]], bool]:
    """The layer a model argument stands for, and whether it is a checkpoint: a checkpoint directory
    -> {"model": {"path": ...}}; a family name or YAML file -> that YAML."""
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"model {str(model)!r}: the directory has no config.json; expected a Hugging Face "
                              "checkpoint directory (config.json + *.safetensors)")
        return {"model": {"path": str(p.resolve())}}, True
    family = model_config_path(str(model))
    if family is not None:
        return family, False
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p, False
    raise ConfigError(
        f"model {str(model)!r} is neither a checkpoint directory nor a model family; families: "
        f"{', '.join(available_model_configs())}"
    )


def config_layers(model: Union[str, Path, None], configs: Sequence[ConfigLayer] = ()) -> list[ConfigLayer]:
    """Ordered layers for `model` (family name, YAML, checkpoint directory, or None) and `configs`
    (YAML paths, family names, mappings): family YAML, then the configs, then a checkpoint."""
    layers: list[ConfigLayer] = []
    ckpt = None
    if model is not None:
        layer, is_ckpt = model_layer(model)
        if is_ckpt:
            ckpt = layer
        else:
            layers.append(layer)
    layers += [resolve_layer(c) for c in configs]
    if ckpt is not None:
        layers.append(ckpt)
    return layers


def _as_dict(layer: ConfigLayer) -> dict[str, Any]:
    layer = resolve_layer(layer)
    return read_yaml(layer) if isinstance(layer, Path) else copy.deepcopy(dict(layer))


def _merge_layer(merged: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge one layer; a layer that names a model source replaces the other one."""
    model = layer.get("model")
    if isinstance(model, Mapping) and isinstance(merged.get("model"), Mapping):
        named = [k for k in _SOURCES if model.get(k) is not None]
        if len(named) == 1:
            other = _SOURCES[1 - _SOURCES.index(named[0])]
            merged = {**merged, "model": {**merged["model"], other: None}}
    return deep_merge(merged, layer)


def load_config(*layers: ConfigLayer, overrides: Iterable[str] = ()) -> AppConfig:
    """Merge the packaged default, then each layer (YAML path, family name or dict), then `--set`
    overrides; validate once."""
    merged = read_yaml(DEFAULT_YAML)
    for layer in layers:
        merged = _merge_layer(merged, _as_dict(layer))
    merged = _merge_layer(merged, parse_set_overrides(overrides))
    try:
        return AppConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    """Every problem with its key path; one problem stays on one line (the CLI prints `error: ...`)."""
    lines = ["invalid configuration:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = err["loc"][:-1]
            valid = _valid_keys(parent)
            msg = f"unknown key{f'; valid keys: {valid}' if valid else ''}"
        lines.append(f"  {loc}: {msg}")
    if len(lines) == 2:
        return f"{lines[0]} {lines[1].strip()}"
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
