"""Block-FP8 kernels on the CPU (Triton's interpreter) against the fp32 emulation, the backend
descriptors' checks on emulated targets, and the `resolve_fp8_linear` pass on a tiny exported graph.

The GPU tests of the same kernels at the real model shapes are in tests/test_fp8_kernels_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autodeploy_mla.custom_ops.attention.registry import DeviceInfo, Target
from autodeploy_mla.custom_ops.fp8 import backends as B
from autodeploy_mla.custom_ops.fp8.act_quant import FP8_MAX, act_quant, act_quant_reference
from autodeploy_mla.custom_ops.fp8.emulation import dequantize_blocks, w8a8_block_linear_emulated
from autodeploy_mla.custom_ops.fp8.gemm_triton import GemmConfig, gemm_config, triton_block_linear
from autodeploy_mla.testing.fp8_kernels import quantize_blocks

FP8 = torch.float8_e4m3fn
CPU = Target(DeviceInfo("cpu"), {"torch": torch.__version__, "triton": "3.6.0", "flashinfer": None}, 64)


def sm(cap, flashinfer="0.7.2"):
    return Target(DeviceInfo("cuda", cap, "emulated", 132), {"torch": "2.11.0", "triton": "3.6.0",
                                                            "flashinfer": flashinfer}, 64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------- activation quantization
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_act_quant_kernel_equals_the_reference_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(7, 300) * 3).to(dtype)
    x[1, :128] = 0  # an all-zero group: zeros, not NaN
    x[2, 5] = 1000.0  # one large value: the rest of its group lands in e4m3's small range
    x[3] *= 1e-3
    x[4, 7], x[4, 8] = -1e-6, 1e-6  # round to zero: -0 (0x80) and +0, as torch's cast (the H200 once gave +0 for both)
    q, s = act_quant_reference(x, 128)
    qk, sk = act_quant(x, 128)
    assert torch.equal(bits(q), bits(qk)) and torch.equal(s, sk)
    assert bits(qk)[4, 7] == 0x80 and bits(qk)[4, 8] == 0
    assert not s.isnan().any() and (bits(q[1, :128]) == 0).all()
    qt, st = act_quant(x, 128, "t")  # the token-major scale layout cuBLAS wants, written directly
    assert st.shape == (7, 3) and st.stride() == (1, 7) and torch.equal(st, s) and torch.equal(bits(qt), bits(q))


def test_act_quant_rounds_every_e4m3_midpoint_to_nearest_even():
    """Scale 1 (the group's amax is 448): every code, every midpoint between codes, and values just
    off them must round as torch's cast does (the interpreter's own cast does not carry into the exponent)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    v = torch.cat([codes, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), torch.tensor([FP8_MAX])]).clamp(-FP8_MAX, FP8_MAX)
    x = torch.nn.functional.pad(v, (0, 1024 - v.numel())).view(1, 1024)
    q, s = act_quant_reference(x, 1024)
    assert s.item() == 1.0
    qk, _ = act_quant(x, 1024)
    assert torch.equal(bits(qk), bits(q))


def test_act_quant_refuses_groups_the_kernel_cannot_tile():
    with pytest.raises(ValueError, match="power of two"):
        act_quant(torch.randn(2, 96), 96)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        act_quant(torch.randn(2, 3, 128), 128)


# ----------------------------------------------------------------------------- emulation and the GEMM
def test_emulation_is_the_fp32_product_of_the_dequantized_operands():
    torch.manual_seed(1)
    w, s = quantize_blocks(torch.randn(70, 200) * 0.05, 32, 64)
    x = torch.randn(2, 3, 200)
    y = w8a8_block_linear_emulated(x, w, s, None, 32, 64)
    exact = x @ dequantize_blocks(w, s, 32, 64).t()
    assert y.shape == (2, 3, 70)
    assert (y - exact).abs().max() < 0.05 * exact.abs().max()  # only the activations' quantization differs


