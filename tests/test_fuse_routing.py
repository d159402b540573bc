"""The MoE routing ops and the `fuse_routing` pass.

CPU (CI): the reference op against every router class of transformers' MLA families (their own
forward on random weights), the Triton kernel in Triton's interpreter against the reference, the
pass on exported routers (each class, DeepSeek-V2 greedy and group-limited, GLM-5's) with the
rewritten graph's outputs equal to the module's, refusals and the self-check. Whole models: every
CPU family test runs through the reference op (auto picks it off CUDA), tokens equal to HF eager.
GPU: the kernel on real router shapes in bf16/fp32, and a model through CUDA graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig

from autodeploy_mla.custom_ops.moe.routing import RoutingSpec, route_reference, triton_route
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS
from autodeploy_mla.transforms.fuse_routing import (RouterMatch, _NoMatch, rewrite, router_paths, router_regions,
                                                     self_check)
from autodeploy_mla.transforms.fx_utils import module_stack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _router_class(model_type: str):
    import importlib

    mods = {"deepseek_v2": ("deepseek_v2", "DeepseekV2TopkRouter"), "deepseek_v3": ("deepseek_v3", "DeepseekV3TopkRouter"),
            "deepseek_v32": ("deepseek_v32", "DeepseekV32TopkRouter"),
            "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteTopkRouter"),
            "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaTopkRouter"), "mistral4": ("mistral4", "Mistral4TopkRouter")}
    pkg, cls = mods[model_type]
    return getattr(importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}"), cls)


#: (name, tiny family, config overrides): every router class, V2's two methods, several group layouts
ROUTERS = [
    ("v2_greedy", "deepseek_v2", {"topk_method": "greedy"}),
    ("v2_group_limited", "deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                         "num_experts_per_tok": 3, "routed_scaling_factor": 1.5}),
    ("v3", "deepseek_v3", {}),
    ("v3_groups_8_of_4", "deepseek_v3", {"n_routed_experts": 32, "n_group": 8, "topk_group": 4,
                                         "num_experts_per_tok": 5, "norm_topk_prob": False}),
    ("v32", "deepseek_v32", {}),
    ("glm_4_7_flash", "glm_4_7_flash", {"n_routed_experts": 20, "num_experts_per_tok": 4}),
    ("glm_5", "glm_5", {}),
    ("mistral4", "mistral_small_4", {"n_group": 2, "topk_group": 1}),
]


class _Block(torch.nn.Module):
    """A router as its MoE block calls it: only the weights and ids leave it."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.gate = router

    def forward(self, x):
        _, w, ids = self.gate(x)
        return w * 1.0, ids + 0


def _router(name: str, seed: int = 0) -> torch.nn.Module:
    _, family, over = next(r for r in ROUTERS if r[0] == name)
    cfg = AutoConfig.for_model(**{**copy.deepcopy(TINY_CONFIGS[family]), **over})
    router = _router_class(cfg.model_type)(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(router.weight.shape[0], generator=g) * 0.3)
    return router


def _sorted(w, ids):
    o = ids.argsort(-1)
    return w.gather(1, o), ids.gather(1, o)


def _exported(name: str, backend: str = "torch", gate: bool = False):
    """(block, its exported graph with the router replaced, the match); `gate`: the gate GEMM folded in."""
    from autodeploy_mla.transforms.export import _strip_wrapper_from_module_paths

    block = _Block(_router(name)).eval()
    hidden = block.gate.weight.shape[1]
    ep = torch.export.export(block, (torch.randn(5, hidden),), dynamic_shapes=({0: torch.export.Dim("t", min=1)},))
    gm = ep.module()
    _strip_wrapper_from_module_paths(gm)
    paths = router_paths(gm)
    assert paths == ["gate"], paths
    m = RouterMatch(router_regions(gm)["gate"], "gate", block.gate)
    self_check(block.gate, m.spec, m.bias is not None, m.num_experts)
    rewrite(gm, m, backend, m.gate_operands() if gate else None)
    gm.graph.lint()
    gm.recompile()
    return block, gm, m


