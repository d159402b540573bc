"""Expert parallelism (`transforms.shard.experts: expert`) on CPU over gloo: the `ep_moe_experts` op
at 2 and 4 ranks against the whole-model reference op, and tiny DeepSeek-V3 / GLM-4.7-Flash built
expert-parallel at 2 and 4 ranks against one process and HF eager (greedy tokens, fp32).

Spawned runs are few and each serves several tests (process start-up and export dominate): one
2-rank and one 4-rank spawn, each rank running its model probes and then every case of the op; both
(and the checkpoints they read) made in a background driver process (tests/background_runs.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.config import load_config, model_config_path
from autodeploy_mla.custom_ops import Target
from autodeploy_mla.custom_ops.fp8.format import BlockFP8Format
from autodeploy_mla.custom_ops.moe.expert_parallel import COLLECTIVES, EP_MOE_EXPERTS
from autodeploy_mla.distributed import spawn
from autodeploy_mla.models.checkpoint import ShardSpec
from autodeploy_mla.models.factory import build_model
from autodeploy_mla.runtime.artifacts import TensorParallel
from autodeploy_mla.testing.fp8_checkpoints import reference_hf_model, write_fp8_checkpoint
from autodeploy_mla.testing.probe import ProbeJob, probe_rank
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS, build_tiny_model
from autodeploy_mla.transforms.context import BuildContext
from autodeploy_mla.transforms.pass_manager import parse_pipeline
from autodeploy_mla.transforms.shard import ShardError
from autodeploy_mla.verify import hf_greedy_generate
from background_runs import BackgroundRuns

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
        # what data-parallel attention runs: every rank the same padded count (capacity 0), the Triton
        # experts (interpreted) handed other ranks' pairs as id -1
        x, ids, w = _routing(4, 11 * rank + 2, "random")
        out = op(x, ids, w, w_up[mine], w_down[mine], None, None, E, rank, world, group, coll, "local", 0, "triton")
        diffs[(coll, "local-triton", 4, "random")] = (out - ref(x, ids, w, w_up, w_down)).abs().max().item()
    x, ids, w = _routing(5, 3, "random")
    for coll in COLLECTIVES:
        torch.library.opcheck(op, (x, ids, w, w_up[mine].clone(), w_down[mine].clone(), None, None, E, rank, world,
                                   group, coll, "replicated"))
    return diffs


def _ep_rank(rank: int, jobs) -> dict:
    """One rank of a spawned run: the model probes (first, so that they run as in a rank of their own),
    then every case of the op (_op_rank) in the same process group; an error in the op cases is
    returned (and fails the op test only)."""
    import traceback

    out = {"probe": probe_rank(rank, jobs)}
    try:
        out["op"] = _op_rank(rank)
    except Exception:  # noqa: BLE001 - reported by test_ep_op_matches_the_whole_model_reference
        out["op"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module", params=[2, 4])
def op_runs(request):
    """The op cases of every rank, from the 2- or 4-rank run the model tests use (no spawn of their own)."""
    ranks = request.getfixturevalue("two_rank_run" if request.param == 2 else "four_rank_run")
    return request.param, [r["op"] for r in ranks]


def test_ep_op_matches_the_whole_model_reference(op_runs):
    """Both collectives, replicated and local tokens, uneven routing (experts with no tokens, ranks
    with no routed pairs, a rank with no tokens): every rank's output equals the reference on all
    experts to fp32 rounding (only the order of the sum over owning ranks differs)."""
    world, ranks = op_runs
    assert len(ranks) == world
    for res in ranks:
        assert isinstance(res, dict), res  # else the traceback of the rank's op cases
        assert len(res) == 2 * (4 * 3 + 2)
        bad = {k: v for k, v in res.items() if v > 1e-5}
        assert not bad, bad


# ----------------------------------------------------------------------------- whole models
RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
# chunked prefill (> max_num_tokens), a 1-token prompt; decode batches of 1-3 tokens leave ranks with
# no tokens of their own to dispatch at world size 4
PROMPTS = [[5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42]]
NEW = 4
EP = ["transforms.shard.experts=expert"]
AGRS = [*EP, "transforms.shard.ep_collective=allgather_reducescatter"]
FP8_BLOCK = BlockFP8Format(32, 32)
# the FP8 tiny DeepSeek-V3 of tests/test_tensor_parallel_fp8.py: every TP-2 split on a 32-block
FP8_DIMS = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 128,
            "moe_intermediate_size": 64, "q_lora_rank": 64}


def _ds3_ckpt_overrides(path) -> list[str]:
    return [f"model.path={path}", "model.hf_config=null"]


def _write_ckpts(out: Path) -> None:
    """The background driver's prelude: a tiny DeepSeek-V3 checkpoint (per-expert tensors,
    save_pretrained) in ds3/, an FP8 one [32, 32] in fp8/ and the reference weights its writer returns
    (fp8_ref.pt: fp32, the FP8 values dequantized)."""
    cfg = load_config(model_config_path("deepseek_v3"), overrides=RUNTIME)
    build_model(cfg.model, torch.device("cpu"), torch.float32).save_pretrained(out / "ds3")
    fp8_cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    fp8_cfg.update(FP8_DIMS)
    torch.save(write_fp8_checkpoint(build_tiny_model(fp8_cfg), out / "fp8", FP8_BLOCK), out / "fp8_ref.pt")


def _run_two(out: Path) -> list:
    jobs = [ProbeJob("ds3_ckpt", "deepseek_v3", [*RUNTIME, *EP, *_ds3_ckpt_overrides(out / "ds3")], PROMPTS, NEW),
            ProbeJob("ds3_agrs", "deepseek_v3", [*RUNTIME, *AGRS], PROMPTS, NEW),
            ProbeJob("glm_hashed", "glm_4_7_flash", [*RUNTIME, *EP, "model.init=hashed"], PROMPTS, NEW,
                     weight_values=True),
            ProbeJob("fp8", str(out / "fp8"), [*RUNTIME, *EP], PROMPTS, NEW)]
    return spawn(_ep_rank, 2, jobs, all_results=True)


def _run_four(out: Path) -> list:
    jobs = [ProbeJob("glm", "glm_4_7_flash", [*RUNTIME, *EP], PROMPTS, NEW),
            ProbeJob("ds3_agrs", "deepseek_v3", [*RUNTIME, *AGRS], PROMPTS, NEW)]
    return spawn(_ep_rank, 4, jobs, all_results=True)


# The two spawned runs start in a low-priority driver process as soon as the session's tests are
# collected (tests/background_runs.py), overlapping the single-threaded tests of the files before this one.
_BACKGROUND = BackgroundRuns(__name__, {"two": _run_two, "four": _run_four},
                             {"two_rank_run": ["two"], "four_rank_run": ["four"], "op_runs": ["two", "four"]},
                             prelude=_write_ckpts)


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected


@pytest.fixture(scope="module")
def ckpts():
    """The checkpoints the runs read (_write_ckpts) and the FP8 one's HF reference (dequantized weights)."""
    out = _BACKGROUND.prelude_dir()
    fp8_cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    fp8_cfg.update(FP8_DIMS)
    hf = reference_hf_model(build_tiny_model(fp8_cfg, seed=1), torch.load(out / "fp8_ref.pt"))
    return out / "ds3", out / "fp8", hf


