"""The FP8 linear and expert shapes of the seven FP8-published MLA families, derived from their
published configs (the fields below), not written by hand per layer.

MLA dims agree with the `# mla_dims:` lines of model_configs/*.yaml (tests/test_fp8_kernels.py checks);
the MLP/MoE sizes are the published config.json values: DeepSeek-V3/R1 and V3.2 (deepseek-ai),
Kimi-K2 (moonshotai: V3's architecture, 64 heads, 384 experts), GLM-4.7-Flash and DeepSeek-V2-Lite (as
benchmarks.lib.shapes), GLM-5 and Mistral-Small-4-119B (transformers' GlmMoeDsaConfig /
Mistral4Config defaults, which are those checkpoints': hidden 6144 / 4096, 256 x 2048 / 128 x 2048
experts). kv_b_proj is not listed: it is dequantized once at build for weight absorption.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from benchmarks.lib.shapes import GLM_47_FLASH, V2_LITE

_MLA = ("hidden_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "n_shared_experts", "q_lora_rank", "kv_lora_rank", "num_attention_heads", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim")

DEEPSEEK_V3 = dict(zip(_MLA, (7168, 18432, 2048, 256, 8, 1, 1536, 512, 128, 128, 64, 128)))
FP8_FAMILIES: dict[str, dict[str, Any]] = {
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": {**DEEPSEEK_V3, "num_attention_heads": 64, "n_routed_experts": 384},
    "deepseek_v32": {**DEEPSEEK_V3, "index_n_heads": 64, "index_head_dim": 128},
    "glm_4_7_flash": {k: GLM_47_FLASH[k] for k in _MLA},
    "glm_5": dict(zip(_MLA, (6144, 12288, 2048, 256, 8, 1, 2048, 512, 64, 192, 64, 256))),
    "mistral_small_4": dict(zip(_MLA, (4096, 12288, 2048, 128, 4, 1, 1024, 256, 32, 64, 64, 128))),
    "deepseek_v2_lite": {k: V2_LITE[k] for k in _MLA},
}
#: a tiny family for --smoke runs and CPU tests (same structure, dims the interpreter gets through)
TINY = dict(zip(_MLA, (128, 192, 64, 4, 2, 1, 96, 64, 2, 32, 16, 32)))


class LinearShape(NamedTuple):
    family: str
    name: str
    n: int
    k: int


class ExpertShape(NamedTuple):
    family: str
    experts: int
    top_k: int
    hidden: int
    inter: int


def linear_shapes(family: str, cfg: dict[str, Any]) -> list[LinearShape]:
    """The FP8 linears of one decoder layer (dense MLP and MoE layers together), at the N the graph
    runs them: fuse_gemms joins q_a_proj + kv_a_proj_with_mqa and gate + up."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    kv_a = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    out = []
    if cfg["q_lora_rank"]:
        out += [("q_a+kv_a", cfg["q_lora_rank"] + kv_a, h), ("q_b", qk, cfg["q_lora_rank"])]
    else:
        out += [("q", qk, h), ("kv_a", kv_a, h)]
    out += [("o", h, heads * cfg["v_head_dim"]), ("mlp.gate+up", 2 * cfg["intermediate_size"], h),
            ("mlp.down", h, cfg["intermediate_size"])]
    shared = cfg.get("n_shared_experts") or 0
    if shared:
        si = shared * cfg["moe_intermediate_size"]
        out += [("shared.gate+up", 2 * si, h), ("shared.down", h, si)]
    if "index_n_heads" in cfg:
        out += [("indexer.wq_b", cfg["index_n_heads"] * cfg["index_head_dim"], cfg["q_lora_rank"]),
                ("indexer.wk", cfg["index_head_dim"], h)]
    return [LinearShape(family, *s) for s in out]


def expert_shape(family: str, cfg: dict[str, Any]) -> ExpertShape:
    return ExpertShape(family, cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"],
                       cfg["moe_intermediate_size"])


def mla_dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(N, Dn, Dr, Dv, R), the `# mla_dims:` fields of model_configs/*.yaml."""
    return (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
            cfg["kv_lora_rank"])
