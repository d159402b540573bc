"""The DeepSeek-V3-shaped benchmark model and decode runtime shared by e2e_decode.py and tp_decode.py.

Real per-layer MLA dims by default (N 128, q_lora 1536, R 512, Dr 64, Dn 128, Dv 128), fewer
layers and smaller/fewer routed experts than the real model so it fits and builds quickly.
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
