"""The block-FP8 MoE op's sorted-rows prefill path (`persistent_sorted`: fp8_kernels.gather_fp8_kernel,
up_fp8_sorted_kernel, down_fp8_sorted_kernel) on the CPU (Triton interpreted): the same values as the
gathered path (up_fp8_kernel / down_fp8_kernel: same quantization points, the sums in another order at most)
and as the fp32 emulation within test_fp8_moe's tolerances, on uneven routing (experts with no rows, row
counts that are not a multiple of the row block), top-2 and top-6, a shared expert appended as expert E
(fuse_moe.fuse_shared: every token routed to it with weight 1), fp32 and bf16. Each persistent program
walks several tiles here (fp8.INTERPRETED_PROGRAMS < tiles)."""

from __future__ import annotations

import pytest
import torch

import autodeploy_mla.custom_ops  # noqa: F401  (registers the ops)
from autodeploy_mla.custom_ops.moe import fp8 as moe_fp8
from autodeploy_mla.custom_ops.moe.fp8 import fused_moe_fp8, moe_experts_fp8_emulated
from autodeploy_mla.custom_ops.moe.tuning import moe_fp8_config
from autodeploy_mla.testing.fp8_kernels import quantize_blocks


def make(t, h, i, e, k, bn, bk, dtype, shared=False, seed=0):
    """Random block-FP8 experts and skewed top-k routing: expert j drawn with weight 2^-j, the last
    quarter of the experts never (no rows); `shared`: one more expert that every token is routed to."""
    g = torch.Generator().manual_seed(seed)
    e_all = e + int(shared)
    wu, su = quantize_blocks(torch.randn(e_all, 2 * i, h, generator=g) * 0.1, bn, bk)
    wd, sd = quantize_blocks(torch.randn(e_all, h, i, generator=g) * 0.1, bn, bk)
    x = torch.randn(t, h, generator=g).to(dtype)
    p = torch.tensor([2.0 ** -j for j in range(e)])
    p[e - e // 4:] = 0
    ids = torch.multinomial(p.expand(t, e), k, replacement=False, generator=g)
    w = torch.rand(t, k, generator=g)
    if shared:
        ids = torch.cat([ids, torch.full((t, 1), e)], 1)
        w = torch.cat([w, torch.ones(t, 1)], 1)
    return x, ids.to(torch.int32), w, wu, su, wd, sd


CASES = [  # t, h, i, e, k, bn, bk, shared; the 1st and 4th have whole tiles (the kernels' unmasked EVEN loops)
    (23, 64, 64, 8, 2, 32, 32, False),  # 46 pairs in 16-row blocks, two experts without rows
    (13, 96, 48, 12, 6, 32, 32, False),  # top-6; I=48: a partial intermediate group (the gate/up tile half empty)
    (19, 80, 64, 4, 2, 16, 32, True),  # shared expert (19 rows); H=80: a partial K block; bn < bk
    (11, 96, 96, 16, 6, 32, 32, True),  # top-6 + shared over 17 experts, 4 without rows
]


@pytest.mark.parametrize("t,h,i,e,k,bn,bk,shared", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_path_equals_the_gathered_path_and_the_emulation(t, h, i, e, k, bn, bk, shared, dtype):
    args = make(t, h, i, e, k, bn, bk, dtype, shared)
    counts = torch.bincount(args[1].reshape(-1).long(), minlength=args[3].shape[0])
    assert (counts == 0).any() and (counts % 16 != 0).any()  # the uneven routing this test is about
    got = fused_moe_fp8(*args, bn, bk, persistent_sorted=True).float()
    old = fused_moe_fp8(*args, bn, bk, persistent_sorted=False).float()
    ref = moe_experts_fp8_emulated(*args, bn, bk).float()
    if dtype == torch.float32:
        assert (got - old).abs().max() <= 1e-6 * old.abs().max()
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    else:  # bf16 pair outputs: a sum in another order may round one the other way
        assert (got - old).norm() <= 1e-3 * old.norm()
        assert (got - ref).norm() <= 1e-2 * ref.norm()


def test_row_block_override_and_programs_walking_many_tiles():
    # 32-row blocks, one program per 3 tiles' worth: each program walks several row blocks' tiles
    args = make(29, 64, 64, 6, 2, 32, 32, torch.float32, shared=True, seed=3)
    got = fused_moe_fp8(*args, 32, 32, block_m=32, down_n=64, persistent_sorted=True)
    old = fused_moe_fp8(*args, 32, 32, block_m=32, down_n=64)
    assert (got - old).abs().max() <= 1e-6 * old.abs().max()
    assert moe_fp8.INTERPRETED_PROGRAMS < -(-29 * 3 // 32) + 6


def test_sorted_path_serves_prefill_sizes_from_the_sweep():
    # V2-Lite's 64 experts, top-6: T=64 (decode) stays gathered, T=512 and 2048 take the sorted path
    # (measured faster there, moe_fp8_config); the unswept range in between keeps the gathered kernels
    picks = {t: moe_fp8_config(t * 6, 64, 2048, 1408, 128, True) for t in (64, 256, 512, 2048)}
    assert [picks[t].persistent_sorted for t in (64, 256, 512, 2048)] == [False, False, True, True]
    assert (picks[2048].block_m, picks[2048].num_warps, picks[2048].num_stages, picks[2048].down_n) == (64, 8, 4, 256)
    # the interpreter (CPU tests) keeps its small gathered tiles at every size
    assert not any(moe_fp8_config(t * 6, 64, 2048, 1408, 128, False).persistent_sorted for t in (64, 2048))
