"""Block-FP8 kernels on a GPU against the fp32 emulation, at the real linear and expert shapes of the
seven FP8 families (benchmarks.lib.fp8_shapes: derived from the published configs).

Every backend a descriptor accepts on this GPU is run on every shape it accepts; a backend the
descriptor refuses is skipped with its reason (the checks are what keep a kernel off shapes it was
never shown to serve). Tolerances: relative Frobenius error vs the emulation <= 1e-2 (bf16 output,
FP8 tensor-core accumulation within each 128-column K tile); FlashInfer quantizes the activations
itself, so it gets 2e-2. Default run: the activation quantizer and cuBLAS on DeepSeek-V3's linears;
the rest is `slow` (tests/gpu_cases.py): `pytest -m gpu --slow tests/test_fp8_kernels_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.custom_ops.attention.registry import Target
from autodeploy_mla.custom_ops.fp8.act_quant import act_quant, act_quant_reference
from autodeploy_mla.custom_ops.fp8.backends import FP8LinearNode, fp8_linear_backend, fp8_linear_op
from autodeploy_mla.custom_ops.fp8.emulation import w8a8_block_linear_emulated
from autodeploy_mla.custom_ops.moe.fp8 import fused_moe_fp8, moe_experts_fp8_emulated
from autodeploy_mla.testing.fp8_kernels import random_block_weight
from benchmarks.lib import FP8_FAMILIES, expert_shape, linear_shapes

BLOCK = 128
FAMILIES = list(FP8_FAMILIES)
TOL = {"triton": 1e-2, "scaled_mm": 1e-2, "cublas_triton": 1e-2, "flashinfer": 2e-2}


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.gpu
def test_gpu_act_quant_matches_the_reference():
    torch.manual_seed(0)
    x = torch.randn(513, 7168 + 64, device="cuda", dtype=torch.bfloat16) * 4  # a partial last group
    x[3] = 0
    x[7, 11] = 3000.0
    q, s = act_quant_reference(x, BLOCK)
    for major in ("k", "t"):
        qk, sk = act_quant(x, BLOCK, major)
        bad = (qk.view(torch.uint8) != q.view(torch.uint8)).nonzero()[:5].tolist()
        detail = [(r, c, float(x[r, c]), float(s[r, c // BLOCK]), hex(int(qk.view(torch.uint8)[r, c])),
                   hex(int(q.view(torch.uint8)[r, c]))) for r, c in bad]
        assert not bad, f"{major}: codes differ at (row, col, x, scale, kernel, reference) {detail}"
        assert torch.equal(sk, s), (major, (sk != s).nonzero()[:5].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "scaled_mm", "cublas_triton", "flashinfer"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_linear_backends_match_the_emulation(family, backend):
    target = Target.detect(torch.device("cuda"), 64)
    be, op = fp8_linear_backend(backend), fp8_linear_op(backend)
    ran, refused = 0, []
    for shape in linear_shapes(family, FP8_FAMILIES[family]):
        res = be.check(FP8LinearNode(shape.n, shape.k, BLOCK, BLOCK, torch.bfloat16), target)
        if not res.ok:
            refused.append(f"{shape.name} {shape.n}x{shape.k}: {res.reason}")
            continue
        w, s = random_block_weight((shape.n, shape.k), BLOCK, BLOCK, "cuda", seed=shape.n)
        bias = torch.randn(shape.n, device="cuda", dtype=torch.bfloat16) * 0.1
        for t in (1, 64, 2048):
            x = torch.randn(t, shape.k, device="cuda", dtype=torch.bfloat16)
            y = op(x, w, s, bias, BLOCK, BLOCK)
            ref = w8a8_block_linear_emulated(x, w, s, bias, BLOCK, BLOCK, torch.float32)
            assert y.shape == (t, shape.n) and y.dtype == torch.bfloat16
            err = rel(y, ref)
            assert err <= TOL[backend], f"{family} {shape.name} {shape.n}x{shape.k} T={t}: rel err {err:.2e}"
            ran += 1
    if not ran:
        pytest.skip(f"{backend} serves none of {family}'s linears here: {refused[0]}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_moe_fp8_matches_the_emulation(family):
    ex = expert_shape(family, FP8_FAMILIES[family])
    wu, su = random_block_weight((ex.experts, 2 * ex.inter, ex.hidden), BLOCK, BLOCK, "cuda", seed=1)
    wd, sd = random_block_weight((ex.experts, ex.hidden, ex.inter), BLOCK, BLOCK, "cuda", seed=2)
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (1, 64, 512):
        x = torch.randn(t, ex.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(t, ex.experts, device="cuda", generator=g).topk(ex.top_k, dim=-1).indices.to(torch.int32)
        wts = torch.rand(t, ex.top_k, device="cuda", generator=g)
        y = fused_moe_fp8(x, ids, wts, wu, su, wd, sd, BLOCK, BLOCK)
        ref = moe_experts_fp8_emulated(x, ids, wts, wu, su, wd, sd, BLOCK, BLOCK)
        err = rel(y, ref)
        assert err <= 2e-2, f"{family} T={t}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_moe_fp8_sorted_path_matches_the_gathered_path(family):
    """The opt-in sorted-rows prefill path (`persistent_sorted`: persistent GEMMs, gate and up in one product)
    against the gathered kernels and the emulation, at prefill sizes and its sweep's row blocks."""
    ex = expert_shape(family, FP8_FAMILIES[family])
    wu, su = random_block_weight((ex.experts, 2 * ex.inter, ex.hidden), BLOCK, BLOCK, "cuda", seed=1)
    wd, sd = random_block_weight((ex.experts, ex.hidden, ex.inter), BLOCK, BLOCK, "cuda", seed=2)
    g = torch.Generator(device="cuda").manual_seed(0)
    for t, bm in ((37, 64), (512, 64), (2048, 64), (2048, 128)):
        x = torch.randn(t, ex.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(t, ex.experts, device="cuda", generator=g).topk(ex.top_k, dim=-1).indices.to(torch.int32)
        wts = torch.rand(t, ex.top_k, device="cuda", generator=g)
        y = fused_moe_fp8(x, ids, wts, wu, su, wd, sd, BLOCK, BLOCK, block_m=bm, persistent_sorted=True)
        old = fused_moe_fp8(x, ids, wts, wu, su, wd, sd, BLOCK, BLOCK)
        ref = moe_experts_fp8_emulated(x, ids, wts, wu, su, wd, sd, BLOCK, BLOCK)
        assert rel(y, old) <= 1e-2 and rel(y, ref) <= 2e-2, (family, t, bm, rel(y, old), rel(y, ref))


@pytest.mark.gpu
def test_gpu_fp8_ops_replay_in_cuda_graphs():
    """The Triton linear (decode split-K and prefill tiles) and the MoE op are CUDA-graph safe: a
    captured call replays to the eager result after its inputs change in place."""
    w, s = random_block_weight((2112, 7168), BLOCK, BLOCK, "cuda", seed=3)
    wu, su = random_block_weight((8, 2 * 256, 1024), BLOCK, BLOCK, "cuda", seed=4)
    wd, sd = random_block_weight((8, 1024, 256), BLOCK, BLOCK, "cuda", seed=5)
    for t in (4, 300):
        x = torch.randn(t, 7168, device="cuda", dtype=torch.bfloat16)
        xm = torch.randn(t, 1024, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 8, (t, 2), device="cuda", dtype=torch.int32)
        ids[:, 1] = (ids[:, 0] + 1) % 8
        wts = torch.rand(t, 2, device="cuda")

        def step():  # the sorted-rows MoE path too: its persistent GEMMs read the blocks in use on the device
            return (torch.ops.autodeploy.fp8_block_linear_triton(x, w, s, None, BLOCK, BLOCK),
                    torch.ops.autodeploy.triton_moe_experts_fp8(xm, ids, wts, wu, su, wd, sd, BLOCK, BLOCK),
                    fused_moe_fp8(xm, ids, wts, wu, su, wd, sd, BLOCK, BLOCK, persistent_sorted=True))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        x.copy_(torch.randn_like(x))
        xm.copy_(torch.randn_like(xm))
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w_) for o, w_ in zip(out, want)), t