@pytest.mark.parametrize("gate", [False, True], ids=["routing", "gate_in_op"])
@pytest.mark.parametrize("name", [r[0] for r in ROUTERS])
def test_replaced_router_equals_the_module(name, gate):
    block, gm, m = _exported(name, gate=gate)
    left = [n.target for n in gm.graph.nodes if "topk" in str(n.target) or "masked_fill" in str(n.target)
            or "scatter" in str(n.target) or (gate and "linear" in str(n.target))]
    assert left == [], left  # the whole soup is gone: one op instead
    assert sum("moe_route" in str(n.target) or "moe_gate_route" in str(n.target) for n in gm.graph.nodes) == 1
    hidden = block.gate.weight.shape[1]
    for t in (1, 4, 17):  # fresh tokens, other lengths than the export's
        x = torch.randn(t, hidden)
        w_ref, ids_ref = block(x)
        w, ids = gm(x)
        assert ids.dtype == torch.int64 and w.dtype == w_ref.dtype
        assert torch.equal(ids, ids_ref), name  # same calls: same order, bitwise
        assert torch.equal(w, w_ref), name


def test_gate_gemm_in_the_model_dtype_is_not_folded():
    """Mistral-Small-4's router multiplies in the model dtype: in a bf16 model that is not the fp32
    GEMM the folded op computes, so the pass keeps the model's GEMM (and says why)."""
    from autodeploy_mla.transforms.export import _strip_wrapper_from_module_paths

    block = _Block(_router("mistral4")).to(torch.bfloat16)
    gm = torch.export.export(block, (torch.randn(5, block.gate.weight.shape[1], dtype=torch.bfloat16),)).module()
    _strip_wrapper_from_module_paths(gm)
    m = RouterMatch(router_regions(gm)["gate"], "gate", block.gate)
    with pytest.raises(_NoMatch, match="computes in torch.bfloat16, not fp32"):
        m.gate_operands()


def test_specs_read_from_graph_and_module():
    specs = {name: _exported(name)[2].spec for name in ("v2_greedy", "v2_group_limited", "v3", "mistral4")}
    assert specs["v2_greedy"] == RoutingSpec(2, 1, 1, "softmax", "top2sum", 0.0, "choice", False, 1.0)
    assert specs["v2_group_limited"] == RoutingSpec(3, 4, 2, "softmax", "max", 0.0, "choice", False, 1.5)
    v3 = specs["v3"]
    assert (v3.score, v3.fill, v3.weights_from, v3.renormalize, v3.n_group, v3.topk_group) == (
        "sigmoid", float("-inf"), "scores", True, 2, 1)
    assert (specs["mistral4"].score, specs["mistral4"].fill, specs["mistral4"].group_score) == ("softmax", 0.0, "top2sum")


SPECS = [
    (8, RoutingSpec(2), False),
    (16, RoutingSpec(3, 4, 2, "softmax", "max", 0.0, "choice", False, 1.5), False),
    (8, RoutingSpec(2, 2, 1, "sigmoid", "top2sum", float("-inf"), "scores", True, 2.5), True),
    (64, RoutingSpec(4, 1, 1, "sigmoid", "top2sum", float("-inf"), "scores", True, 1.8), True),
    (256, RoutingSpec(8, 8, 4, "sigmoid", "top2sum", float("-inf"), "scores", True, 2.5), True),
    (20, RoutingSpec(5, 4, 3, "softmax", "top2sum", 0.0, "scores", True, 1.0), False),
]


@pytest.mark.parametrize("case", range(len(SPECS)))
def test_triton_kernel_equals_the_reference(case):
    e, spec, has_bias = SPECS[case]
    g = torch.Generator().manual_seed(case)
    for t in (1, 3, 37):
        logits = torch.randn(t, e, generator=g)
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        w0, i0 = _sorted(*route_reference(logits, bias, spec))
        w1, i1 = _sorted(*torch.ops.autodeploy.triton_moe_route(logits, bias, *spec.args()))
        assert torch.equal(i0, i1), (spec, t)
        torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_t", [2, 16])
def test_triton_kernel_row_blocks_equal_the_reference(block_t):
    """Several rows per program (the prefill layout), with a partial last block."""
    g = torch.Generator().manual_seed(block_t)
    for e, spec, has_bias in (SPECS[1], SPECS[2]):
        logits = torch.randn(21, e, generator=g)
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        w0, i0 = _sorted(*route_reference(logits, bias, spec))
        w1, i1 = _sorted(*triton_route(logits, bias, spec, block_t=block_t))
        assert torch.equal(i0, i1)
        torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [0, 2, 4, 5])