two_rank_run = _BACKGROUND.fixture("two", "two_rank_run")
four_rank_run = _BACKGROUND.fixture("four", "four_rank_run")


@pytest.fixture(scope="module")
def two_ranks(two_rank_run):
    return [r["probe"] for r in two_rank_run]


@pytest.fixture(scope="module")
def four_ranks(four_rank_run):
    return [r["probe"] for r in four_rank_run]


def _single(family: str, *extra: str):
    om = optimize(family, overrides=[*RUNTIME, *extra])
    return om, om.generate([list(p) for p in PROMPTS], max_new_tokens=NEW)


def _check_layout(res: dict, world: int, collective: str) -> None:
    """The report names the layout of the MoE layer; the rank holds its E/W experts and no more."""
    rank = res["rank"]
    entry, = res["shard_details"]["experts"]
    local = 8 // world
    assert entry["layout"] == "expert" and entry["collective"] == collective, entry
    assert entry["local_experts"] == [rank * local, (rank + 1) * local] and entry["experts"] == f"8 -> {local} per rank"
    assert "routing replicated" in entry["why"] and entry["backend"] == "torch"
    assert f"1 MoE layers expert-parallel ({collective})" in res["shard_summary"]
    ep = [t for t, rule in res["shard_details"]["rules"].items() if rule["rule"].startswith("experts: expert-parallel")]
    assert ep and all(res["weights"][t][0][0] == local for t in ep if t in res["weights"]), ep


def test_two_ranks_equal_one_process_and_hf(ckpts, two_ranks):
    """World size 2, fp32: DeepSeek-V3 from a checkpoint (each rank reads its 4 experts only), both
    collectives; greedy tokens of both ranks == one process == HF eager."""
    ds3_path = ckpts[0]
    om, tokens = _single("deepseek_v3", *_ds3_ckpt_overrides(ds3_path))
    assert tokens == [hf_greedy_generate(om.eager_model, p, NEW) for p in PROMPTS]
    for job, coll in (("ds3_ckpt", "all_to_all"), ("ds3_agrs", "allgather_reducescatter")):
        for res in two_ranks:
            r = res[job]
            assert r["tokens"] == tokens, (job, r["rank"])
            _check_layout(r, 2, coll)
    load = two_ranks[1]["ds3_ckpt"]["load_details"]
    assert 0 < load["bytes_read"] < load["full_model_bytes"]
    assert two_ranks[0]["ds3_ckpt"]["skeleton"]


