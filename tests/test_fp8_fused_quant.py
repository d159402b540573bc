"""The decode-sized FP8 linear with the activation quantization inside the GEMM (gemm_triton.
w8a8_fused_quant_gemm), on the CPU under Triton's interpreter: the codes and scales it quantizes are
act_quant's bit for bit, its output is the unfused path's (act_quant + GEMM, same launch config)
exactly and the fp32 emulation's within the summation order; which sizes take it."""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.custom_ops.fp8.act_quant import act_quant_reference
from autodeploy_mla.custom_ops.fp8.emulation import w8a8_block_linear_emulated
from autodeploy_mla.custom_ops.fp8.gemm_triton import (FUSED_QUANT_MAX_M, GemmConfig, fused_quant_config, fuses_quant,
                                                        triton_block_linear, w8a8_fused_quant_gemm)
from autodeploy_mla.testing.fp8_kernels import quantize_blocks

FP8 = torch.float8_e4m3fn

CASES = [
    (5, 80, 96, 32, 32, None),  # partial N block, default (interpreter) config
    (3, 70, 100, 16, 32, GemmConfig(16, 32, 32, split_k=3, group_m=1, num_warps=1, num_stages=1)),  # partial group, split-K
    (1, 48, 256, 128, 128, GemmConfig(16, 16, 128, split_k=2, group_m=1, num_warps=1, num_stages=1)),  # one token
    (40, 64, 64, 32, 32, GemmConfig(16, 32, 32, split_k=1, group_m=1, num_warps=1, num_stages=1)),  # several M tiles
]


@pytest.mark.parametrize("m,n,k,bn,bk,cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_quantization_is_act_quants_and_the_gemm_the_unfused_one(m, n, k, bn, bk, cfg, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(3)
    w, s = quantize_blocks(torch.randn(n, k) * 0.05, bn, bk)
    x = (torch.randn(m, k) * torch.logspace(-3, 2, k)).to(dtype)  # groups of very different ranges
    x[0, :bk] = 0  # an all-zero group: the amax floor, as act_quant
    bias = torch.randn(n).to(dtype)
    q = torch.full((m, k), float("nan")).to(FP8)
    sc = torch.full((m, -(-k // bk)), float("nan"))
    y = w8a8_fused_quant_gemm(x, w, s, bias, bn, bk, cfg, codes=(q, sc))
    q_ref, s_ref = act_quant_reference(x, bk)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sc, s_ref)
    same_cfg = cfg or fused_quant_config(m, n, k, bk, compiled=False)
    unfused = triton_block_linear(x, w, s, bias, bn, bk, same_cfg, fuse_quant=False)
    assert y.dtype == dtype and torch.equal(y, unfused)
    ref = w8a8_block_linear_emulated(x, w, s, bias, bn, bk, torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


def test_triton_block_linear_fuses_at_decode_sizes_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fuses_quant(1, 128, None) and fuses_quant(FUSED_QUANT_MAX_M, 128, None)
    assert not fuses_quant(FUSED_QUANT_MAX_M + 1, 128, None)  # prefill: quantize once, read by every N tile
    assert not fuses_quant(16, 256, None)  # a group wider than the decode K tile
    assert not fuses_quant(16, 128, GemmConfig(16, 64, 64, 2))  # an explicit K tile that is not the group
    assert not fuses_quant(0, 128, None)
    w, s = quantize_blocks(torch.randn(32, 64) * 0.05, 32, 32)
    x = torch.randn(2, 3, 64)  # leading dims: 6 rows
    y = triton_block_linear(x, w, s, None, 32, 32)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y, w8a8_fused_quant_gemm(x.reshape(6, 64), w, s, None, 32, 32).reshape(2, 3, 32))
    with pytest.raises(ValueError, match="K tile"):
        w8a8_fused_quant_gemm(x.reshape(6, 64), w, s, None, 32, 32, GemmConfig(16, 32, 16))


def test_decode_configs_keep_split_k_with_the_group_as_k_tile():
    c = fused_quant_config(1, 576, 2048, 128, compiled=True, num_sms=132)  # V2-Lite kv_a at T = 1
    assert c.block_k == 128 and c.block_m == 16 and c.split_k > 1
