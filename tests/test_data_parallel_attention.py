"""Data-parallel attention (`transforms.shard.attention: data`) on CPU over gloo: each rank runs whole
attention on its own sequences (its own cache and page allocator), routed experts expert-parallel
from each rank's own tokens (`ep_moe_experts`, tokens local), dense MLPs replicated; the ranks step
in lock-step (runtime/data_parallel.py) and a rank with nothing to run runs idle steps.

One rank spawn serves every multi-rank test (start-up and export dominate), made with the checkpoint it
reads in a background driver process (tests/background_runs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.config import load_config, model_config_path
from autodeploy_mla.custom_ops import Target
from autodeploy_mla.custom_ops.moe.expert_parallel import EP_MOE_EXPERTS
from autodeploy_mla.distributed import spawn
from autodeploy_mla.models.factory import build_model
from autodeploy_mla.runtime.artifacts import TensorParallel
from autodeploy_mla.runtime.data_parallel import PeerRankFailed, StepAgreement, partition_by_tokens
from autodeploy_mla.runtime.engine import GenerationEngine
from autodeploy_mla.runtime.page_allocator import PageAllocator
from autodeploy_mla.runtime.sampling import SamplingParams, StepOutput
from autodeploy_mla.runtime.sequence_info import SequenceInfo
from autodeploy_mla.testing.probe import rank_overrides
from autodeploy_mla.transforms.context import BuildContext
from autodeploy_mla.transforms.pass_manager import parse_pipeline
from autodeploy_mla.transforms.shard import ShardError, count_all_reduces
from background_runs import BackgroundRuns

RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
DP = ["transforms.shard.attention=data", "transforms.shard.experts=expert", "transforms.shard.mlp=replicate"]
# chunked prefill (> max_num_tokens), a 1-token prompt, uneven lengths: at world 2 the token
# partition (15, 13, 8, 6, 5 tokens) gives rank 0 prompts 1, 2 and 4 (26), rank 1 prompts 0 and 3 (21)
PROMPTS = [[5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42], [8, 1, 2, 3, 4, 5, 6, 7, 9], [77, 6]]
NEW = 4
FAMILIES = ("deepseek_v3", "glm_4_7_flash")
#: the experts' collective per family in the world-2 runs: both schemes take local tokens
COLLECTIVE = {"deepseek_v3": "all_to_all", "glm_4_7_flash": "allgather_reducescatter"}
#: the dense and shared-expert MLPs per family in the world-2 runs: replicated (DeepSeek-V3), or
#: tensor-parallel over every rank's tokens, all-gather before and reduce-scatter after (GLM-4.7-Flash)
MLP = {"deepseek_v3": "replicate", "glm_4_7_flash": "tensor"}


def _dp_rank(rank: int, families: Sequence[str], ds3_ckpt: str) -> dict:
    """Per family: build data-parallel, generate every prompt (partitioned), one prompt only (the
    other ranks idle), and rank 0 alone through a non-overlapped engine (the others pass nothing).
    Then DeepSeek-V3 from a checkpoint read by slices: every prompt."""
    om = optimize(ds3_ckpt, overrides=[*RUNTIME, *DP, *rank_overrides()])
    load = next(r for r in om.history if r.name == "load_weights").details
    out: dict = {"ckpt": {"tokens": om.generate([list(p) for p in PROMPTS], max_new_tokens=NEW), "load": load}}
    del om
    for family in families:
        om = optimize(family, overrides=[*RUNTIME, *DP, f"transforms.shard.ep_collective={COLLECTIVE[family]}",
                                         f"transforms.shard.mlp={MLP[family]}", *rank_overrides()])
        tokens = om.generate([list(p) for p in PROMPTS], max_new_tokens=NEW)
        dp_all = dict(om.last_generation["data_parallel"])
        one = om.generate([list(PROMPTS[1])], max_new_tokens=NEW)
        dp_one = dict(om.last_generation["data_parallel"])
        eng = om.engine(overlap=False)
        reqs = eng.run([list(p) for p in PROMPTS] if rank == 0 else [], SamplingParams(max_new_tokens=NEW))
        rec = next(r for r in om.history if r.name == "shard")
        failure = _fail_on_rank_1(om, rank) if family == "glm_4_7_flash" else None
        out[family] = {
            "rank": rank, "tokens": tokens, "dp_all": dp_all, "one": one, "dp_one": dp_one,
            "rank0_alone": [r.generated for r in reqs], "alone_idle_steps": eng.idle_steps,
            "alone_steps": len(eng.steps), "syncs": eng.lockstep.syncs if eng.lockstep else 0,
            "summary": rec.summary, "details": rec.details, "all_reduces": count_all_reduces(om.gm),
            "ep_nodes": [n.args[12:14] for n in om.gm.graph.nodes if n.target is EP_MOE_EXPERTS],
            "tp": om.report()["tensor_parallel"], "failure": failure,
        }
        del om
    return out


def _fail_schedule(eng: GenerationEngine, call: int, error: Exception) -> None:
    """Make the engine's scheduler raise `error` at its `call`-th call (host side, before that step's
    agreement)."""
    real, calls = eng._schedule, [0]

    def failing():
        calls[0] += 1
        if calls[0] == call:
            raise error
        return real()

    eng._schedule = failing


def _fail_on_rank_1(om, rank: int) -> dict:
    """Rank 1's scheduler raises at its third step (host side, before that step's agreement): what
    each rank's run raised, whether every page came back, and the tokens of a run made after it."""
    eng = om.engine()
    if rank == 1:
        _fail_schedule(eng, 3, ValueError("injected on rank 1"))
    free = eng.allocator.num_free
    try:
        eng.run([list(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        raised = None
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        raised = (type(exc).__name__, str(exc))
    return {"raised": raised, "pages_back": eng.allocator.num_free == free, "steps": len(eng.steps),
            "again": om.generate([list(p) for p in PROMPTS], max_new_tokens=NEW)}


def _write_ds3(out: Path) -> None:
    """The background driver's prelude: a tiny DeepSeek-V3 checkpoint (the config's seeded random weights)."""
    cfg = load_config(model_config_path("deepseek_v3"), overrides=RUNTIME)
    build_model(cfg.model, torch.device("cpu"), torch.float32).save_pretrained(out / "ds3")


def _run_two(out: Path) -> list:
    return spawn(_dp_rank, 2, FAMILIES, str(out / "ds3"), all_results=True)


# The world-2 run starts in a low-priority driver process as soon as the session's tests are collected
# (tests/background_runs.py), overlapping the single-threaded tests of the files before this one.
_BACKGROUND = BackgroundRuns(__name__, {"two": _run_two}, {"two_ranks": ["two"]}, prelude=_write_ds3)


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected


# the world-2 runs (_dp_rank; the ranks read the checkpoint _write_ds3 saved)
two_ranks = _BACKGROUND.fixture("two", "two_ranks")


@pytest.fixture(scope="module")
def single(optimized_family):
    """World-1 greedy tokens of the same prompts (the same options; the shard pass is off)."""
    return {f: optimized_family(f, [*RUNTIME, *DP]).generate([list(p) for p in PROMPTS], max_new_tokens=NEW)
            for f in FAMILIES}


def test_two_ranks_equal_one_process(single, two_ranks):  # single first: built while the ranks run
    """World 2, fp32, tiny DeepSeek-V3 (all-to-all) and GLM-4.7-Flash (all-gather + reduce-scatter):
    the requests are split across the ranks by
    tokens, each rank generates its share, and every rank returns all tokens in prompt order, equal
    to one process's greedy tokens."""
    shares = partition_by_tokens([len(p) + NEW for p in PROMPTS], 2)
    assert shares == [[1, 2, 4], [0, 3]]
    for family in FAMILIES:
        for res in two_ranks:
            r = res[family]
            assert r["tokens"] == single[family], (family, r["rank"])
            assert r["dp_all"]["requests_per_rank"] == [3, 2]
            assert r["dp_all"]["my_requests"] == shares[r["rank"]]
            assert r["dp_all"]["lockstep_syncs"] > 0


def test_checkpoint_read_by_slices(two_ranks, single):
    """DeepSeek-V3 from a checkpoint (`load: slices`): each rank reads the attention whole and only
    its experts (less than the whole model); tokens == one process of the same weights."""
    for res in two_ranks:
        assert res["ckpt"]["tokens"] == single["deepseek_v3"]
        load = res["ckpt"]["load"]
        assert 0 < load["bytes_read"] < load["full_model_bytes"]


def test_uneven_split_idle_rank_steps_with_the_others(two_ranks, single):
    """One prompt at world 2: rank 1 has no request, runs idle steps (taking part in the experts'
    all-to-all) and the generation still finishes on both; rank 0 alone through an engine
    without overlap while rank 1 passes no prompts at all."""
    for family in FAMILIES:
        r0, r1 = (res[family] for res in two_ranks)
        for r in (r0, r1):
            assert r["one"] == [single[family][1]]
            assert r["dp_one"]["requests_per_rank"] == [1, 0]
            assert r["rank0_alone"] == (single[family] if r["rank"] == 0 else [])
            assert r["alone_steps"] + r["alone_idle_steps"] == r0["alone_steps"]  # one forward per step each
        assert r0["dp_one"]["idle_steps"] == 0 and r1["dp_one"]["idle_steps"] > 0
        assert r1["alone_steps"] == 0 and r1["alone_idle_steps"] == r0["alone_steps"] > 0
        assert r0["syncs"] == r1["syncs"] == r0["alone_steps"] + 1  # the last agreement: no rank has work


def test_an_error_on_one_rank_stops_every_rank_at_the_same_step(two_ranks, single):
    """Rank 1 fails host-side mid-run: it raises its own error, rank 0 raises PeerRankFailed naming
    rank 1 and its error (no hang); both cancel their requests (pages back), and the model generates
    the same tokens afterwards (the ranks are still in step)."""
    r0, r1 = (two_ranks[r]["glm_4_7_flash"]["failure"] for r in (0, 1))
    assert r1["raised"] == ("ValueError", "injected on rank 1")
    assert r0["raised"][0] == PeerRankFailed.__name__ and "rank 1: ValueError: injected on rank 1" in r0["raised"][1]
    assert r0["pages_back"] and r1["pages_back"]
    assert r0["again"] == r1["again"] == single["glm_4_7_flash"]


def test_report_names_the_layout(two_ranks):
    """The shard report: every MLA layer `layout: data` with whole heads and the reason; the MoE layer
    expert-parallel with local tokens and capacity 0; no all-reduce in the graph."""
    for family in FAMILIES:
        for res in two_ranks:
            r = res[family]
            d = r["details"]
            assert d["attention_layout"] == "data" and r["tp"]["attention"] == "data"
            assert d["attention"] and all(e["layout"] == "data" and "(whole)" in e["heads"]
                                          and "attention: data" in e["why"] for e in d["attention"])
            entry, = d["experts"]
            assert entry["layout"] == "expert" and entry["tokens"] == "local" and entry["capacity"] == 0
            assert entry["collective"] == COLLECTIVE[family]
            assert "routing local" in entry["why"]
            # capacity 0: every rank passes the same token count (the lock-step pads each step to the
            # agreed size; with different counts the ranks' all-to-all splits would not match)
            assert r["ep_nodes"] == [("local", 0)]
            assert r["all_reduces"] == 0 and d["all_reduces"] == 0
            assert "data-parallel" in r["summary"] and "0 all-reduces" in r["summary"]
            assert all("configured" in e["why"] for e in d["replicated"])  # dense and shared MLPs
            if MLP[family] == "replicate":
                assert d["replicated"] and not d["mlp"] and d["gather_scatter"] == 0
            else:  # every dense / shared MLP split, one all-gather (or two) before it, one reduce-scatter after
                assert d["mlp"] and not d["replicated"]
                assert all("all-gather before, reduce-scatter after" in e["layout"] for e in d["mlp"])
                assert 2 * len(d["mlp"]) <= d["gather_scatter"] <= 3 * len(d["mlp"])
                assert f"around {len(d['mlp'])} tensor-parallel MLPs" in r["summary"]


def _shard_ctx(world: int):
    cfg = load_config(model_config_path("deepseek_v3"), overrides=RUNTIME)
    pipeline = parse_pipeline(cfg.transforms)
    model = build_model(cfg.model, torch.device("cpu"), torch.float32)
    ctx = BuildContext(cfg, model, torch.device("cpu"), torch.float32, Target.detect("cpu", 4))
    for info, opts in pipeline.steps:
        if info.name in ("export", "match_mla"):
            info.fn(ctx, opts)
    ctx.world = TensorParallel(world, 0, "0")
    return ctx, next(i for i, _ in pipeline.steps if i.name == "shard")


def test_refused_combinations_name_the_options():
    """attention: data with tensor-parallel (or replicated) experts: refused at planning, before the
    graph changes, naming the values and what to set (tensor-parallel MLPs are allowed: gathered)."""
    ctx, info = _shard_ctx(2)
    before = ctx.gm.code
    cases = [({"experts": "tensor", "mlp": "tensor"}, r"with experts=tensor \(set transforms\.shard\.experts=expert"),
             ({"experts": "replicate", "mlp": "replicate"}, r"with experts=replicate \(set transforms\.shard\."
                                                            r"experts=expert")]
    for opts, msg in cases:
        with pytest.raises(ShardError, match=r"attention=data .*" + msg + r".*experts under data-parallel attention "
                                             r"are not built"):
            info.fn(ctx, info.options.model_validate({"enabled": True, "attention": "data", **opts}))
        assert ctx.gm.code == before


def test_ep_collective_auto_takes_the_gather_scatter_under_data_parallel_attention():
    """auto: allgather_reducescatter under attention: data (measured faster on 2 H200s), all_to_all under
    tensor-parallel attention; a configured value is kept; each says why (the MoE report entry's
    `collective_why`)."""
    from autodeploy_mla.transforms.shard import ShardOptions, ep_collective_of

    data = ShardOptions(enabled=True, attention="data", experts="expert", mlp="replicate")
    assert data.ep_collective == "auto"
    coll, why = ep_collective_of(data)
    assert coll == "allgather_reducescatter" and "data-parallel attention" in why
    assert ep_collective_of(ShardOptions(enabled=True, experts="expert"))[0] == "all_to_all"
    pinned = ShardOptions(enabled=True, attention="data", experts="expert", mlp="replicate", ep_collective="all_to_all")
    assert ep_collective_of(pinned) == ("all_to_all", "ep_collective: all_to_all (configured)")


def test_partition_by_tokens():
    """Longest first to the least-loaded rank; deterministic; ranks may get nothing."""
    assert partition_by_tokens([10, 1, 1, 1, 7], 2) == [[0], [1, 2, 3, 4]]
    assert partition_by_tokens([5], 3) == [[0], [], []]
    assert partition_by_tokens([], 2) == [[], []]
    shares = partition_by_tokens([3, 9, 4, 4, 8, 1, 6], 3)
    assert sorted(i for s in shares for i in s) == list(range(7))
    loads = [sum([3, 9, 4, 4, 8, 1, 6][i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= 2
    with pytest.raises(ValueError, match="world_size=0"):
        partition_by_tokens([1], 0)


# ----------------------------------------------------------------------------- the engine's lock-step, no ranks
class _FakeLockstep:
    """Another rank that has a batch of `peer_tokens` tokens for `busy` more steps."""

    def __init__(self, busy: int, peer_tokens: int = 1) -> None:
        self.busy, self.syncs, self.peer_tokens = busy, 0, peer_tokens

    def agree(self, has_batch: bool, has_work: bool, failed: bool = False, tokens: int = 0,
              staying: bool = True) -> StepAgreement:
        self.syncs += 1
        other = self.busy > 0
        self.busy -= 1
        return StepAgreement(has_batch or other, has_work or other, tokens=max(tokens, self.peer_tokens if other else 0))


class _FakeRunner:
    """Next token = last + 1; counts forwards and idle steps."""

    def __init__(self) -> None:
        self.seq_info = SequenceInfo(4, 8, 64, 4, torch.device("cpu"))
        self.forwards = self.idle = 0
        self.pads: list = []  # (own step size, pad_to) per forward and idle step

    def step_size(self, seqs):
        return sum(len(s.token_ids) for s in seqs)

    def launch(self, seqs, pages_of, specs, prompt_rows=None, pad_to=None):
        self.pads.append((self.step_size(seqs), pad_to))
        self.forwards += 1
        info = self.seq_info
        info.prepare_step(seqs, pages_of)
        ids = [s.token_ids[-1] + 1 for s in seqs]

        class L:
            order = [s.seq_id for s in seqs]
            num_prefill_tokens, num_decode_seqs = info.num_prefill_tokens, info.num_decode_seqs
        L.ids = ids
        return L

    def collect(self, launched):
        return StepOutput(launched.ids, {}, {})

    def release(self, seq_id):
        pass

    def idle_step(self, pad_to=None):
        self.pads.append((0, pad_to))
        self.idle += 1


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_lockstep_idles_while_a_peer_works(overlap):
    """The engine with a lock-step: it runs its requests, then idle steps while the (fake) other rank
    still has a batch, and returns when no rank has work; one agreement per step."""
    runner = _FakeRunner()
    lock = _FakeLockstep(busy=6, peer_tokens=3)
    eng = GenerationEngine(runner, PageAllocator(64, 4), overlap=overlap, prefix_caching=False, lockstep=lock)
    reqs = eng.run([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert reqs[0].generated == [4, 5] if not overlap else len(reqs[0].generated) == 2
    assert runner.forwards == 2 and runner.idle == 4 and eng.idle_steps == 4
    assert not eng.peers_busy and lock.syncs == len(eng.steps) + eng.idle_steps + 1  # + the last: no work
    # every step padded to the agreed size: the prefill (3 tokens) runs as 3, the decode step and the
    # idle steps as the peer's 3-token steps
    assert runner.pads[0] == (3, 3) and all(p == 3 for _, p in runner.pads) and len(runner.pads) == 6
    # no lock-step: no agreement, no idle step
    runner2 = _FakeRunner()
    GenerationEngine(runner2, PageAllocator(64, 4), overlap=overlap, prefix_caching=False).run(
        [[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert runner2.idle == 0 and runner2.forwards == 2 and all(p is None for _, p in runner2.pads)  # no padding


def _dp4_rank(rank: int) -> dict:
    om = optimize("glm_4_7_flash", overrides=[*RUNTIME, *DP, f"transforms.shard.mlp={MLP['glm_4_7_flash']}",
                                             *rank_overrides()])
    tokens = om.generate([list(p) for p in PROMPTS], max_new_tokens=NEW)
    dp = dict(om.last_generation["data_parallel"])
    one = om.generate([list(PROMPTS[0])], max_new_tokens=NEW)
    return {"tokens": tokens, "dp": dp, "one": one, "idle": om.last_generation["data_parallel"]["idle_steps"]}


@pytest.mark.slow
def test_four_ranks_equal_one_process(request, single):
    """World 4 (2 experts per rank, dense and shared MLPs split in 4 and gathered), GLM-4.7-Flash: five
    prompts over four ranks, then one prompt (three ranks idle). ~35 s more on 2 CPU cores (the file stays under a minute without it): --slow only."""
    if not request.config.getoption("--slow"):
        pytest.skip("4 CPU ranks: ~35 s more on a 2-core host; run with --slow")
    ranks = spawn(_dp4_rank, 4, all_results=True)
    shares = partition_by_tokens([len(p) + NEW for p in PROMPTS], 4)
    for r, res in enumerate(ranks):
        assert res["tokens"] == single["glm_4_7_flash"], r
        assert res["dp"]["my_requests"] == shares[r]
        assert res["one"] == [single["glm_4_7_flash"][0]]
        assert (res["idle"] > 0) == (r != 0)


class _FailingPeer(_FakeLockstep):
    """The other rank: busy, then it fails at agreement `fail_at`; records this rank's leave()."""

    def __init__(self, busy: int, fail_at: int) -> None:
        super().__init__(busy)
        self.fail_at, self.left, self.rank = fail_at, [], 0

    def agree(self, has_batch: bool, has_work: bool, failed: bool = False, tokens: int = 0,
              staying: bool = True) -> StepAgreement:
        a = super().agree(has_batch, has_work, tokens=tokens)
        return StepAgreement(a.any_batch, a.any_work, failed or self.syncs == self.fail_at, a.tokens)

    def failures(self, mine):
        return {1: "RuntimeError: out of memory"} | ({0: mine} if mine else {})

    def leave(self, error: str):
        self.left.append(error)
        return self.failures(error)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_stops_when_a_peer_fails_and_tells_the_peers_when_it_fails(overlap):
    """A peer's failure at an agreement: this rank raises PeerRankFailed (naming the rank and its error)
    with its requests cancelled and pages back, and does not call leave(). This rank's own error: it
    calls leave() with the error text, once, and raises the error itself."""
    alloc = PageAllocator(64, 4)
    free = alloc.num_free
    lock = _FailingPeer(busy=8, fail_at=3)
    eng = GenerationEngine(_FakeRunner(), alloc, overlap=overlap, prefix_caching=False, lockstep=lock)
    with pytest.raises(PeerRankFailed, match=r"rank\(s\) \[1\] failed \(rank 1: RuntimeError: out of memory\)"):
        eng.run([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert lock.left == [] and alloc.num_free == free
    assert all(r.finish_reason == "cancelled" for r in eng.done.values())

    lock = _FailingPeer(busy=8, fail_at=-1)
    eng = GenerationEngine(_FakeRunner(), alloc, overlap=overlap, prefix_caching=False, lockstep=lock)
    _fail_schedule(eng, 2, ValueError("bad step"))
    with pytest.raises(ValueError, match="bad step"):
        eng.run([[1, 2, 3]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert lock.left == ["ValueError: bad step"] and alloc.num_free == free

    # an error after the last agreement (no rank has work: the others left their loops): not announced
    lock = _FailingPeer(busy=0, fail_at=-1)
    eng = GenerationEngine(_FakeRunner(), alloc, overlap=overlap, prefix_caching=False, lockstep=lock)

    def failing_drain():
        raise ValueError("bad drain")

    eng.drain = failing_drain
    with pytest.raises(ValueError, match="bad drain"):
        eng.run([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert lock.left == [] and alloc.num_free == free


def test_engine_lockstep_cancel_on_one_rank():
    """A request cancelled on this rank finishes at once (pages back); the rank keeps stepping (idle)
    in lock-step while the other rank works, and returns with it."""
    runner = _FakeRunner()
    lock = _FakeLockstep(busy=8)
    alloc = PageAllocator(64, 4)
    eng = GenerationEngine(runner, alloc, overlap=True, prefix_caching=False, lockstep=lock)
    free = alloc.num_free
    cancelled = []

    def on_tokens(new):
        for rid, _ in new:
            if rid == 0 and not cancelled:
                cancelled.append(eng.cancel(rid))

    reqs = eng.run([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=6, ignore_eos=True), on_tokens)
    assert cancelled == [True] and reqs[0].finish_reason == "cancelled" and len(reqs[0].generated) == 1
    assert reqs[1].finish_reason == "length" and len(reqs[1].generated) == 6
    assert eng.idle_steps > 0 and lock.syncs == len(eng.steps) + eng.idle_steps + 1 and not eng.peers_busy
    assert alloc.num_free == free
