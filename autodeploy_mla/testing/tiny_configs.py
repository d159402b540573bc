"""Tiny random-weight configs of every supported MLA family, for CPU tests and smoke runs.

The configs live in `model_configs/<family>.yaml` (`model.hf_config`, with the real model's MLA dims
in the comment above it); this module only reads them, so the YAML a user runs and the model a
test builds are the same. The tiny MLA dims are small but pairwise distinct (N, Dn, Dr, Dv, R), so
a matcher or kernel that mixes two of them up fails loudly; two layers each, the first dense and
the second MoE where the family has MoE (the sparse-attention families have 3-4, so that several
layers run an indexer and GLM-5 has one that reuses another's selection).
"""

from __future__ import annotations

import copy
from typing import Union

import torch
import yaml
from transformers import AutoConfig, PreTrainedModel

from ..config.families import available_model_configs, model_config_path
from ..models.factory import causal_lm_class

#: Every family in model_configs/ (the embedded `default` is a tiny DeepSeek-V3 too, not a family).
FAMILIES = tuple(f for f in available_model_configs() if f != "default")


def _load(family: str) -> dict:
    path = model_config_path(family)
    if path is None:
        raise FileNotFoundError(f"model_configs/{family}.yaml is missing")
    return yaml.safe_load(path.read_text())["model"]["hf_config"]


TINY_CONFIGS: dict[str, dict] = {f: _load(f) for f in FAMILIES}


def build_tiny_model(
    name_or_config: Union[str, dict], seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A seeded random-weight causal LM (eval mode, SDPA attention) from a tiny config.

    `name_or_config` is a key of TINY_CONFIGS or a config dict with "model_type"; the dict may carry
    "attn_implementation" to override SDPA (e.g. "eager"). Same seed, same model: what the
    eager-vs-compiled comparisons need.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in TINY_CONFIGS:
            raise KeyError(f"unknown tiny config {name_or_config!r}; known: {sorted(TINY_CONFIGS)}")
        cfg = copy.deepcopy(TINY_CONFIGS[name_or_config])
    else:
        cfg = copy.deepcopy(name_or_config)
    attn = cfg.pop("attn_implementation", "sdpa")
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = causal_lm_class(config)._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()
