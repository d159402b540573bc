"""`cublas_triton`, the SM90 FP8 linear backend chosen from the H200 measurement: cuBLAS block-scaled
GEMM for prefill-sized calls, the Triton path for decode-sized ones, picked per call from x's shape.
CPU: the descriptor on emulated targets, the auto order, which half the op runs for which T (both
halves replaced by recorders: neither runs on a CPU), its fake, and the pass option."""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.custom_ops.attention.registry import DeviceInfo, Target
from autodeploy_mla.custom_ops.fp8 import backends as B
from autodeploy_mla.custom_ops.fp8 import linear_ops
from autodeploy_mla.testing.fp8_kernels import quantize_blocks
from autodeploy_mla.transforms.resolve_fp8_linear import DEFAULT_PREFERENCE, ResolveFP8LinearOptions

V3 = B.FP8LinearNode(2112, 7168, 128, 128, torch.bfloat16)


def sm(cap):
    return Target(DeviceInfo("cuda", cap, "emulated", 132), {"torch": "2.11.0", "triton": "3.6.0", "flashinfer": None}, 64)


@pytest.fixture
def cuda13_torch(monkeypatch):
    monkeypatch.setattr(B, "scaled_mm_api_missing", lambda: None)  # as the H200's torch 2.11 + CUDA 13


def test_auto_picks_it_first_on_sm90_with_the_measurement_as_reason(cuda13_torch):
    d = B.resolve_fp8_linear_backend("model.layers.0.self_attn.kv_a_proj_with_mqa", V3, sm((9, 0)), "auto",
                                     DEFAULT_PREFERENCE["sm90"])
    assert d.backend == "cublas_triton" and not d.rejected
    assert f"T >= {linear_ops.CUBLAS_MIN_TOKENS}" in d.reason and "fp8_weights_kernels.md" in d.reason
    assert "T <= 64" in d.reason and "unmeasured" not in d.reason
    # a node only one half can serve goes to the next in the order, with the half that refused named
    odd = B.FP8LinearNode(2112, 7100, 128, 128, torch.bfloat16)  # K not a multiple of 128: cuBLAS refuses
    d = B.resolve_fp8_linear_backend("l", odd, sm((9, 0)), "auto", DEFAULT_PREFERENCE["sm90"])
    assert d.backend == "triton" and d.rejected[0][0] == "cublas_triton"
    assert d.rejected[0][1].startswith("its cuBLAS half (scaled_mm) refuses: K=7100")
    assert B.resolve_fp8_linear_backend("l", V3, sm((10, 0)), "auto", DEFAULT_PREFERENCE["sm100"]).backend == "triton"


def test_the_installed_cpu_torch_refuses_it_with_the_reason():
    res = B.CUBLAS_TRITON.check(V3, sm((9, 0)))
    assert not res.ok and res.reason.startswith("its cuBLAS half (scaled_mm) refuses")


@pytest.mark.parametrize("shape,half", [((1, 256), "triton"), ((64, 256), "triton"), ((65, 256), "cublas"),
                                        ((256, 256), "cublas"), ((2, 40, 256), "cublas"), ((0, 256), "triton")])
def test_the_op_picks_its_half_from_the_token_count(shape, half, monkeypatch):
    calls = []

    def fake(name):
        def run(x, w, *rest):
            calls.append(name)
            return x.new_zeros(*x.shape[:-1], w.shape[0])
        return run

    monkeypatch.setattr(linear_ops, "scaled_mm_block_linear", fake("cublas"))
    monkeypatch.setattr(linear_ops, "triton_block_linear", fake("triton"))
    w, s = quantize_blocks(torch.randn(128, 256) * 0.05, 128, 128)
    y = torch.ops.autodeploy.fp8_block_linear_cublas_triton(torch.randn(*shape, dtype=torch.bfloat16), w, s, None, 128, 128)
    assert calls == [half] and y.shape == (*shape[:-1], 128)


def test_fake_and_block_refusal():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w, s = quantize_blocks(torch.randn(256, 256), 128, 128)
    with FakeTensorMode() as mode:
        out = torch.ops.autodeploy.fp8_block_linear_cublas_triton(
            mode.from_tensor(torch.randn(2, 5, 256, dtype=torch.bfloat16)), mode.from_tensor(w), mode.from_tensor(s),
            None, 128, 128)
    assert out.shape == (2, 5, 256) and out.dtype == torch.bfloat16
    w, s = quantize_blocks(torch.randn(64, 64), 32, 32)
    with pytest.raises(ValueError, match=r"fp8_block_linear_cublas_triton: serves block size \(128, 128\) only"):
        torch.ops.autodeploy.fp8_block_linear_cublas_triton(torch.randn(2, 64, dtype=torch.bfloat16), w, s, None, 32, 32)


def test_the_pass_option_takes_it():
    assert ResolveFP8LinearOptions(backend="cublas_triton").backend == "cublas_triton"
    assert DEFAULT_PREFERENCE["sm90"][0] == "cublas_triton"
    assert ResolveFP8LinearOptions(preference={"sm90": ["cublas_triton", "torch"]}).preference["sm90"][0] == "cublas_triton"