def test_gate_route_equals_the_reference(case):
    """The gate GEMM in the op, then the routing kernel: on CPU the GEMM is the routers' fp32 linear
    itself (the tensor-core path is for bf16 / fp16 operands on CUDA), so ids are equal."""
    from autodeploy_mla.custom_ops.moe.routing import gate_logits, gate_logits_tensor_cores, triton_gate_route

    e, spec, has_bias = SPECS[case]
    g = torch.Generator().manual_seed(100 + case)
    for t, h in ((1, 40), (9, 33)):
        x, gw = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g)
        assert torch.equal(gate_logits_tensor_cores(x, gw), gate_logits(x, gw))
        assert torch.equal(gate_logits_tensor_cores(x.bfloat16(), gw.bfloat16()),
                           gate_logits(x.bfloat16(), gw.bfloat16()))  # CPU: the fp32 linear
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        w0, i0 = _sorted(*route_reference(gate_logits(x, gw), bias, spec))
        w1, i1 = _sorted(*triton_gate_route(x, gw, bias, spec))
        assert torch.equal(i0, i1), (spec, t)
        torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)


_COMPILE_CHECK = """
from autodeploy_mla.custom_ops.moe import route_kernel as RK
from autodeploy_mla.custom_ops.moe.routing import RoutingSpec, kernel_constants
assert isinstance(RK.route_kernel, triton.runtime.jit.JITFunction)
# one small compile with the launcher's own constants: grouped bf16 routing in row blocks (the path, not the size)
consts = kernel_constants(RoutingSpec(4, 4, 2, "sigmoid", "top2sum", float("-inf"), "scores", True, 2.5), 32, True)
sig = {"LOGITS": "*bf16", "BIAS": "*fp32", "W": "*bf16", "IDS": "*i64", "T": "i32", "stride_t": "i32",
       "scale": "fp32", **{k: "constexpr" for k in consts}, "BLOCK_T": "constexpr"}
compile_sm90(RK.route_kernel, sig, {**consts, "BLOCK_T": 2})
print("compiled")
"""