def test_hashed_init_each_rank_makes_the_slice_of_its_experts(two_ranks):
    """GLM-4.7-Flash with `model.init: hashed`: every rank generates only its experts, which equal
    (bitwise) the same experts of the whole model made in one process; tokens == one process == HF."""
    om, tokens = _single("glm_4_7_flash", "model.init=hashed")
    assert tokens == [hf_greedy_generate(om.eager_model, p, NEW) for p in PROMPTS]
    whole = dict(om.eager_model.named_parameters())
    for res in two_ranks:
        r = res["glm_hashed"]
        assert r["tokens"] == tokens
        _check_layout(r, 2, "all_to_all")
        checked = 0
        for target, rule in r["shard_details"]["rules"].items():
            if not rule["rule"].startswith("experts: expert-parallel"):
                continue
            spec = ShardSpec(rule["dim"], tuple(tuple(x) for x in rule["ranges"]), rule["rule"], rule["zero"])
            assert torch.equal(r["weight_values"][target], spec.slice(whole[target.removeprefix("model.")].detach()))
            checked += 1
        assert checked == 2  # gate_up_proj and down_proj


def test_fp8_experts_expert_parallel(ckpts, two_ranks):
    """Block-FP8 experts (weights + stacked scale grids sliced on the expert dim, read by slices):
    tokens == HF eager on the dequantized weights, and the FP8 op runs per rank."""
    _, _, hf = ckpts
    want = [hf_greedy_generate(hf, p, NEW, ignore_eos=True) for p in PROMPTS]
    for res in two_ranks:
        r = res["fp8"]
        assert r["tokens"] == want, r["rank"]
        entry, = r["shard_details"]["experts"]
        assert entry["layout"] == "expert" and entry["weights"] == "fp8 blocks [32, 32]"
        rules = r["shard_details"]["rules"]
        up = "model.model.layers.1.mlp.experts.gate_up_proj"
        lo = 4 * r["rank"]
        assert rules[up]["dim"] == rules[up + "_scale_inv"]["dim"] == 0
        assert rules[up]["ranges"] == rules[up + "_scale_inv"]["ranges"] == ((lo, lo + 4),)


def test_four_ranks_equal_one_process(four_ranks):
    """World size 4 (2 experts and 1 head per rank): GLM-4.7-Flash with all-to-all and DeepSeek-V3
    with all-gather + reduce-scatter; one-token decode steps leave three ranks without tokens of
    their own, which still take part in every collective."""
    for job, family, coll in (("glm", "glm_4_7_flash", "all_to_all"),
                              ("ds3_agrs", "deepseek_v3", "allgather_reducescatter")):
        om, tokens = _single(family)
        assert tokens == [hf_greedy_generate(om.eager_model, p, NEW) for p in PROMPTS]
        for res in four_ranks:
            assert res[job]["tokens"] == tokens, (job, res[job]["rank"])
            _check_layout(res[job], 4, coll)


def test_experts_not_divisible_by_world_size_are_refused_at_planning():
    """6 experts at world size 4 (4 heads: attention would split): refused before the graph changes,
    naming E, the world size and the sizes that work."""
    cfg = load_config(model_config_path("deepseek_v3"), overrides=[*RUNTIME, "model.hf_config.n_routed_experts=6"])
    pipeline = parse_pipeline(cfg.transforms)
    model = build_model(cfg.model, torch.device("cpu"), torch.float32)
    ctx = BuildContext(cfg, model, torch.device("cpu"), torch.float32, Target.detect("cpu", 4))
    for info, opts in pipeline.steps:
        if info.name in ("export", "match_mla"):
            info.fn(ctx, opts)
    before = ctx.gm.code
    ctx.world = TensorParallel(4, 0, "0")
    info = next(i for i, _ in pipeline.steps if i.name == "shard")
    with pytest.raises(ShardError, match=r"world_size=4: the routed expert count of model\.layers\.1\.mlp\S* \(E=6\) "
                                         r"is not divisible by 4.*divide the experts and the heads: 1, 2;"):
        info.fn(ctx, info.options.model_validate({"enabled": True, "experts": "expert"}))
    assert ctx.gm.code == before
    assert not any(n.target is EP_MOE_EXPERTS for n in ctx.gm.graph.nodes)
