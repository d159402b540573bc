"""Expert parallelism (`transforms.shard.experts: expert`) on CPU over gloo: the `ep_moe_experts` op
at 2 and 4 ranks against the whole-model reference op, and tiny DeepSeek-V3 / GLM-4.7-Flash built
expert-parallel at 2 and 4 ranks against one process and HF eager (greedy tokens, fp32).

Spawned runs are few and each serves several tests (process start-up and export dominate)."""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.custom_ops.moe.expert_parallel import COLLECTIVES
from autodeploy_mla.distributed import spawn

H, I, E, K = 16, 8, 8, 2


def _experts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3)


def _routing(t: int, seed: int, skew: str):
    """Top-k ids (distinct per token) and weights for `t` tokens; `skew`: 'random', 'one_rank' (every
    pair on the experts of rank 0: the other ranks receive nothing) or 'empty_experts' (experts 0 and
    1 only: experts 2.. get zero tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    if skew == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K)
    else:
        ids = torch.tensor([[0, 1]] * t) if t else torch.zeros(0, K)
    w = torch.rand(t, K, generator=g)
    return x, ids.long().reshape(t, K), w


def _op_rank(rank: int) -> dict:
    """Every case of the op on this rank: max |diff| against torch_moe_experts on all E experts."""
    import torch.distributed as dist

    from autodeploy_mla.distributed.env import world_group_name

    world = dist.get_world_size()
    local = E // world
    w_up, w_down = _experts()
    mine = slice(rank * local, (rank + 1) * local)
    group = world_group_name()
    ref = torch.ops.autodeploy.torch_moe_experts
    op = torch.ops.autodeploy.ep_moe_experts
    diffs = {}
    for coll in COLLECTIVES:
        # replicated tokens (tensor-parallel attention): same tokens on every rank; T < world leaves
        # some ranks' chunks empty (no routed pairs of their own)
        for t in (1, 3, 7, 16):
            for skew in ("random", "one_rank", "empty_experts"):
                x, ids, w = _routing(t, 100 + t, skew)
                out = op(x, ids, w, w_up[mine], w_down[mine], None, None, E, rank, world, group, coll, "replicated")
                diffs[(coll, "replicated", t, skew)] = (out - ref(x, ids, w, w_up, w_down)).abs().max().item()
        # local tokens (data-parallel attention, later): each rank its own count, rank 1 none at all
        t = [5, 0, 3, 1][rank % 4]
        x, ids, w = _routing(t, 7 * rank + 1, "random")
        out = op(x, ids, w, w_up[mine], w_down[mine], None, None, E, rank, world, group, coll, "local", 6)
        diffs[(coll, "local", t, "random")] = ((out - ref(x, ids, w, w_up, w_down)).abs().max().item() if t else
                                              float(out.shape != (0, H)))
    x, ids, w = _routing(5, 3, "random")
    for coll in COLLECTIVES:
        torch.library.opcheck(op, (x, ids, w, w_up[mine].clone(), w_down[mine].clone(), None, None, E, rank, world,
                                   group, coll, "replicated"))
    return diffs


@pytest.fixture(scope="module", params=[2, 4])
def op_runs(request):
    return request.param, spawn(_op_rank, request.param, all_results=True)


def test_ep_op_matches_the_whole_model_reference(op_runs):
    """Both collectives, replicated and local tokens, uneven routing (experts with no tokens, ranks
    with no routed pairs, a rank with no tokens): every rank's output equals the reference on all
    experts to fp32 rounding (only the order of the sum over owning ranks differs)."""
    world, ranks = op_runs
    assert len(ranks) == world
    for res in ranks:
        assert len(res) == 2 * (4 * 3 + 1)
        bad = {k: v for k, v in res.items() if v > 1e-5}
        assert not bad, bad