def test_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The interpreter runs Python, not Triton's compiler: compile the kernel to SM90 cubins (front end
    through ptxas; no GPU needed), so a construction only the compiler rejects fails on CPU too."""
    from autodeploy_mla.testing.sm90_compile import run_sm90_compile_check, sm90_backend_missing

    if why := sm90_backend_missing():
        pytest.skip(why)
    out = run_sm90_compile_check(_COMPILE_CHECK, tmp_path)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


def test_kernel_never_picks_an_expert_twice_when_the_choice_runs_out():
    """-inf fill with more experts wanted than the kept groups hold: the rest come from masked experts
    (as torch.topk does), never a repeat."""
    spec = RoutingSpec(6, 4, 1, "sigmoid", "top2sum", float("-inf"), "scores", True, 1.0)
    logits = torch.randn(5, 16)
    _, ids = triton_route(logits, None, spec)
    assert all(len(set(r)) == 6 for r in ids.tolist())


def test_ops_pass_opcheck():
    spec = RoutingSpec(2, 2, 1, "sigmoid", "top2sum", float("-inf"), "scores", True, 2.5)
    args = (torch.randn(6, 8), torch.randn(8), *spec.args())
    torch.library.opcheck(torch.ops.autodeploy.torch_moe_route.default, args)
    torch.library.opcheck(torch.ops.autodeploy.triton_moe_route.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    gate_args = (torch.randn(6, 16), torch.randn(8, 16), torch.randn(8), *spec.args())
    torch.library.opcheck(torch.ops.autodeploy.torch_moe_gate_route.default, gate_args)
    torch.library.opcheck(torch.ops.autodeploy.triton_moe_gate_route.default, gate_args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.randn(2, 3, 4)), "logits must be \\[T, E\\]"),
    (dict(bias=torch.randn(5)), "bias must be \\[E=8\\]"),
    (dict(n_group=3), "n_group=3 must be >= 1 and divide the 8 experts"),
    (dict(topk_group=3), "topk_group=3 must be in \\[1, n_group=2\\]"),
    (dict(top_k=9), "top_k=9 must be in \\[1, E=8\\]"),
    (dict(score="relu"), "score 'relu' unsupported"),
])
def test_bad_inputs_name_the_value(bad, match):
    kw = dict(logits=torch.randn(3, 8), bias=None, top_k=2, n_group=2, topk_group=1, score="sigmoid",
              group_score="top2sum", fill=float("-inf"), weights_from="scores", renormalize=True, scale=1.0)
    kw.update(bad)
    for op in (torch.ops.autodeploy.torch_moe_route, torch.ops.autodeploy.triton_moe_route):
        with pytest.raises(ValueError, match=match):
            op(**kw)


def test_self_check_refuses_a_router_that_computes_something_else():
    router = _router("v3")

    class Odd(type(router)):
        def forward(self, hidden_states):  # the same ops, but the weights are not scaled
            logits, w, ids = super().forward(hidden_states)
            return logits, w / self.routed_scaling_factor, ids

    odd = copy.copy(router)
    odd.__class__ = Odd
    spec = RoutingSpec(2, 2, 1, "sigmoid", "top2sum", float("-inf"), "scores", True, router.routed_scaling_factor)
    self_check(router, spec, True, 8)  # the real one passes
    with pytest.raises(_NoMatch, match="weights differ"):
        self_check(odd, spec, True, 8)
    with pytest.raises(_NoMatch, match="other experts"):
        self_check(router, RoutingSpec(2, 2, 1, "softmax", "top2sum", float("-inf"), "scores", True, 2.5), True, 8)


def test_auto_on_cpu_uses_the_reference_and_reports_each_router(optimized_family):
    from tests.test_fuse_moe import RUNTIME

    om = optimized_family("glm_4_7_flash", RUNTIME)
    rec = {r.name: r for r in om.history}["fuse_routing"]
    assert rec.details["layers"] and all(e["backend"] == "torch" for e in rec.details["layers"]), rec.details
    assert "torch reference" in rec.details["layers"][0]["reason"]
    assert not [n for n in om.gm.graph.nodes if "topk" in str(n.target)]


@pytest.mark.parametrize("gate_gemm", [True, False])
def test_gate_gemm_option_takes_the_gate_in_and_keeps_hf_tokens(gate_gemm):
    from autodeploy_mla import optimize
    from autodeploy_mla.testing import hf_greedy_generate
    from tests.test_fuse_moe import RUNTIME

    om = optimize("deepseek_v3", overrides=[*RUNTIME, f"transforms.fuse_routing.gate_gemm={str(gate_gemm).lower()}"])
    layers = {r.name: r for r in om.history}["fuse_routing"].details["layers"]
    assert layers, layers
    if gate_gemm:  # the default; on CPU the reference op runs the routers' own fp32 GEMM
        assert all(e["gate"] == "in the op: the fp32 GEMM" for e in layers), layers
        assert any("moe_gate_route" in str(n.target) for n in om.gm.graph.nodes)
        routers = {e["layer"] for e in layers}
        assert not [n for n in om.gm.graph.nodes if n.target is torch.ops.aten.linear.default
                    and any(p in routers for p, _ in module_stack(n))]
    else:
        assert all("gate" not in e for e in layers) and not any("moe_gate_route" in str(n.target)
                                                                 for n in om.gm.graph.nodes)
    prompts = [[5, 9, 20, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11]]  # the second is chunked (8 tokens a step)
    assert om.generate(prompts, max_new_tokens=4) == [hf_greedy_generate(om.eager_model, p, 4) for p in prompts]


def test_backend_choice_and_refusal(monkeypatch):
    from autodeploy_mla.custom_ops.attention.registry import DeviceInfo
    from autodeploy_mla.custom_ops.moe.backends import resolve_moe_backend

    def _backend_for(dev, requested, num_experts):
        return resolve_moe_backend("routing", requested, dev, num_experts=num_experts)

    cpu, gpu = DeviceInfo("cpu"), DeviceInfo("cuda", (9, 0), "H200", 132)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _backend_for(gpu, "auto", 64)[0] == "triton"
    assert _backend_for(gpu, "auto", 2048) == (None, "kept the model's routing: 2048 experts exceed the kernel's 1024")
    assert _backend_for(cpu, "auto", 64)[0] == "torch"
    with pytest.raises(ValueError, match="fuse_routing.backend=triton cannot run here: Triton kernels need a CUDA GPU"):
        _backend_for(cpu, "triton", 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # auto never picks an interpreted kernel; triton may
    assert _backend_for(gpu, "auto", 64)[0] == "torch"
    assert _backend_for(cpu, "triton", 64)[0] == "triton"


# ----------------------------------------------------------------------------- GPU
@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(SPECS)))
def test_gpu_kernel_equals_the_reference(case, dtype):
    e, spec, has_bias = SPECS[case]
    g = torch.Generator(device="cuda").manual_seed(case)
    for t in (1, 64, 2048):
        logits = torch.randn(t, e, generator=g, device="cuda").to(dtype)
        bias = torch.randn(e, generator=g, device="cuda") * 0.1 if has_bias else None
        w0, i0 = _sorted(*route_reference(logits, bias, spec))
        w1, i1 = _sorted(*triton_route(logits, bias, spec))
        same = (i0 == i1).all(-1)
        if dtype == torch.float32:
            assert bool(same.all()), (spec, t)
        else:  # bf16 scores tie often; group sums round differently: a differing row must be as good a pick
            assert same.float().mean() >= 0.95, (spec, t)
            scores = logits.float().softmax(-1) if spec.score == "softmax" else logits.float().sigmoid()
            choice = scores + bias if bias is not None else scores
            got, want = choice.gather(1, i1).sum(-1), choice.gather(1, i0).sum(-1)
            assert torch.allclose(got[~same], want[~same], rtol=5e-2, atol=1e-3), (spec, t)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(w1[same].float(), w0[same].float(), **tol)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [0, 3, 4])
def test_gpu_gate_route_equals_the_reference(case, dtype):
    """The gate GEMM on tensor cores: the logits are the fp32 GEMM's up to fp32 summation order (checked
    against an fp64 sum of the same operands, next to the fp32 GEMM's own error); ids equal except
    near-ties."""
    from autodeploy_mla.custom_ops.moe.routing import gate_logits, gate_logits_tensor_cores, triton_gate_route

    e, spec, has_bias = SPECS[case]
    g = torch.Generator(device="cuda").manual_seed(case)
    for t in (1, 64, 512, 2048):
        x = torch.randn(t, 2048, generator=g, device="cuda").to(dtype)
        gw = (torch.randn(e, 2048, generator=g, device="cuda") / 45).to(dtype)
        exact = x.double() @ gw.double().t()
        fp32_err = (gate_logits(x, gw).double() - exact).abs().max().item()
        tc = gate_logits_tensor_cores(x, gw)
        assert tc.dtype == torch.float32 and tc.shape == (t, e)
        tc_err = (tc.double() - exact).abs().max().item()
        assert tc_err <= max(4 * fp32_err, 1e-5 * exact.abs().max().item()), (t, tc_err, fp32_err)
        bias = torch.randn(e, generator=g, device="cuda") * 0.1 if has_bias else None
        w0, i0 = _sorted(*route_reference(gate_logits(x, gw), bias, spec))
        w1, i1 = _sorted(*triton_gate_route(x, gw, bias, spec))
        same = (i0 == i1).all(-1)
        assert same.float().mean() >= 0.99, (spec, t)
        torch.testing.assert_close(w1[same], w0[same], rtol=1e-4, atol=1e-5)


@cuda
@pytest.mark.gpu
def test_gpu_model_with_fused_routing_matches_the_model_routing():
    """GLM-4.7-Flash-shaped tiny model, bf16, CUDA graphs: the Triton routing vs the model's own ops."""
    from autodeploy_mla import optimize

    rt = ["runtime.max_num_tokens=64", "runtime.page_size=16", "runtime.max_seq_len=128", "runtime.max_batch_size=4",
          "model.device=cuda", "model.dtype=bfloat16"]
    fused = optimize("deepseek_v3", overrides=rt)
    rec = {r.name: r for r in fused.history}["fuse_routing"]
    assert all(e["backend"] == "triton" for e in rec.details["layers"]), rec.details
    plain = optimize("deepseek_v3", overrides=[*rt, "transforms.fuse_routing.enabled=false"])
    prompts = [[5, 9, 20, 17], [3, 3, 8, 1, 90, 2], [42]]
    a = fused.runner.prefill_logits(prompts[1]).float()
    b = plain.runner.prefill_logits(prompts[1]).float()
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()
    assert fused.generate(prompts, max_new_tokens=6) == plain.generate(prompts, max_new_tokens=6)
