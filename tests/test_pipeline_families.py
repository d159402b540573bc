"""optimize() + generate() on a tiny random model of every family == the eager HF model (fp32, CPU)."""

import pytest
import torch

from autodeploy_mla.testing import hf_greedy_generate

FAMILIES = ["deepseek_v3", "deepseek_v2", "glm_4_7_flash", "mistral_small_4", "minicpm3"]
# Small token budget and pages: prompts prefill in chunks and span several pages.
RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
PROMPT_LENS = [3, 11, 17, 1, 9]
NEW = 6


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, optimized_family):
    om = optimized_family(request.param, RUNTIME)  # optimize(family, overrides=RUNTIME), shared (conftest)
    return request.param, om


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_greedy_tokens_identical_to_hf(built):
    family, om = built
    prompts = _prompts(om.eager_model.config.vocab_size)
    outs = om.generate(prompts, max_new_tokens=NEW)
    ref = [hf_greedy_generate(om.eager_model, p, NEW) for p in prompts]
    assert outs == ref, family
    # continuous batching really mixed prefill and decode in one step
    assert om.allocator.num_free == om.allocator.num_usable  # every page returned


def test_prefill_logits_match_hf(built):
    family, om = built
    for p in _prompts(om.eager_model.config.vocab_size)[:3]:
        ours = om.prefill_logits(p)
        with torch.no_grad():
            ref = om.eager_model(torch.tensor([p])).logits[0].float()
        assert (ours - ref).abs().max().item() < 1e-4, family


def test_report_records_every_layer(built):
    family, om = built
    rep = om.report()
    n_layers = om.eager_model.config.num_hidden_layers
    assert len(rep["layers"]) == n_layers
    for lay in rep["layers"]:
        assert lay["backend"] == "torch" and lay["reason"] and lay["dims"]["num_heads"] > 0
    assert [p["name"] for p in rep["passes"]] == ["export", "match_mla", "shard", "load_weights", "fuse_gemms",
                                                  "fuse_moe", "fuse_routing", "real_rope", "resolve_fp8_linear", "insert_cached_mla_attention", "gather_logits",
                                                  "piecewise"]