@pytest.mark.parametrize("m,n,k,bn,bk,cfg", [
    (5, 80, 96, 32, 32, None),  # partial N block
    (3, 70, 100, 16, 32, GemmConfig(16, 32, 16, split_k=3, group_m=4, num_warps=1, num_stages=1)),  # partial K, split-K
    (33, 64, 128, 64, 64, GemmConfig(16, 16, 32, split_k=2, group_m=2, num_warps=1, num_stages=1)),  # grouped order
    (1, 48, 256, 128, 128, GemmConfig(16, 16, 64, split_k=4, group_m=1, num_warps=1, num_stages=1)),  # one token
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gemm_matches_the_emulation(m, n, k, bn, bk, cfg, dtype):
    torch.manual_seed(2)
    w, s = quantize_blocks(torch.randn(n, k) * 0.05, bn, bk)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = triton_block_linear(x, w, s, bias, bn, bk, cfg)
    ref = w8a8_block_linear_emulated(x, w, s, bias, bn, bk, torch.float32)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


def test_triton_gemm_takes_leading_dims_and_no_tokens():
    w, s = quantize_blocks(torch.randn(32, 64), 32, 32)
    x = torch.randn(2, 3, 64)
    y = triton_block_linear(x, w, s, None, 32, 32)
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y, w8a8_block_linear_emulated(x, w, s, None, 32, 32), atol=1e-5)
    assert triton_block_linear(torch.randn(0, 64), w, s, None, 32, 32).shape == (0, 32)


def test_gemm_configs_cover_decode_with_split_k_and_prefill_with_large_tiles():
    dec = gemm_config(1, 1536, 7168, 128, compiled=True, num_sms=132)
    assert dec.block_m == 16 and dec.split_k > 1
    k_tiles = 7168 // dec.block_k
    per = -(-k_tiles // dec.split_k)
    assert (dec.split_k - 1) * per < k_tiles  # no empty split
    pre = gemm_config(8192, 7168, 16384, 128, compiled=True, num_sms=132)
    assert (pre.block_m, pre.block_n, pre.split_k) == (128, 128, 1)
    assert gemm_config(4, 64, 256, 32, compiled=False).block_k == 32


# ----------------------------------------------------------------------------- ops
def _opcheck_args(dtype=torch.float32):
    w, s = quantize_blocks(torch.randn(48, 64) * 0.1, 16, 32)
    return (torch.randn(3, 64).to(dtype), w, s, torch.randn(48).to(dtype), 16, 32)


#: opcheck's schema test compares inputs before and after the call with a multiply that has no CPU fp8
#: kernel; mutation is checked here directly instead (no input changes)
OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("op", ["fp8_block_linear", "fp8_block_linear_torch", "fp8_block_linear_triton"])
def test_opcheck(op):
    args = _opcheck_args()
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(getattr(torch.ops.autodeploy, op), args, test_utils=OPCHECK_UTILS)
    getattr(torch.ops.autodeploy, op)(*args)
    assert all(torch.equal(bits(a) if a.dtype == FP8 else a, bits(b) if b.dtype == FP8 else b)
               for a, b in zip(args, before) if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("op", ["fp8_block_linear_scaled_mm", "fp8_block_linear_flashinfer"])
def test_library_ops_have_fakes_and_refuse_other_blocks(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    w, s = quantize_blocks(torch.randn(256, 256), 128, 128)
    with FakeTensorMode() as mode:
        out = getattr(torch.ops.autodeploy, op)(mode.from_tensor(torch.randn(2, 5, 256, dtype=torch.bfloat16)),
                                                mode.from_tensor(w), mode.from_tensor(s), None, 128, 128)
    assert out.shape == (2, 5, 256) and out.dtype == torch.bfloat16
    w, s = quantize_blocks(torch.randn(64, 64), 32, 32)
    with pytest.raises(ValueError, match=r"block size \(128, 128\) only"):
        getattr(torch.ops.autodeploy, op)(torch.randn(2, 64, dtype=torch.bfloat16), w, s, None, 32, 32)


def test_source_op_fake_names_a_misshapen_scale():
    w, _ = quantize_blocks(torch.randn(64, 64), 32, 32)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 3\), expected \(2, 2\)"):
        torch.ops.autodeploy.fp8_block_linear(torch.randn(2, 64), w, torch.ones(2, 3), None, 32, 32)


# ----------------------------------------------------------------------------- descriptors and resolution
V3 = B.FP8LinearNode(2112, 7168, 128, 128, torch.bfloat16)


def test_checks_on_emulated_targets(monkeypatch):
    monkeypatch.setattr(B, "scaled_mm_api_missing", lambda: None)  # as the H200's torch 2.11 + CUDA 13
    assert B.SCALED_MM.check(V3, sm((9, 0))).ok
    assert "SM 9.x only" in B.SCALED_MM.check(V3, sm((10, 0))).reason
    assert "(128, 128) only" in B.SCALED_MM.check(B.FP8LinearNode(2112, 7168, 64, 128, torch.bfloat16), sm((9, 0))).reason
    assert "multiple of 128" in B.SCALED_MM.check(B.FP8LinearNode(2112, 7100, 128, 128, torch.bfloat16), sm((9, 0))).reason
    assert B.FLASHINFER.check(V3, sm((9, 0))).ok
    assert "0.7.0" in B.FLASHINFER.check(V3, sm((9, 0), "0.6.18.post1")).reason
    assert "not installed" in B.FLASHINFER.check(V3, sm((9, 0), None)).reason
    assert "bf16" in B.FLASHINFER.check(B.FP8LinearNode(2112, 7168, 128, 128, torch.float32), sm((9, 0))).reason
    assert "N % 64" in B.FLASHINFER.check(B.FP8LinearNode(2100, 7168, 128, 128, torch.bfloat16), sm((9, 0))).reason
    assert B.TRITON.check(V3, sm((9, 0))).ok and B.TRITON.check(V3, sm((8, 9))).ok
    assert "SM89+" in B.TRITON.check(V3, sm((8, 0))).reason
    assert "power of two" in B.TRITON.check(B.FP8LinearNode(64, 64, 96, 96, torch.bfloat16), sm((9, 0))).reason
    assert B.TORCH.check(V3, CPU).ok


def test_the_installed_cpu_torch_is_refused_for_cublas_with_the_reason():
    res = B.SCALED_MM.check(V3, sm((9, 0)))
    assert not res.ok and ("without CUDA" in res.reason or "scaled_mm" in res.reason)


def test_resolution_keeps_every_rejection_and_refuses_explicit_backends_that_cannot_serve():
    order = ["scaled_mm", "flashinfer", "triton", "torch"]
    d = B.resolve_fp8_linear_backend("model.layers.0.mlp", V3, sm((10, 0)), "auto", order)
    assert d.backend == "triton" and [r[0] for r in d.rejected] == ["scaled_mm", "flashinfer"]
    with pytest.raises(B.FP8LinearResolutionError, match=r"model.layers.0.mlp: fp8_linear backend 'scaled_mm' cannot"
                                                          r" serve .*allow_fallback"):
        B.resolve_fp8_linear_backend("model.layers.0.mlp", V3, sm((10, 0)), "scaled_mm", order)
    d = B.resolve_fp8_linear_backend("l", V3, sm((10, 0)), "flashinfer", order, allow_fallback=True)
    assert d.backend == "triton" and d.reason.startswith("fallback") and d.rejected[0][0] == "flashinfer"
    with pytest.raises(B.FP8LinearResolutionError, match="no FP8 linear backend can serve"):
        B.resolve_fp8_linear_backend("l", V3, sm((10, 0)), "auto", ["scaled_mm"])


# ----------------------------------------------------------------------------- the pass on a tiny graph
class TinyFP8(torch.nn.Module):
    """Two FP8 linears (one with a bias) and a 16-bit one, as the FP8 model substitution leaves them."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Module()
        self.down = torch.nn.Module()
        for mod, (n, k) in ((self.up, (96, 64)), (self.down, (64, 96))):
            w, s = quantize_blocks(torch.randn(n, k) * 0.1, 32, 32)
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
            mod.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        self.down.bias = torch.nn.Parameter(torch.randn(64), requires_grad=False)
        self.head = torch.nn.Linear(64, 16)

    def forward(self, x):
        h = torch.ops.autodeploy.fp8_block_linear(x, self.up.weight, self.up.weight_scale_inv, None, 32, 32)
        h = torch.nn.functional.silu(h)
        h = torch.ops.autodeploy.fp8_block_linear(h, self.down.weight, self.down.weight_scale_inv, self.down.bias, 32, 32)
        return self.head(h)


@pytest.fixture(scope="module")
def tiny_export():
    torch.manual_seed(3)
    model = TinyFP8()
    x = torch.randn(1, 5, 64)
    ep = torch.export.export(model, (x,), dynamic_shapes=({1: torch.export.Dim("t", min=1, max=64)},))
    return model, ep, x


def _run_pass(tiny_export, target=CPU, **opts):
    from autodeploy_mla.transforms.resolve_fp8_linear import ResolveFP8LinearOptions, resolve_fp8_linear

    model, ep, x = tiny_export
    gm = ep.module()
    ctx = SimpleNamespace(gm=gm, target=target)
    res = resolve_fp8_linear(ctx, ResolveFP8LinearOptions(**opts))
    gm.recompile()
    return gm, res, model(x), x


def test_pass_resolves_each_node_on_cpu_to_the_reference_and_records_why(tiny_export):
    gm, res, ref, x = _run_pass(tiny_export)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "fp8_block_linear" in str(n.target)]
    assert ops == [torch.ops.autodeploy.fp8_block_linear_torch.default] * 2
    assert res.summary == "2 FP8 linears: 2 torch"
    layers = res.details["layers"]
    assert [(e["layer"], e["n"], e["k"]) for e in layers] == [("up", 96, 64), ("down", 64, 96)]
    assert all("torch reference" in e["reason"] for e in layers)
    assert torch.allclose(gm(x), ref, atol=1e-5)


def test_pass_runs_triton_per_node_under_the_interpreter(tiny_export):
    gm, res, ref, x = _run_pass(tiny_export, layers={"do*": "triton"})
    assert [e["backend"] for e in res.details["layers"]] == ["torch", "triton"]
    node = [n for n in gm.graph.nodes if n.target == torch.ops.autodeploy.fp8_block_linear_triton.default][0]
    assert node.meta["fp8_linear"].backend == "triton"
    assert (gm(x) - ref).abs().max() < 0.05 * ref.abs().max()  # W8A8: activations quantized


def test_pass_errors_name_the_node_and_the_choices(tiny_export):
    from autodeploy_mla.config.loader import ConfigError
    from autodeploy_mla.transforms.pass_manager import parse_pipeline

    with pytest.raises(B.FP8LinearResolutionError, match="scaled_mm' cannot serve"):
        _run_pass(tiny_export, backend="scaled_mm")
    with pytest.raises(ValueError, match="'mlp.\\*' match no FP8 linear"):
        _run_pass(tiny_export, layers={"mlp.*": "torch"})
    with pytest.raises(ConfigError, match="resolve_fp8_linear.backend"):
        parse_pipeline({"resolve_fp8_linear": {"backend": "cutlass"}})
    with pytest.raises(ConfigError, match="unknown FP8 linear backend 'cutlass' in preference.sm90"):
        parse_pipeline({"resolve_fp8_linear": {"preference": {"sm90": ["cutlass"]}}})
