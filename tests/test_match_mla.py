"""export_model + match_mla on every MLA family (tiny random configs), and the refusals.

Oracle: the eager HF model in fp32. The matched graph must reproduce its logits on a batch of 2 at a
sequence length different from the export example, with one row's positions offset (as in a
chunked-prefill continuation).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim
from transformers import AutoConfig

import autodeploy_mla  # noqa: F401  (registers torch.ops.autodeploy.*)
from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS, build_tiny_model
from autodeploy_mla.transforms.export import ExportError, export_model
from autodeploy_mla.transforms.match_mla import MLAMatchError, match_mla

aten = torch.ops.aten
TORCH_MLA = torch.ops.autodeploy.torch_mla.default
SEQ = 13  # != the export example (8)

# (case id, tiny config key, attn_implementation, config overrides, expected MLAMatch.kind)
CASES = [
    ("deepseek_v3", "deepseek_v3", "sdpa", {}, "deepseek_v3"),
    ("deepseek_v3_eager", "deepseek_v3", "eager", {}, "deepseek_v3"),
    ("deepseek_v3_no_q_lora", "deepseek_v3", "sdpa", {"q_lora_rank": None}, "deepseek_v3"),
    ("deepseek_v3_no_interleave", "deepseek_v3", "sdpa", {"rope_interleave": False}, "deepseek_v3"),
    ("deepseek_v2", "deepseek_v2", "sdpa", {}, "deepseek_v2"),
    ("glm_4_7_flash", "glm_4_7_flash", "sdpa", {}, "glm4_moe_lite"),
    ("mistral_small_4", "mistral_small_4", "sdpa", {}, "mistral4"),
    ("minicpm3", "minicpm3", "sdpa", {}, "minicpm3"),
]


def _config(key: str, attn: str, overrides: dict) -> dict:
    cfg = copy.deepcopy(TINY_CONFIGS[key])
    cfg.update(overrides)
    cfg["attn_implementation"] = attn
    return cfg


def _inputs(batch: int = 2, seq: int = SEQ, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    pos = torch.arange(seq).expand(batch, seq).clone()
    pos[1:] += 3  # a continuation chunk: positions do not start at 0
    return ids, pos


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _attention_softmax(gm: torch.fx.GraphModule) -> list:
    """Softmax nodes inside attention modules (MoE routers have their own softmax)."""
    return [
        n
        for n in gm.graph.nodes
        if n.target in (aten.softmax.int, aten._softmax.default)
        and any("self_attn" in path for path, _ in (n.meta.get("nn_module_stack") or {}).values())
    ]


def _has_moe(cfg: dict) -> bool:
    return "n_routed_experts" in cfg


@pytest.mark.parametrize("case,key,attn,overrides,kind", CASES, ids=[c[0] for c in CASES])
def test_hf_family_matches_eager(case, key, attn, overrides, kind):
    cfg = _config(key, attn, overrides)
    model = build_tiny_model(cfg)
    ids, pos = _inputs()
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits

    gm = export_model(model)
    with torch.no_grad():
        assert torch.equal(gm(ids, pos), ref), "export must be bit-identical to eager"

    masks = {n.args[3].name for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default}
    records = match_mla(gm)
    layers = model.config.num_hidden_layers
    assert not masks & {n.name for n in gm.graph.nodes}, "the dropped causal mask must be removed"
    targets = _targets(gm)
    assert targets.count(TORCH_MLA) == layers == len(records)
    assert aten.scaled_dot_product_attention.default not in targets
    assert not _attention_softmax(gm), "eager attention softmax left in the graph"
    assert aten.copy_.default not in targets and aten.new_empty.default not in targets
    if _has_moe(cfg):  # MoE stays on: exported through the grouped_mm experts op
        assert any("grouped_mm" in str(t) for t in targets)

    c = model.config
    dims = MLADims(c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank)
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, rec in enumerate(records):
        attn_mod = model.model.layers[i].self_attn
        assert rec.layer == f"model.layers.{i}.self_attn"
        assert model.get_submodule(rec.layer) is attn_mod
        assert rec.kind == kind and rec.source == attn
        assert rec.dims == dims
        assert rec.scale == pytest.approx(attn_mod.scaling, rel=1e-12)
        node = nodes[rec.node]
        assert node.target is TORCH_MLA
        assert node.args[6] == rec.scale  # passed positionally
        assert node.meta["mla_dims"] == dims and node.meta["mla_layer"] == rec.layer
        # kv_b_proj is no longer applied to the latent: its weight only feeds torch_mla.
        w = node.args[4]
        assert w.op == "get_attr" and w.target.endswith(f"layers.{i}.self_attn.kv_b_proj.weight")
        assert list(w.users) == [node]
    if "rope_parameters" in cfg and cfg["rope_parameters"].get("mscale_all_dim"):
        assert records[0].scale != pytest.approx(dims.default_scale()), "YaRN mscale must change the scale"

    with torch.no_grad():
        out = gm(ids, pos)
        assert (out - ref).abs().max().item() <= 1e-5
        # the runtime's shape: one flattened token batch [1, T]
        one = model(input_ids=ids[1:, :5], position_ids=pos[1:, :5], use_cache=False).logits
        assert (gm(ids[1:, :5], pos[1:, :5]) - one).abs().max().item() <= 1e-5


def test_mistral4_query_factor_is_position_dependent():
    """The tiny Mistral4 config must exercise the Llama-4 query factor within the test length."""
    model = build_tiny_model("mistral_small_4")
    rp = model.config.rope_parameters
    assert SEQ > rp["original_max_position_embeddings"] and rp["llama_4_scaling_beta"] > 0
    gm = export_model(model)
    records = match_mla(gm)
    assert all(any("query factor" in note for note in r.notes) for r in records)


def test_tiny_configs_are_valid_and_dims_distinct():
    for key, cfg in TINY_CONFIGS.items():
        config = AutoConfig.for_model(**copy.deepcopy(cfg))
        # two layers; the sparse (DSA) families more, so several layers run an indexer (and GLM-5 has a
        # layer that reuses another's selection)
        sparse = getattr(config, "index_topk", None) is not None
        assert (config.num_hidden_layers >= 2 if sparse else config.num_hidden_layers == 2) and config.vocab_size == 256
        dims = (
            config.num_attention_heads,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.kv_lora_rank,
        )
        assert len(set(dims)) == 5, f"{key}: MLA dims {dims} must be pairwise distinct"
    model = build_tiny_model("glm_4_7_flash")
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Glm4MoeLiteMLP", "Glm4MoeLiteMoE"]
    assert model.config.qk_nope_head_dim != model.config.v_head_dim


# --------------------------------------------------------------------------------------------
# Native torch_mla, padding masks, plain attention
# --------------------------------------------------------------------------------------------


class _TinyMLA(nn.Module):
    """A hand-written MLA causal LM; `mode` picks how attention is expressed.

    native: calls torch_mla itself. is_causal / position_mask: HF-like expanded MLA with SDPA,
    causal via is_causal or a mask built from position_ids. Refused variants: none (bidirectional),
    window (sliding-window mask), tokens (mask from input_ids values), per_head_rope (the rope key
    is not shared across heads).
    """

    def __init__(self, mode: str, vocab=64, hidden=32, n=2, dn=6, dr=4, dv=5, r=12):
        super().__init__()
        self.mode, self.n, self.dn, self.dr, self.dv, self.r = mode, n, dn, dr, dv, r
        self.embed = nn.Embedding(vocab, hidden)
        self.q_proj = nn.Linear(hidden, n * (dn + dr), bias=False)
        self.kv_a_proj = nn.Linear(hidden, r + dr, bias=False)
        self.kv_b_proj = nn.Linear(r, n * (dn + dv), bias=False)
        self.k_rope_heads = nn.Linear(hidden, n * dr, bias=False)
        self.o_proj = nn.Linear(n * dv, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, use_cache=False):
        n, dn, dr, dv, r = self.n, self.dn, self.dr, self.dv, self.r
        x = self.embed(input_ids)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, n, dn + dr)
        ckv, kpe = self.kv_a_proj(x).split([r, dr], dim=-1)
        angle = position_ids[..., None].float() * 0.1  # a position-dependent "rope" on q_pe and kpe
        q_nope, q_pe = q[..., :dn], q[..., dn:] * torch.cos(angle)[:, :, None, :]
        kpe = (kpe * torch.cos(angle)).view(b, s, 1, dr)
        if self.mode == "native":
            out = torch.ops.autodeploy.torch_mla(q_nope, q_pe, ckv, kpe, self.kv_b_proj.weight, True, 0.3)
            return self.lm_head(self.o_proj(out.reshape(b, s, n * dv)))
        kv = self.kv_b_proj(ckv).view(b, s, n, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)
        if self.mode == "per_head_rope":
            k_rope = self.k_rope_heads(x).view(b, s, n, dr).transpose(1, 2)
        else:
            k_rope = kpe.transpose(1, 2).expand(-1, n, -1, -1)
        query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        key = torch.cat([k_nope, k_rope], dim=-1)
        qpos, kpos = position_ids[:, None, :, None], position_ids[:, None, None, :]
        mask, is_causal = None, False
        if self.mode in ("is_causal", "per_head_rope"):
            is_causal = True
        elif self.mode == "position_mask":
            mask = kpos <= qpos
        elif self.mode == "window":
            mask = (kpos <= qpos) & (qpos - kpos < 3)
        elif self.mode == "tokens":
            mask = (kpos <= qpos) & (input_ids != 0)[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, v, attn_mask=mask, is_causal=is_causal, scale=0.3)
        return self.lm_head(self.o_proj(out.transpose(1, 2).reshape(b, s, n * dv)))


def _tiny(mode: str) -> _TinyMLA:
    torch.manual_seed(0)
    return _TinyMLA(mode).eval()


def test_native_torch_mla_passes_through():
    model = _tiny("native")
    gm = export_model(model)
    before = gm.code
    records = match_mla(gm)
    assert gm.code == before
    assert len(records) == 1
    rec = records[0]
    assert rec.kind == "native" and rec.source == "torch_mla"
    assert rec.dims == MLADims(2, 6, 4, 5, 12) and rec.scale == 0.3
    node = next(n for n in gm.graph.nodes if n.name == rec.node)
    assert node.meta["mla_dims"] == rec.dims and node.meta["mla_layer"] == rec.layer
    ids, pos = _inputs(vocab=64)
    with torch.no_grad():
        assert torch.equal(gm(ids, pos), model(ids, pos))


@pytest.mark.parametrize("mode", ["is_causal", "position_mask"])
def test_hand_written_mla_matches(mode):
    """cat-assembled key; causality from is_causal=True or from a position_ids mask."""
    model = _tiny(mode)
    gm = export_model(model)
    records = match_mla(gm)
    assert len(records) == 1 and records[0].kind == "mla" and records[0].source == "sdpa"
    assert records[0].dims == MLADims(2, 6, 4, 5, 12) and records[0].scale == 0.3
    assert aten.scaled_dot_product_attention.default not in _targets(gm)
    ids, pos = _inputs(vocab=64)
    with torch.no_grad():
        assert (gm(ids, pos) - model(ids, pos)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("none", "not causal"),
        ("window", "not the plain causal mask"),
        ("tokens", "data-dependent mask"),
        ("per_head_rope", "not one head broadcast"),
    ],
)
def test_mla_like_attention_that_fails_a_check_is_refused(mode, reason):
    gm = export_model(_tiny(mode))
    before = gm.code
    with pytest.raises(MLAMatchError) as err:
        match_mla(gm)
    assert reason in str(err.value) and "looks like MLA" in str(err.value)
    assert gm.code == before, "a refusal must not leave a half-rewritten graph"


def test_padding_attention_mask_is_refused():
    """A graph exported WITH attention_mask as an input: the mask it drops would not be causal."""
    model = build_tiny_model("deepseek_v3")

    class WithMask(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, input_ids, attention_mask, position_ids):
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits

    ids, pos = _inputs(seq=8)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0  # left padding
    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    shapes = ({0: batch, 1: seq},) * 3
    with torch.no_grad():
        gm = torch.export.export(WithMask(model), (ids, attention_mask, pos), dynamic_shapes=shapes).module()
    before = gm.code
    with pytest.raises(MLAMatchError) as err:
        match_mla(gm)
    msg = str(err.value)
    assert "layers.0.self_attn" in msg and "padding attention mask" in msg and "'attention_mask'" in msg
    assert gm.code == before


class _PlainAttention(nn.Module):
    """Ordinary multi-head attention on separate q/k/v projections: not MLA."""

    def __init__(self, vocab=64, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, use_cache=False):
        x = self.embed(input_ids)
        b, s, h = x.shape

        def heads(t):
            return t.view(b, s, self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.lm_head(out.transpose(1, 2).reshape(b, s, h))


def test_plain_attention_is_left_alone_and_reported():
    """Decision: non-MLA attention is not an error by default (the caller decides): match_mla
    returns no record for it, leaves the graph as is and lists it in gm.meta["match_mla_skipped"];
    strict=True turns it into an MLAMatchError."""
    torch.manual_seed(0)
    gm = export_model(_PlainAttention().eval())
    before = gm.code
    assert match_mla(gm) == []
    assert gm.code == before
    assert len(gm.meta["match_mla_skipped"]) == 1
    with pytest.raises(MLAMatchError, match="not MLA"):
        match_mla(gm, strict=True)


def test_export_rejects_size_one_examples_and_explains_failures():
    with pytest.raises(ValueError, match=">= 2"):
        export_model(_PlainAttention(), example_seq=1)

    class Broken(nn.Module):
        def forward(self, input_ids, position_ids, use_cache=False):
            if input_ids.sum() > 0:  # data-dependent control flow does not export
                return input_ids.float()
            return -input_ids.float()

    with pytest.raises(ExportError, match="What to try"):
        export_model(Broken())
