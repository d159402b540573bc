"""Building the models the end-to-end benchmarks time: the eager HF model from a config dict, and
`optimize()` on a published config with a named variant of the passes ("inductor+moe": Inductor on
the static pieces and the fuse_moe pass on, every other optional pass off), so that a variant name
in a results table says exactly which passes ran.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Optional

import torch

from benchmarks.lib.product import FlashInferPolicy, optimize
from benchmarks.lib.shapes import GLM_47_FLASH, V2_LITE, v3_4layer

MODELS = {"v2_lite": lambda: V2_LITE, "glm_4_7_flash": lambda: GLM_47_FLASH, "v3_4layer": v3_4layer}


def build_hf(cfg: dict, device: torch.device, dtype: torch.dtype):
    import transformers

    hf = dict(cfg)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


#: Pass switches a variant name is made of ("inductor+moe"); "base" (or "none") is neither.
VARIANT_PARTS: dict[str, dict[str, dict[str, Any]]] = {
    "inductor": {"piecewise": {"compile": "inductor"}},
    "moe": {"fuse_moe": {"enabled": True, "shared_experts": "never"}},
    "shared": {"fuse_moe": {"enabled": True, "shared_experts": "always"}},  # the shared expert as expert E of the op
    "triton": {"insert_cached_mla_attention": {"backend": "triton"}},  # every layer on our Triton MLA backend
    "gemms": {"fuse_gemms": {"enabled": True}},
    "routing": {"fuse_routing": {"enabled": True, "gate_gemm": False}},  # the routing op after the model's gate GEMM
    "gate": {"fuse_routing": {"enabled": True, "gate_gemm": True}},  # the gate GEMM in the routing op too
    "rope": {"real_rope": {"enabled": True}},  # complex-number rotary products as real arithmetic (V2)
}


#: variant parts that set a backend policy instead of a pass option
POLICY_PARTS = ("absorbed",)  # absorbed: every FlashInfer prefill step on FlashInfer (no cost-model routing)
#: variant parts that set runtime keys
RUNTIME_PARTS: dict[str, dict[str, Any]] = {"fp8": {"kv_cache_dtype": "fp8_e4m3"}}  # e4m3 latent cache


def variant_policies(variant: str) -> dict[str, Any]:
    """Backend policies of a variant (`absorbed`: FlashInferPolicy(prefill="flashinfer"))."""

    parts = variant.split("+")
    return {"flashinfer_mla": FlashInferPolicy(prefill="flashinfer")} if "absorbed" in parts else {}


def variant_transforms(variant: str) -> dict[str, dict[str, Any]]:
    """Pass options of a variant: every switch of VARIANT_PARTS off unless named ("inductor+moe")."""
    parts = [p for p in variant.split("+") if p not in ("base", "none", "", *POLICY_PARTS, *RUNTIME_PARTS)]
    unknown = [p for p in parts if p not in VARIANT_PARTS]
    if unknown:
        raise ValueError(f"unknown variant part(s) {unknown}; known: base, {', '.join(VARIANT_PARTS)}, "
                         f"{', '.join(POLICY_PARTS)}, {', '.join(RUNTIME_PARTS)}")
    out: dict[str, dict[str, Any]] = {"piecewise": {"compile": "none"}, "fuse_moe": {"enabled": False},
                                      "fuse_gemms": {"enabled": False}, "fuse_routing": {"enabled": False},
                                      "real_rope": {"enabled": False}}
    for p in parts:
        for k, v in VARIANT_PARTS[p].items():
            out.setdefault(k, {}).update(v)
    return out


def build_model(name: str, variant: str, args: argparse.Namespace, transforms: Optional[dict[str, Any]] = None):
    """optimize() on the named config (bf16 random weights) sized for the script's batches, contexts and
    chunks; `variant` names the passes that are on (variant_transforms), `transforms` more pass options
    merged over it."""

    hf = copy.deepcopy(MODELS[name]())
    if args.quick:
        hf.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256, n_routed_experts=8,
                  num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=48 if hf.get("q_lora_rank") else None,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
        if "mlp_layer_types" in hf:
            hf["mlp_layer_types"] = ["dense", "sparse"]
    max_len = max(args.contexts, default=0) + args.warmup + args.steps + 16
    page = 64 if not args.quick else 16
    batch, chunk = max(args.batches, default=1), max(args.chunks, default=1)  # either list may be empty
    cfg = {"model": {"hf_config": hf, "device": args.device,
                     "dtype": "bfloat16" if args.device != "cpu" else "float32"},
           "runtime": {"max_batch_size": batch, "max_seq_len": max(max_len, chunk + 8),
                       "max_num_tokens": max(chunk, batch), "page_size": page,
                       "num_pages": 2 + batch * -(-max(max_len, chunk + 8) // page)},
           "transforms": variant_transforms(variant)}
    for k, v in (transforms or {}).items():
        cfg["transforms"].setdefault(k, {}).update(v)
    for part in variant.split("+"):
        cfg["runtime"].update(RUNTIME_PARTS.get(part, {}))
    return optimize(None, cfg, backend_policies=variant_policies(variant))
