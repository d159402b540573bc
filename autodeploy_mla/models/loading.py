"""The eager model a config asks for, FP8 checkpoints included: the one entry the API uses.

A 16-bit checkpoint or random weights come from `factory.build_model` (transformers). An FP8
checkpoint (`quantization_config` with `quant_method: fp8` in config.json) cannot go through
transformers' loader (its FP8 integration needs accelerate and, on CPU, dequantizes): it is built
as a weightless skeleton with its FP8 modules (models/fp8_modules.py) and filled from the
safetensors files by name, FP8 weights and float32 scales as stored (a per-tensor scale filled over
its block grid). Random FP8 weights (`model.init: hashed` with a quantization_config) are made the
same way, generated instead of read.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.schema import ModelConfig
from .checkpoint import load_module_weights
from .errors import ModelLoadError
from .factory import build_model, hf_config
from .fp8_modules import model_fp8_format
from .skeleton import build_skeleton, is_skeleton


def is_fp8_model(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s model has FP8 weights (its config's quantization_config); FP8FormatError for
    a quantization that is not supported, before anything is built."""
    if cfg.path is None and cfg.hf_config is None:
        return False
    where = f"{cfg.path}/config.json" if cfg.path is not None else "model.hf_config"
    return model_fp8_format(hf_config(cfg), where) is not None


def build_eager_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The eager model in eval mode on `device` (16-bit weights in `dtype`; FP8 weights stay FP8)."""
    if not is_fp8_model(cfg):
        return build_model(cfg, device, dtype)
    if cfg.path is None and cfg.init != "hashed":
        raise ModelLoadError("model.hf_config has an FP8 quantization_config: random FP8 weights are made with "
                             "model.init: hashed (set it, or drop the quantization_config for 16-bit weights)")
    model = build_skeleton(cfg, device, dtype)
    load_module_weights(model, device)
    return model.eval()


def reference_model(model: nn.Module, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A model with real weights for verification: `model` itself, or (skeleton) the full model
    (checkpoint, or the same hashed weights generated whole)."""
    if not is_skeleton(model):
        return model
    return build_eager_model(cfg, device, dtype)


__all__ = ["build_eager_model", "is_fp8_model", "reference_model"]
