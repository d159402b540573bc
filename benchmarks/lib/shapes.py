"""Benchmark model configs shared by the scripts: the DeepSeek-V3-shaped model and decode runtime
(e2e_decode.py, tp_decode.py), the 4-layer V3 shape, and the published DeepSeek-V2-Lite and
GLM-4.7-Flash configs (serving.py, e2e_roofline.py).

The V3 shape has the real per-layer MLA dims by default (N 128, q_lora 1536, R 512, Dr 64, Dn 128,
Dv 128), fewer layers and smaller/fewer routed experts than the real model so it fits and builds
quickly.
"""

from __future__ import annotations

import argparse
from typing import Any


def deepseek_v3_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """HF config dict from the scripts' common arguments (MLA dims default to DeepSeek-V3's)."""
    return {
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "moe_intermediate_size": args.moe_intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "q_lora_rank": getattr(args, "q_lora", 1536),
        "kv_lora_rank": getattr(args, "kv_lora", 512),
        "qk_nope_head_dim": getattr(args, "dn", 128),
        "qk_rope_head_dim": getattr(args, "dr", 64),
        "v_head_dim": getattr(args, "dv", 128),
        "n_routed_experts": args.experts,
        "num_experts_per_tok": args.topk,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "rope_interleave": True,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
    }


def extra_tokens(args: argparse.Namespace, profiled_steps: int = 0) -> int:
    """Tokens each sequence grows past its context during a run: warm-up, timed (and profiled)
    decode steps, plus slack."""
    return args.warmup + args.steps + profiled_steps + 8


def decode_runtime(args: argparse.Namespace, extra: int) -> dict[str, Any]:
    """`runtime` config for decode benchmarks: up to max(batches) sequences of up to
    max(contexts) + extra tokens each (the pages the scripts reserve per sequence), one
    token per sequence per step."""
    max_len = max(args.contexts) + extra
    return {
        "max_batch_size": max(args.batches),
        "max_seq_len": max_len,
        "max_num_tokens": max(args.batches),
        "page_size": args.page_size,
        "num_pages": 1 + max(args.batches) * -(-max_len // args.page_size),  # + the scratch page
    }


def deepseek_v32_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """The V3 shape with DeepSeek-V3.2's sparse attention: a lightning indexer per layer (64 heads x
    128, index_topk 2048 by default; `--quick` runs shrink them), contexts up to 128k."""
    cfg = deepseek_v3_shaped(args)
    cfg.update({"model_type": "deepseek_v32", "index_n_heads": getattr(args, "index_heads", 64),
                "index_head_dim": getattr(args, "index_dim", 128), "index_topk": getattr(args, "index_topk", 2048),
                "max_position_embeddings": 163840})
    cfg.pop("rope_interleave", None)  # DeepSeek-V3.2 always ropes the main attention interleaved
    return cfg


# deepseek-ai/DeepSeek-V2-Lite config.json (the fields the HF DeepseekV2 model reads).
V2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 0.707, "mscale_all_dim": 0.707},
    "tie_word_embeddings": False,
}


def v3_4layer() -> dict[str, Any]:
    """The 4-layer DeepSeek-V3 shape of the serving and roofline benchmarks (16 experts x 1024, top-4)."""
    cfg = deepseek_v3_shaped(argparse.Namespace(vocab=32768, hidden=7168, intermediate=4096, moe_intermediate=1024,
                                                layers=4, heads=128, experts=16, topk=4))
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,  # DeepSeek-V3's
                              "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0}
    return cfg


# GLM-4.7-Flash (glm4_moe_lite): MLA dims from the family YAML (N 20, q_lora 768, R 512, Dr 64,
# Dn 192, Dv 256), hidden 2048, 47 layers (first dense), 64 routed experts x 1536 top-4, 1 shared,
# vocab 154880: 29.9 B parameters, the figure issue 13 quotes.
GLM_47_FLASH = {
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense"] + ["sparse"] * 46,
    "rope_interleave": True,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
}


# deepseek-ai/DeepSeek-V2 config.json (236 B parameters, 21 B active): 60 layers, N 128, q_lora 1536,
# 160 routed experts x 1536 top-6 (group-limited: 8 groups, 3 chosen), 2 shared, first layer dense.
# Does not fit one H200 in bf16 (~472 GB): built at tensor parallel 8 with model.init=hashed.
DEEPSEEK_V2 = {
    **V2_LITE,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 60,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "n_routed_experts": 160,
    "routed_scaling_factor": 16.0,
    "topk_method": "group_limited_greedy",
    "n_group": 8,
    "topk_group": 3,
}

# mistralai/Mistral-Small-4-119B-2603: transformers' Mistral4Config defaults, which its docstring
# names as that checkpoint's (hidden 4096, 36 layers all MoE, 128 routed experts x 2048 top-4, 1 shared,
# N 32, q_lora 1024, R 256, Dr 64, Dn 64, Dv 128, vocab 131072; YaRN x128 over 8192 with the
# position-dependent query scale): 119 B parameters, ~238 GB in bf16, ~120 GB in FP8.
MISTRAL_SMALL_4_119B = {
    "model_type": "mistral4",
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": 1024,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 128,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "rope_interleave": True,
    "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                        "original_max_position_embeddings": 8192, "max_position_embeddings": 1048576,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 0.5},
    "tie_word_embeddings": False,
}

#: Published configs by the name the scripts take (`--model`).
PUBLISHED = {"v2_lite": V2_LITE, "glm_4_7_flash": GLM_47_FLASH, "deepseek_v2": DEEPSEEK_V2,
             "mistral_small_4_119b": MISTRAL_SMALL_4_119B}
