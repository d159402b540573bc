"""DSA families nobody named (issue 45): the capture proves each layer's facts from its own forward.

The variants are built here by subclassing the Hugging Face DeepSeek-V3.2 and GLM-5 modules under new
class names, with indexers that rope other dims in another layout, skip the index-key norm, weight
the heads by a softmax, use odd head counts and index dims, and share selections every other layer.
No product code names them. Each must give HF eager's greedy tokens in fp32 through the paged cache,
and report the facts it was proven to have; an indexer no candidate expresses is refused, naming the
candidates tried. Index heads stay at 12-15: with few heads an index score is exactly 0 often enough
that top-k ties make HF's own cached and uncached paths disagree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from autodeploy_mla.api import optimize
from autodeploy_mla.models.sparse_attention import find_sparse_attention
from autodeploy_mla.testing import hf_greedy_generate
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS, build_tiny_model
from autodeploy_mla.transforms.export import SparseAttentionNotCaptured, export_model

RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """RoPE over all of x's last dim. "adjacent" keeps each rotated pair in place (the layout the
    reference DeepSeek code stores, not HF's de-interleaved output): dot products are the same."""
    if pairs == "halves":
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)


@dataclass(frozen=True)
class IndexerSpec:
    """How a synthetic indexer differs from DeepSeek-V3.2's."""

    pairs: str = "halves"  # "halves", "adjacent" or "none"
    where: str = "first"  # rope the first or the last r dims of the index vectors
    key_norm: bool = True
    weighting: str = "projected"  # or "softmax" (over heads)
    activation: str = "relu"  # "abs" is outside every candidate: the model must be refused

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.pairs == "none":
            return x
        r = cos.shape[-1]
        if self.where == "first":
            return torch.cat((_rotate(x[..., :r], cos, sin, self.pairs), x[..., r:]), dim=-1)
        return torch.cat((x[..., :-r], _rotate(x[..., -r:], cos, sin, self.pairs)), dim=-1)


def _variant_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                             cache=None):
    """A DSA indexer written from the math (docs/sparse_mla.md), shaped by `self.spec`."""
    spec: IndexerSpec = self.spec
    b, s, _ = hidden_states.shape
    cos, sin = (t.unsqueeze(2) for t in position_embeddings)
    q = spec.rope(self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim), cos, sin)
    k = self.wk(hidden_states)
    if spec.key_norm:
        k = self.k_norm(k)
    k = spec.rope(k.unsqueeze(2), cos, sin).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    logits = torch.einsum("bshd,btd->bsht", q.float(), k.float()) * self.head_dim ** -0.5
    per_head = logits.relu() if spec.activation == "relu" else logits.abs()
    w = self.weights_proj(hidden_states).float()
    w = w * self.n_heads ** -0.5 if spec.weighting == "projected" else w.softmax(-1)
    index = (per_head * w.unsqueeze(-1)).sum(2)
    if attention_mask.dtype == torch.bool:
        index = index.masked_fill(~attention_mask, float("-inf"))
    else:
        index = index + attention_mask
    return index.topk(min(self.index_topk, index.shape[-1]), dim=-1).indices.to(torch.int32)


def variant_model(base: str, attention_name: str, spec: IndexerSpec | None = None, **config) -> torch.nn.Module:
    """The tiny `base` model with `config` overrides, its attention classes subclassed under
    `attention_name` and (with a spec) its indexers under `<prefix>Indexer` with the spec's forward."""
    cfg = copy.deepcopy(TINY_CONFIGS[base])
    cfg.update(config)
    model = build_tiny_model(cfg)
    attn0 = model.model.layers[0].self_attn
    attn_cls = type(attention_name, (type(attn0),), {})
    idx_cls = None
    if spec is not None:
        idx_cls = type(attention_name.replace("Attention", "Indexer"), (type(attn0.indexer),),
                       {"forward": _variant_indexer_forward, "spec": spec})
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.__class__ = attn_cls
        if idx_cls is not None and attn.indexer is not None:
            attn.indexer.__class__ = idx_cls
            if not spec.key_norm:
                attn.indexer.k_norm = None
    return model


ALTERNATE = ["full", "shared", "full", "shared"]

VARIANTS = {
    # a family nobody named: GLM-5 unchanged but for its class names, every other layer sharing
    "XAttention": dict(base="glm_5", attention_name="XAttention", indexer_types=ALTERNATE),
    # interleaved RoPE on the last 8 of 24 index dims; odd attention and index head counts
    "interleaved_last_odd_heads": dict(base="deepseek_v32", attention_name="OddHeadsAttention",
                                       spec=IndexerSpec(pairs="adjacent", where="last"), num_attention_heads=5,
                                       num_key_value_heads=5, index_n_heads=13, index_head_dim=24,
                                       qk_rope_head_dim=8),
    # no index-key norm, no RoPE in the indexer, heads weighted by a softmax, index dim 20
    "no_norm_no_rope_softmax": dict(base="deepseek_v32", attention_name="PlainIndexAttention",
                                    spec=IndexerSpec(pairs="none", key_norm=False, weighting="softmax"),
                                    index_n_heads=15, index_head_dim=20),
    # GLM-5 layout with half-split RoPE on the last dims, every other layer sharing, index dim 40
    "glm_half_last_shared": dict(base="glm_5", attention_name="YAttention", spec=IndexerSpec(where="last"),
                                 indexer_types=ALTERNATE, index_n_heads=14, index_head_dim=40),
}

