"""Tiny random-weight configs of every supported MLA family, for CPU tests and the embedded default.

Each dict is a plain Hugging Face config (``model_type`` included) so that it round-trips through
YAML and ``transformers.AutoConfig.for_model(**d)``. The MLA dims are kept small but pairwise
distinct (N, Dn, Dr, Dv, R) so that a matcher or a kernel that mixes two of them up fails loudly
instead of passing by coincidence. Two layers each: the first dense, the second MoE where the
family has MoE, so MoE export stays covered.
"""

from __future__ import annotations

import copy
from typing import Union

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3, = DeepseekV3Config defaults): N 128, q_lora 1536, R 512,
# Dr 64, Dn 128, Dv 128; YaRN (factor 40, mscale = mscale_all_dim = 1.0), rope_interleave=True,
# first_k_dense_replace 3, 256 routed experts (8 per token), 1 shared expert.
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 40,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 16,
    "v_head_dim": 20,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "rope_interleave": True,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
}

# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite): N 16, no q_lora (q_proj), R 512, Dr 64, Dn 128,
# Dv 128; complex (view_as_complex) RoPE with YaRN (factor 40, mscale 0.707, mscale_all_dim 0.707),
# first_k_dense_replace 1, 64 routed experts (6 per token), 2 shared experts.
_DEEPSEEK_V2 = {
    "model_type": "deepseek_v2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 40,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 16,
    "v_head_dim": 20,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
}

# GLM-4.7-Flash (zai-org/GLM-4.7-Flash, = Glm4MoeLiteConfig defaults): N 20, q_lora 768, R 512,
# Dr 64, Dn 192, Dv 256 (Dn != Dv), rope_interleave=True, default RoPE, mlp_layer_types
# ["dense"] + ["sparse"] * 46, 64 routed experts (4 per token), 1 shared expert.
# Tiny keeps the proportions: Dn 24 < Dv 32, Dr 8.
_GLM_4_7_FLASH = {
    "model_type": "glm4_moe_lite",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 40,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "mlp_layer_types": ["dense", "sparse"],
    "rope_interleave": True,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

# Mistral-Small-4 (mistralai/Mistral-Small-4, = Mistral4Config defaults): N 32, q_lora 1024, R 256,
# Dr 64, Dn 64, Dv 128; YaRN (factor 128, original 8192) plus the Llama-4 query scale
# `1 + beta*log(1 + floor(pos / original_max_position_embeddings))` (beta 0.1), all layers MoE
# (first_k_dense_replace 0), 128 routed experts (4 per token), 1 shared expert.
# Tiny: original_max_position_embeddings 4 so the query scale varies inside short test sequences.
_MISTRAL_SMALL_4 = {
    "model_type": "mistral4",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 40,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "rope_interleave": True,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4,
        "max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
        "partial_rotary_factor": 8 / 24,
    },
    "tie_word_embeddings": False,
}

# MiniCPM3-4B (openbmb/MiniCPM3-4B, = MiniCPM3Config defaults): N 40, q_lora 768, R 256, Dr 32,
# Dn 64, Dv 64 (= hidden 2560 / 40); rotate_half RoPE (longrope in the checkpoint), dense MLP
# only (no MoE), scale_emb 12, scale_depth 1.4, dim_model_base 256, tied embeddings.
_MINICPM3 = {
    "model_type": "minicpm3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 40,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 20,
    "max_position_embeddings": 256,
    "scale_emb": 12,
    "scale_depth": 1.4,
    "dim_model_base": 32,
    "tie_word_embeddings": True,
}

TINY_CONFIGS: dict[str, dict] = {
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v2": _DEEPSEEK_V2,
    "glm_4_7_flash": _GLM_4_7_FLASH,
    "mistral_small_4": _MISTRAL_SMALL_4,
    "minicpm3": _MINICPM3,
}


def build_tiny_model(
    name_or_config: Union[str, dict], seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """Build a seeded random-weight causal LM (eval mode, SDPA attention) from a tiny config.

    `name_or_config` is a key of TINY_CONFIGS or a config dict with "model_type"; the dict may carry
    "attn_implementation" to override SDPA (e.g. "eager"). Weights are random (no hub access), so
    the same seed gives the same model, which is what the eager-vs-compiled comparisons need.
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
    model = _from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()


def _from_config(config, **kwargs) -> PreTrainedModel:
    """AutoModelForCausalLM, or the family's *ForCausalLM class where the auto mapping lacks it.

    transformers 5.x maps "mistral4" to Mistral4ForCausalLM only in the pretraining mapping.
    """
    name = MODEL_FOR_PRETRAINING_MAPPING_NAMES.get(config.model_type, "")
    if type(config) not in AutoModelForCausalLM._model_mapping and name.endswith("ForCausalLM"):
        return getattr(transformers, name)._from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)
