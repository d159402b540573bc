"""Build the eager model a config asks for.

Three sources: an HF checkpoint directory (config.json + safetensors, loaded by transformers), an
HF config dict (random weights from a fixed seed, for tests and the embedded default), or a family
name that selects a YAML in model_configs/ (which carries such a dict).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..config.schema import ModelConfig

# A symlink inside the package to the repo-level model_configs/, so installs carry the YAMLs.
MODEL_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "model_configs"


class ModelLoadError(RuntimeError):
    """The model could not be built or loaded; the message says from where and what to do."""


def model_config_path(name: str) -> Optional[Path]:
    """model_configs/<name>.yaml if it exists."""
    p = MODEL_CONFIGS_DIR / f"{name}.yaml"
    return p if p.is_file() else None


def available_model_configs() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml")) if MODEL_CONFIGS_DIR.is_dir() else []


def resolve_model_arg(arg: str) -> dict[str, Any] | Path:
    """CLI `--model`: a checkpoint directory -> {'model': {'path': ...}}; a family name -> its YAML."""
    p = Path(arg)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"--model {arg}: directory has no config.json; expected an HF checkpoint directory")
        return {"model": {"path": str(p.resolve()), "hf_config": None}}
    yaml_path = model_config_path(arg)
    if yaml_path is not None:
        return yaml_path
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    raise ModelLoadError(
        f"--model {arg!r} is neither a checkpoint directory nor a model config; known model configs: "
        f"{', '.join(available_model_configs())}"
    )


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return dev


def causal_lm_class(config: Any) -> Any:
    """The *ForCausalLM class of an HF config: AutoModelForCausalLM's, or the family's own where the
    auto mapping lacks it (transformers 5.x maps "mistral4" only in the pretraining mapping)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES

    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    name = MODEL_FOR_PRETRAINING_MAPPING_NAMES.get(config.model_type, "")
    if name.endswith("ForCausalLM"):
        return getattr(transformers, name)
    raise ModelLoadError(f"{type(config).__name__}: transformers has no causal-LM class for model_type {config.model_type!r}")


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The eager HF model in eval mode on `device`/`dtype`."""
    import transformers

    kwargs = {"attn_implementation": cfg.attn_implementation}
    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model.path {cfg.path!r} has no config.json; expected an HF checkpoint directory")
        try:
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            model = causal_lm_class(config).from_pretrained(path, config=config, dtype=dtype, **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"loading the checkpoint at {path} failed: {type(exc).__name__}: {exc}") from exc
    elif cfg.hf_config is not None:
        hf = dict(cfg.hf_config)
        model_type = hf.pop("model_type", None)
        if model_type is None:
            raise ModelLoadError("model.hf_config needs a `model_type` (e.g. deepseek_v3)")
        try:
            config = transformers.AutoConfig.for_model(model_type, **hf)
        except Exception as exc:
            raise ModelLoadError(f"model.hf_config is not a valid {model_type} config: {exc}") from exc
        torch.manual_seed(cfg.seed)
        model = causal_lm_class(config)._from_config(config, dtype=torch.float32, **kwargs)
        model = model.to(dtype)
    else:
        raise ModelLoadError(
            "no model: set model.path (checkpoint), model.hf_config, or pass --model NAME with one of "
            f"{', '.join(available_model_configs())}"
        )
    return model.to(device).eval()