EXPECTED_INDEXER = {
    "XAttention": ("interleaved on the first 16 of 32 dims", "indexer.k_norm (LayerNorm)", "weights_proj(x) * H^-1/2"),
    "interleaved_last_odd_heads": ("interleaved on the last 8 of 24 dims", "indexer.k_norm (LayerNorm)",
                                   "weights_proj(x) * H^-1/2"),
    "no_norm_no_rope_softmax": ("none", "none", "softmax over heads of weights_proj(x)"),
    "glm_half_last_shared": ("half-split on the last 16 of 40 dims", "indexer.k_norm (LayerNorm)",
                             "weights_proj(x) * H^-1/2"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_greedy_tokens_identical_to_hf(variant):
    """Proven facts, then the paged cache (torch reference) with chunked prefill and mixed batches:
    greedy tokens equal HF eager's; the build report says what was proven, on what evidence."""
    model = variant_model(**VARIANTS[variant])
    om = optimize(model, overrides=RUNTIME)
    record = next(r for r in om.history if r.name == "export")
    checks = record.details["sparse_attention"]["checks"]
    full = next(c for c in checks if not c["shared"])
    facts = full["facts"]
    assert (facts["indexer_rope"], facts["index_key_norm"], facts["score_weighting"]) == EXPECTED_INDEXER[variant]
    assert facts["attention_rope"] == "interleaved" and full["class"] == VARIANTS[variant]["attention_name"]
    assert "queries that see more than 6 keys" in full["evidence"]["selection"] and full["rel_err"] <= 1e-4
    shares = VARIANTS[variant].get("indexer_types") == ALTERNATE
    assert [c["shared"] for c in checks] == ([False, True] if shares else [False])
    if shares:
        shared = checks[1]
        assert shared["facts"]["takes_selection_from"] == "prev_topk_indices"
        assert shared["applies_to"] == ["model.layers.1.self_attn", "model.layers.3.self_attn"]
        assert facts["passes_selection_on"] == "output 2"
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (3, 17, 11, 21)]
    assert om.generate(prompts, max_new_tokens=6) == [hf_greedy_generate(model, p, 6) for p in prompts], variant


def test_variants_are_detected_by_structure():
    """No class names: the indexers are found by their own index_topk, the layers without one by being
    of an attention class that holds None where the others hold an indexer."""
    info = find_sparse_attention(variant_model(**VARIANTS["XAttention"]))
    assert info.attention_paths == tuple(f"model.layers.{i}.self_attn" for i in range(4))
    assert info.indexer_paths == ("model.layers.0.self_attn.indexer", "model.layers.2.self_attn.indexer")
    assert info.shared_layers == (1, 3) and info.index_topk == 6
    odd = find_sparse_attention(variant_model(**VARIANTS["interleaved_last_odd_heads"]))
    assert (odd.index_n_heads, odd.index_head_dim) == (13, 24)


def test_a_wrong_candidate_is_rejected_with_evidence():
    """The proof tells layouts apart: for GLM-5 the half-split candidates (first in order) are rejected
    with the number of queries on which HF's selection is not theirs, before interleaved wins."""
    gm = export_model(build_tiny_model("glm_5"))
    full = gm.meta["sparse_attention"]["checks"][0]
    assert full["facts"]["indexer_rope"] == "interleaved on the first 16 of 32 dims"
    rejected = [r for r in full["rejected"] if r.startswith("half-split on the first")]
    assert rejected and all("not the top-6 on" in r for r in rejected)


def test_an_indexer_no_candidate_expresses_is_refused_naming_the_candidates():
    """|q . k| instead of relu(q . k): no candidate reproduces the selection, so the model is refused
    before export, naming the layer and every candidate tried."""
    model = variant_model("deepseek_v32", "AbsScoreAttention", IndexerSpec(activation="abs"), index_n_heads=13)
    with pytest.raises(SparseAttentionNotCaptured) as err:
        export_model(model)
    msg = str(err.value)
    assert "model.layers.0.self_attn (AbsScoreAttention): no candidate reproduces its indexer's selection" in msg
    for name in ("half-split on the first r dims", "interleaved on the last r dims", "'none'",
                 "indexer.k_norm (LayerNorm)", "softmax over heads of weights_proj(x)"):
        assert name in msg, name
    assert "needs a new candidate in transforms/sparse_facts.py" in msg


def test_a_weightless_model_is_proven_on_a_random_copy():
    """The facts belong to the code: a skeleton (weights loaded after export) is proven on a random-weight
    copy of each kind's first module, and the record says so; the model's own modules stay untouched."""
    from autodeploy_mla.transforms.sparse_export import prove_each_kind, sparse_attention_modules

    model = variant_model(**VARIANTS["interleaved_last_odd_heads"])
    model._autodeploy_skeleton = object()  # is_skeleton(): weights arrive after export
    before = model.model.layers[0].self_attn.indexer.wk.weight.clone()
    info = find_sparse_attention(model)
    plan, records = prove_each_kind(model, info, sparse_attention_modules(model, info))
    assert len(plan) == 3 and records[0]["weights"].startswith("random")
    assert records[0]["facts"]["indexer_rope"] == "interleaved on the last 8 of 24 dims"
    assert torch.equal(model.model.layers[0].self_attn.indexer.wk.weight, before)
