"""Block-FP8 MoE experts ops on the CPU: the Triton op (interpreted) against the fp32 emulation, the
reference against the 16-bit reference on dequantized experts, opcheck, input errors, and the MoE
backend descriptor's FP8 rule. GPU cases at real expert shapes: tests/test_fp8_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

import autodeploy_mla.custom_ops  # noqa: F401  (registers the ops)
from autodeploy_mla.custom_ops.attention.registry import DeviceInfo
from autodeploy_mla.custom_ops.moe.backends import TRITON, experts_op
from autodeploy_mla.custom_ops.moe.fp8 import dequantize_experts, fused_moe_fp8, moe_experts_fp8_emulated
from autodeploy_mla.testing.fp8_kernels import quantize_blocks

OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def make(t, h, i, e, k, bn, bk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    wu, su = quantize_blocks(torch.randn(e, 2 * i, h, generator=g) * 0.1, bn, bk)
    wd, sd = quantize_blocks(torch.randn(e, h, i, generator=g) * 0.1, bn, bk)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(t, k, generator=g)
    return x, ids, w, wu, su, wd, sd


@pytest.mark.parametrize("t,h,i,e,k,bn,bk", [
    (9, 96, 64, 5, 2, 32, 32),
    (1, 64, 48, 4, 3, 32, 32),  # one token; I=48: a partial intermediate group and a partial up-row block
    (20, 80, 40, 6, 2, 16, 32),  # H=80: a partial K block of the up GEMM; bn < bk
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_experts_match_the_emulation(t, h, i, e, k, bn, bk, dtype):
    args = make(t, h, i, e, k, bn, bk, dtype)
    y = fused_moe_fp8(*args, bn, bk).float()
    ref = moe_experts_fp8_emulated(*args, bn, bk).float()
    if dtype == torch.float32:
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    else:  # pair outputs stored in bf16 before the fp32 sum over top-k (the interpreter's bf16 cast truncates)
        assert (y - ref).norm() <= 1e-2 * ref.norm()


@pytest.mark.parametrize("t", [1, 9])
def test_negative_ids_are_no_pairs(t):
    """An id of -1 (expert parallelism: another rank's pair) adds nothing: the same as that pair with
    weight 0, in the Triton op and the reference."""
    x, ids, w, wu, su, wd, sd = make(t, 64, 32, 4, 2, 32, 32, seed=t)
    drop = torch.zeros_like(ids, dtype=torch.bool)
    drop[0, 0] = True
    drop[-1, -1] = True
    neg = torch.where(drop, torch.full_like(ids, -1), ids)
    zeroed = torch.where(drop, torch.zeros_like(w), w)
    ref = moe_experts_fp8_emulated(x, ids, zeroed, wu, su, wd, sd, 32, 32).float()
    y = fused_moe_fp8(x, neg, w, wu, su, wd, sd, 32, 32).float()
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    ref_op = experts_op("torch", fp8=True)  # W8A16: its own oracle, the same pairs with weight 0
    assert torch.equal(ref_op(x, neg, w, wu, su, wd, sd, 32, 32), ref_op(x, ids, zeroed, wu, su, wd, sd, 32, 32))


def test_no_tokens():
    args = make(0, 64, 32, 4, 2, 32, 32)
    assert fused_moe_fp8(*args, 32, 32).shape == (0, 64)


def test_reference_is_the_16bit_reference_on_dequantized_experts():
    x, ids, w, wu, su, wd, sd = make(7, 64, 32, 4, 2, 32, 32)
    got = torch.ops.autodeploy.torch_moe_experts_fp8(x, ids, w, wu, su, wd, sd, 32, 32)
    want = torch.ops.autodeploy.torch_moe_experts(x, ids, w, dequantize_experts(wu, su, 32, 32, x.dtype),
                                                  dequantize_experts(wd, sd, 32, 32, x.dtype))
    assert torch.equal(got, want)
    # W8A16 vs W8A8: the activation quantization is the only difference
    emu = moe_experts_fp8_emulated(x, ids, w, wu, su, wd, sd, 32, 32)
    assert (got - emu).norm() < 0.05 * got.norm()


@pytest.mark.parametrize("op", ["torch_moe_experts_fp8", "triton_moe_experts_fp8"])
def test_opcheck(op):
    x, ids, w, wu, su, wd, sd = make(5, 64, 32, 4, 2, 32, 32)
    torch.library.opcheck(getattr(torch.ops.autodeploy, op), (x, ids, w, wu, su, wd, sd, 32, 32),
                          test_utils=OPCHECK_UTILS)


def test_misshapen_scales_and_strided_weights_are_named():
    x, ids, w, wu, su, wd, sd = make(3, 64, 32, 4, 2, 32, 32)
    with pytest.raises(ValueError, match=r"w_down_scale must be float32 \[E, ceil\(64/32\), ceil\(32/32\)\]"):
        torch.ops.autodeploy.triton_moe_experts_fp8(x, ids, w, wu, su, wd, sd[:, :1], 32, 32)
    with pytest.raises(ValueError, match="w_up must be float8_e4m3fn"):
        torch.ops.autodeploy.torch_moe_experts_fp8(x, ids, w, wu.float(), su, wd, sd, 32, 32)
    wt = wu.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w_up must be contiguous along its last dim"):
        fused_moe_fp8(x, ids, w, wt, su, wd, sd, 32, 32)


def test_moe_backend_serves_fp8_experts_on_sm89_and_later():
    fp8 = torch.float8_e4m3fn
    assert TRITON.check("experts", DeviceInfo("cuda", (9, 0)), fp8).ok
    assert TRITON.check("experts", DeviceInfo("cuda", (8, 9)), fp8).ok
    res = TRITON.check("experts", DeviceInfo("cuda", (8, 0)), fp8)
    assert not res.ok and "SM89+" in res.reason
    assert experts_op("triton", fp8=True) == torch.ops.autodeploy.triton_moe_experts_fp8.default
    assert experts_op("torch") == torch.ops.autodeploy.torch_moe_experts.default
