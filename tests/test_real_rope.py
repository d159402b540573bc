"""The `real_rope` pass: complex-number rotary embeddings (DeepSeek-V2's) as real arithmetic.

DeepSeek-V2 (tiny config, fp32 CPU) with the pass forced on (`when: always`): both rotary products
of every layer rewritten, no complex multiply of a rotated tensor left in the graph (the model's one
`freqs_cis * scaling` per step stays), greedy tokens identical to HF eager
and prefill logits within 1e-5 of the same model without the pass. `auto` keeps the graph where the
static pieces are not Inductor-compiled (CPU), saying why; families that rotate with real
arithmetic have nothing to rewrite. A GPU test runs V2 through Inductor and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.testing import hf_greedy_generate

RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
COMPLEX_OPS = (torch.ops.aten.view_as_complex.default, torch.ops.aten.view_as_real.default)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 11, 3)]


def _complex_muls(om) -> int:
    """Complex products of a rotated tensor (not the model's one `freqs_cis * scaling` per step)."""
    return sum(1 for n in om.gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.mul.Tensor
               and any(getattr(a, "target", None) == torch.ops.aten.view_as_complex.default for a in n.args))


def test_always_rewrites_v2_and_matches_hf(optimized_family):
    om = optimize("deepseek_v2", overrides=[*RUNTIME, "transforms.real_rope.when=always"])
    rec = next(r for r in om.history if r.name == "real_rope")
    layers = om.eager_model.config.num_hidden_layers
    assert len(rec.details["rewritten"]) == 2 * layers, rec.details  # q_pe and k_pe of every layer
    assert rec.details["factors"] >= 1
    assert _complex_muls(om) == 0
    assert not any(n.target == torch.ops.aten.view_as_complex.default for n in om.gm.graph.nodes)
    prompts = _prompts(om.eager_model.config.vocab_size)
    assert om.generate(prompts, max_new_tokens=6) == [hf_greedy_generate(om.eager_model, p, 6) for p in prompts]
    base = optimized_family("deepseek_v2", RUNTIME)  # the default (auto): kept on CPU
    assert _complex_muls(base) == 2 * layers
    for p in prompts:
        torch.testing.assert_close(om.prefill_logits(p), base.prefill_logits(p), rtol=0, atol=1e-5)


def test_auto_keeps_complex_products_without_inductor(optimized_family):
    om = optimized_family("deepseek_v2", RUNTIME)
    rec = next(r for r in om.history if r.name == "real_rope")
    assert "kept" in rec.summary and "not on CUDA" in rec.details["reason"], rec.summary


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_4_7_flash"])
def test_real_rotary_families_have_nothing_to_rewrite(optimized_family, family):
    om = optimized_family(family, RUNTIME)
    rec = next(r for r in om.history if r.name == "real_rope")
    assert rec.summary == "no complex rotary products"
    assert not any(n.op == "call_function" and n.target in COMPLEX_OPS for n in om.gm.graph.nodes)


@pytest.mark.gpu
def test_gpu_v2_rewritten_under_inductor_matches_hf_bf16():
    om = optimize("deepseek_v2", overrides=["model.device=cuda", "model.dtype=bfloat16", "runtime.max_batch_size=4",
                                            "runtime.max_seq_len=64", "runtime.max_num_tokens=32"])
    rec = next(r for r in om.history if r.name == "real_rope")
    assert len(rec.details["rewritten"]) == 2 * om.eager_model.config.num_hidden_layers, rec.summary
    prompts = _prompts(om.eager_model.config.vocab_size)
    for p in prompts:
        with torch.no_grad():
            ref = om.eager_model(torch.tensor([p], device="cuda")).logits[0].float()
        assert (om.prefill_logits(p).float() - ref).abs().max() / ref.abs().max() < 5e-2
    outs = om.generate(prompts, max_new_tokens=8)  # decode through the captured graphs
    assert all(len(o) == 8 for o in outs)
