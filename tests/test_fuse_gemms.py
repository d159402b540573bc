"""The `fuse_gemms` pass: linears on one input -> one GEMM, for every MLA family, and its refusals.

Every family: fp32 greedy tokens identical to HF eager and prefill logits within 1e-4 with the pass
on (the default), the fused groups named in the report, and no weight held twice (the HF model's
parameters become views of the fused weight). Refusals are shown on small exported modules where
each precondition fails, with the reason in the report and the graph left as it was.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autodeploy_mla import optimize
from autodeploy_mla.testing import hf_greedy_generate
from autodeploy_mla.transforms.fuse_gemms import fuse_gemms
from autodeploy_mla.transforms.registry import PassOptions

RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
FAMILIES = ["deepseek_v3", "deepseek_v2", "glm_4_7_flash", "mistral_small_4", "minicpm3"]
LINEAR = torch.ops.aten.linear.default


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, optimized_family):
    return request.param, optimized_family(request.param, RUNTIME)  # optimize(), shared (conftest)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 13, 2, 17)]


def test_families_fuse_and_match_hf(family):
    name, om = family
    rec = next(r for r in om.history if r.name == "fuse_gemms")
    groups = rec.details["groups"]
    fused = [g for g in groups if "fused_weight" in g]
    layers = om.eager_model.config.num_hidden_layers
    # every layer's attention input projections, and every gated MLP (dense or shared experts)
    attn = [g for g in fused if any(m.endswith("kv_a_proj_with_mqa") for m in g["members"])]
    mlp = [g for g in fused if {m.rsplit(".", 1)[1] for m in g["members"]} == {"gate_proj", "up_proj"}]
    assert len(attn) == layers and len(mlp) == layers, groups
    assert all(len(g["out_features"]) == 2 and g["reason"] for g in fused), groups
    prompts = _prompts(om.eager_model.config.vocab_size)
    assert om.generate(prompts, max_new_tokens=6) == [hf_greedy_generate(om.eager_model, p, 6) for p in prompts], name
    with torch.no_grad():
        ref = om.eager_model(torch.tensor([prompts[1]])).logits[0].float()
    assert (om.prefill_logits(prompts[1]) - ref).abs().max().item() < 1e-4, name


def test_members_share_the_fused_storage(family):
    _, om = family
    rec = next(r for r in om.history if r.name == "fuse_gemms")
    g = next(g for g in rec.details["groups"] if "fused_weight" in g)
    fused = om.gm.get_parameter(g["fused_weight"])
    assert fused.shape == (sum(g["out_features"]), g["in_features"])
    start = 0
    for member, out in zip(g["members"], g["out_features"]):
        w = om.eager_model.get_submodule(member).weight
        assert w.is_contiguous() and w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert torch.equal(w, fused[start:start + out])
        start += out
    weights = {n.target for n in om.gm.graph.nodes if n.op == "get_attr"}
    assert g["fused_weight"] in weights
    assert not any(t.endswith(m + ".weight") for m in g["members"] for t in weights)


def test_disabled_keeps_separate_linears():
    om = optimize("deepseek_v2", overrides=[*RUNTIME, "transforms.fuse_gemms.enabled=false"])
    assert not next(r for r in om.history if r.name == "fuse_gemms").enabled
    assert not any("fused_" in str(n.target) for n in om.gm.graph.nodes if n.op == "get_attr")


# ----------------------------------------------------------------------------- refusals
def _export(mod: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    with torch.no_grad():
        return torch.export.export(mod.eval(), (x,)).module()


def _run_pass(gm: torch.fx.GraphModule) -> dict:
    return fuse_gemms(SimpleNamespace(gm=gm), PassOptions()).details


class _Pair(nn.Module):
    def __init__(self, bias=(False, False)) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6, bias=bias[0])
        self.b = nn.Linear(8, 10, bias=bias[1])

    def forward(self, x):
        return self.a(x).sum(-1, keepdim=True) * self.b(x)


class _Tied(_Pair):
    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Linear(8, 6, bias=False)
        self.d.weight = self.a.weight  # tied to a

    def forward(self, x):
        return super().forward(x) + self.d(x).mean()


class _MergingView(_Pair):
    def forward(self, x):  # [B, T, 6] -> [B, T*6]: needs contiguous rows
        a = self.a(x)
        return a.view(x.shape[0], -1).sum(-1) + self.b(x).sum()


class _CastWeight(_Pair):
    def forward(self, x):
        return (torch.nn.functional.linear(x.float(), self.a.weight.float()).sum() + self.b(x)).sum()


def test_pair_fuses_with_bias_and_equals_eager():
    torch.manual_seed(0)
    mod = _Pair(bias=(True, True))
    x = torch.randn(2, 3, 8)
    ref = mod(x)
    gm = _export(mod, x)
    details = _run_pass(gm)
    assert [g["out_features"] for g in details["groups"]] == [[6, 10]], details
    gm.recompile()
    assert sum(1 for n in gm.graph.nodes if n.target is LINEAR) == 1
    torch.testing.assert_close(gm(x), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mod, why", [
    (_Pair(bias=(True, False)), "some members have a bias"),
    (_Tied(), "(tied)"),
    (_MergingView(), "cannot view the sliced output"),
])
def test_refused_groups_are_reported_and_left_alone(mod, why):
    x = torch.randn(2, 3, 8)
    gm = _export(mod, x)
    before = [str(n.target) for n in gm.graph.nodes]
    details = _run_pass(gm)
    refused = [g for g in details["groups"] if "fused_weight" not in g]
    assert refused and why in refused[0]["reason"], details
    assert [str(n.target) for n in gm.graph.nodes] == before


class _Three(_Tied):
    def forward(self, x):
        return self.a(x).sum() + self.b(x).sum() + self.e(x).sum() + self.d(x).mean()

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Linear(8, 4, bias=False)


def test_cast_weight_is_reported():
    x = torch.randn(2, 3, 8)
    gm = _export(_CastWeight(), x)
    (group,) = _run_pass(gm)["groups"]
    assert group["reason"].startswith("kept:") and "computed (aten.to.dtype)" in group["reason"], group


def test_a_tied_member_leaves_the_others_to_fuse():
    torch.manual_seed(1)
    mod = _Three()
    x = torch.randn(2, 3, 8)
    ref = mod(x)
    gm = _export(mod, x)
    (group,) = _run_pass(gm)["groups"]
    assert group["members"] == ["b", "e"] and len(group["excluded"]) == 2 and "tied" in group["excluded"][0], group
    gm.recompile()
    torch.testing.assert_close(gm(x), ref, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_gpu_fused_gemms_match_hf_bf16_through_cuda_graphs():
    om = optimize("glm_4_7_flash", overrides=["model.device=cuda", "model.dtype=bfloat16", "runtime.max_batch_size=4",
                                              "runtime.max_seq_len=64", "runtime.max_num_tokens=32"])
    rec = next(r for r in om.history if r.name == "fuse_gemms")
    assert sum("fused_weight" in g for g in rec.details["groups"]) == 2 * om.eager_model.config.num_hidden_layers
    prompts = _prompts(om.eager_model.config.vocab_size)
    for p in prompts[:3]:
        with torch.no_grad():
            ref = om.eager_model(torch.tensor([p], device="cuda")).logits[0].float()
        assert (om.prefill_logits(p).float() - ref).abs().max() / ref.abs().max() < 5e-2
    outs = om.generate(prompts, max_new_tokens=8)  # decode steps replay CUDA graphs with the fused GEMMs
    assert all(len(o) == 8 for o in outs)
