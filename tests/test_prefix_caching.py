"""Automatic prefix caching (docs/prefix_caching.md): requests take the cached full prompt pages of
earlier ones and prefill only the rest.

On the tiny fp32 model: shared-prefix workloads (a shared system prompt, a multi-turn chat, a
prompt cached whole, n > 1 choices over a cached prefix), one request at a time and all at once,
give the same greedy tokens with caching on and off, equal to HF eager, with `cached_tokens` at
least the shared full pages; a cache that holds two sequences evicts and runs every request that
fits, every page back; a request cancelled mid-prefill while others share its prefix leaves them
right. Without a model: the allocator's invariants under random operation streams (hypothesis),
and the engine over a fake device that checks every cache read against what was written (and that
a page read through the cache was written by a COMPLETED step), under random request streams with
cancellations and failing steps.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy_mla.runtime import OutOfPagesError, PageAllocator
from autodeploy_mla.runtime.engine import GenerationEngine
from autodeploy_mla.runtime.prefix_cache import cache_identity, page_keys
from autodeploy_mla.runtime.sampling import SamplingParams, StepOutput
from autodeploy_mla.runtime.sequence_info import SequenceInfo
from autodeploy_mla.serving import bench
from autodeploy_mla.testing import hf_greedy_generate
from background_runs import BackgroundRuns, run_module

BASE = ("model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=40",
        "runtime.max_num_tokens=10", "runtime.max_batch_size=3")
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SYSTEM = [(11 * i + 5) % 250 + 2 for i in range(11)]  # 2 full pages + 3 tokens
SUFFIXES = [[(13 * i + 7 * k) % 250 + 2 for i in range(3 + k)] for k in range(4)]


@pytest.fixture(scope="module")
def om(optimized_family):
    return optimized_family("default", BASE)


@pytest.fixture(autouse=True)
def _clean_cache(request):
    if "om" in request.fixturenames:
        request.getfixturevalue("om").allocator.clear_cache()


def _hf(om, prompts, n=GREEDY.max_new_tokens):
    return [hf_greedy_generate(om.eager_model, p, n, ignore_eos=True) for p in prompts]


def _run(om, prompts, caching, one_by_one, params=GREEDY):
    om.allocator.clear_cache()
    eng = om.engine(prefix_caching=caching)
    reqs = [eng.run([p], params)[0] for p in prompts] if one_by_one else eng.run(prompts, params)
    assert om.allocator.num_free == om.allocator.num_usable and om.allocator.owners() == {}
    om.allocator.check()
    return reqs


def _multi_turn(om, turns=3):
    """Each turn's prompt: the previous prompt + its greedy answer + a new question."""
    prompt, prompts = list(SYSTEM), []
    for t in range(turns):
        prompt = prompt + [(17 * t + 3 * i) % 250 + 2 for i in range(2 + t)]
        prompts.append(prompt)
        prompt = prompt + _hf(om, [prompt])[0]
    return prompts


@pytest.mark.parametrize("one_by_one", [True, False], ids=["one-by-one", "together"])
def test_shared_system_prompt_same_tokens_as_caching_off_and_hf(om, one_by_one):
    prompts = [SYSTEM + s for s in SUFFIXES]
    want = _hf(om, prompts)
    off = _run(om, prompts, caching=False, one_by_one=one_by_one)
    on = _run(om, prompts, caching=True, one_by_one=one_by_one)
    assert [r.generated for r in off] == want
    assert [r.generated for r in on] == want
    assert [r.cached_tokens for r in off] == [0] * 4
    shared = len(SYSTEM) // 4 * 4
    # the first prefills the system prompt; the others (together: they wait for its pages) take it
    assert on[0].cached_tokens == 0 and all(r.cached_tokens >= shared for r in on[1:])


def test_multi_turn_chat_takes_every_earlier_turn(om):
    prompts = _multi_turn(om)
    want = _hf(om, prompts)
    off = _run(om, prompts, caching=False, one_by_one=True)
    on = _run(om, prompts, caching=True, one_by_one=True)
    assert [r.generated for r in on] == [r.generated for r in off] == want
    for prev, r in zip(prompts, on[1:]):  # turn t takes the full pages of turn t-1's prompt
        assert r.cached_tokens >= len(prev) // 4 * 4


def test_a_prompt_cached_whole_recomputes_its_last_token(om):
    prompt = SYSTEM[:8] + [9, 8, 7, 6]  # 3 full pages
    eng = om.engine()
    first, again = eng.run([prompt], GREEDY)[0], eng.run([prompt], GREEDY)[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 8  # the last page is its own (last token)
    assert again.generated == first.generated == _hf(om, [prompt])[0]
    assert om.allocator.num_cached >= 3 and om.allocator.num_free == om.allocator.num_usable
    om.allocator.check()


def test_all_workloads_together_same_tokens_as_caching_off(om):
    prompts = [SYSTEM + s for s in SUFFIXES] + _multi_turn(om, 2) + [SYSTEM[:8] + [9, 8, 7, 6]] * 2 + [[3, 4, 5]]
    off = _run(om, prompts, caching=False, one_by_one=False)
    on = _run(om, prompts, caching=True, one_by_one=False)
    assert [r.generated for r in on] == [r.generated for r in off] == _hf(om, prompts)
    assert sum(r.cached_tokens for r in on) >= 3 * 8 + 8  # the system prompt's pages, the repeat's


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_choices_over_a_cached_prefix(om, overlap):
    """n > 1: choice 0 takes the cached system prompt, the others share choice 0's pages (fork)."""
    prompt = SYSTEM + SUFFIXES[3]  # 17 tokens: 4 full pages before the last token
    eng = om.engine(overlap=overlap)
    eng.run([SYSTEM + SUFFIXES[0]], GREEDY)  # caches the system prompt's 2 full pages
    ids = eng.add_group(prompt, GREEDY, 3)
    while eng.has_work():
        eng.step()
    reqs = [eng.request(i) for i in ids]
    assert [r.generated for r in reqs] == _hf(om, [prompt]) * 3
    assert reqs[0].cached_tokens == 8 and [r.cached_tokens for r in reqs[1:]] == [16, 16]
    assert om.allocator.num_free == om.allocator.num_usable and om.allocator.owners() == {}
    om.allocator.check()


def test_eviction_in_a_cache_that_holds_two_sequences(optimized_family):
    # 19 tokens (15 prompt + 4 new) need 5 pages: 10 usable pages hold two such sequences
    om = optimized_family("default", BASE + ("runtime.num_pages=11",))
    alloc = om.allocator
    alloc.clear_cache()
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [[(19 * i + 31 * k) % 250 + 2 for i in range(15)] for k in range(5)]
    prompts += [prompts[0], prompts[4], prompts[4][:9] + [5, 6, 7]]  # an evicted one, a cached one, a partial
    eng = om.engine()
    got = eng.run(prompts, params)
    assert all(r.finish_reason == "length" for r in got)
    assert [r.generated for r in got] == _hf(om, prompts, 4)
    assert alloc.num_evicted > 0 and alloc.num_free == alloc.num_usable and alloc.owners() == {}
    assert alloc.num_cached <= alloc.num_usable
    alloc.check()
    # every page is free or evictable: a request that needs the whole cache still fits
    big = eng.run([[7] * 36], params)[0]
    assert big.finish_reason == "length" and alloc.num_free == alloc.num_usable
    alloc.check()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_cancel_mid_prefill_of_a_request_whose_prefix_others_share(om, overlap):
    long_sys = [(23 * i + 1) % 250 + 2 for i in range(24)]  # 6 full pages: prefills in 3 steps of 10
    prompts = [long_sys + [40 + k, 41, 42] for k in range(3)]
    eng = om.engine(overlap=overlap)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    eng.step()  # request 0 has written (some of) the shared pages; the others wait for them
    assert eng.request(ids[0]).num_scheduled < len(prompts[0])
    assert eng.cancel(ids[0])
    while eng.has_work():
        eng.step()
    reqs = [eng.request(i) for i in ids]
    assert reqs[0].finish_reason == "cancelled"
    assert [r.generated for r in reqs[1:]] == _hf(om, prompts[1:])
    assert reqs[2].cached_tokens >= 24  # request 1 wrote the whole shared prompt, request 2 took it
    assert om.allocator.num_free == om.allocator.num_usable and om.allocator.owners() == {}
    om.allocator.check()


BACKENDS = {  # backend -> (family, its tiny-config overrides); FlashInfer: see docs/prefix_caching.md
    "triton": ("default", ("transforms.insert_cached_mla_attention.backend=triton",)),
    "torch sparse (DSA)": ("deepseek_v32", ()),
    "triton sparse (DSA)": ("deepseek_v32", ("transforms.insert_cached_mla_attention.backend=triton",)),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_other_backends_read_a_cached_prefix_through_the_page_table(backend):
    """Prefill that starts after pages another request wrote (and, for DSA, their index keys in the
    same page ids): the Triton ops (interpreted) and the sparse ops give caching-off's tokens and HF's."""
    from autodeploy_mla import optimize
    from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS, build_tiny_model

    family, extra = BACKENDS[backend]
    model = build_tiny_model(TINY_CONFIGS[family]) if family != "default" else None
    om = optimize(model if model is not None else family, overrides=[*BASE, *extra])
    model = model if model is not None else om.eager_model
    prompts = [SYSTEM + s for s in SUFFIXES[:3]]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    off = om.engine(prefix_caching=False).run(prompts, params)
    on = om.engine(prefix_caching=True).run(prompts, params)
    assert [r.generated for r in on] == [r.generated for r in off] == [
        hf_greedy_generate(model, p, 3, ignore_eos=True) for p in prompts]
    assert [r.cached_tokens for r in on] == [0, 8, 8]
    om.allocator.check()


def test_cached_tokens_and_report(om):
    reqs = om.generate_requests([SYSTEM + SUFFIXES[0], SYSTEM + SUFFIXES[1]], GREEDY)
    gen = om.last_generation
    assert gen["cached_tokens"] == sum(r.cached_tokens for r in reqs) == 8
    pc = gen["prefix_cache"]
    assert pc["enabled"] and pc["hit_tokens"] == 8 and pc["query_tokens"] == sum(len(r.prompt) for r in reqs)
    assert om.report()["cache"]["prefix_cache"]["pages_cached"] == om.allocator.num_cached >= 2


def test_bench_prefix_workloads_in_process(om):
    """`autodeploy bench --shared-prefix` / `--multi-turn`: the workloads run, later turns carry the
    earlier turns' prompts and answers, and the report gives TTFT per turn and the cached tokens."""
    shared = bench.Workload.shared_prefix(4, 12, (2, 4), (3, 3), om.vocab_size, seed=1)
    assert len({tuple(r.prompt[:12]) for r in shared.requests}) == 1
    res = bench.run_in_process(om, shared)
    assert res["failed"] == 0 and res["prefix_hit_tokens"] >= 3 * 12 and res["cached_tokens"] >= 3 * 12
    chat = bench.Workload.multi_turn(2, 3, (6, 6), (2, 2), (3, 3), om.vocab_size, seed=2)
    assert [r.turn for r in chat.requests] == [0, 1, 2] * 2 and chat.prompt_len(2) == 6 + 3 + 2 + 3 + 2
    res = bench.run_in_process(om, chat)
    assert res["failed"] == 0 and sorted(res["per_turn"]) == ["0", "1", "2"]
    # turn t takes the full pages of turn t-1's prompt: 4 of turn 0's 6 tokens, 8 of turn 1's 11
    assert res["cached_tokens"] == 2 * (4 + 8)
    assert any("turn 2 TTFT" in line for line in bench.result_table([res]))
    with pytest.raises(ValueError, match="turn 2"):
        chat.check_fits(16, "this config")


def _benchmark_quick(out: Path) -> dict:
    return run_module("benchmarks.serving.prefix_caching", out, "--quick")


# The benchmark's quick run (three server processes) in a low-priority background driver from the start
# of the session (tests/background_runs.py), overlapping the tests before this file.
_BACKGROUND = BackgroundRuns(__name__, {"quick": _benchmark_quick}, {"benchmark_quick": ["quick"]})


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected
benchmark_quick = _BACKGROUND.fixture("quick", "benchmark_quick")


def test_prefix_caching_benchmark_quick(benchmark_quick):
    """benchmarks/serving/prefix_caching.py --quick: the three workloads, caching off, on, off again in
    three processes, table + JSON (+ plot when matplotlib is there); the tokens per run are what was asked
    for, and the no-sharing row is judged against the two off runs' spread."""
    doc = json.loads(benchmark_quick["prefix_caching.json"])
    for side in ("on", "off", "off_again"):
        assert sorted(doc[side]["runs"]) == ["multi-turn", "no sharing", "shared prefix"]
        for name, r in doc[side]["runs"].items():
            assert r["failed"] == 0, (side, name, r["errors"])
    assert doc["on"]["runs"]["shared prefix"]["prefix_hit_tokens"] >= 7 * 48
    assert doc["off"]["runs"]["shared prefix"].get("cached_tokens", 0) == 0
    assert sorted(doc["on"]["runs"]["multi-turn"]["per_turn"]) == ["0", "1", "2"]
    assert doc["on"]["runs"]["no sharing"].get("prefix_hit_tokens", 0) == 0
    assert "nosharing_noise_throughput" in doc["summary"]
    md = benchmark_quick["prefix_caching.md"]
    assert "TTFT p50 ms per turn" in md and "No sharing, on / mean of the two off runs" in md


# ----------------------------------------------------------------------------- the allocator alone
def test_page_keys_chain_and_identity():
    ident = cache_identity(["model", "float32", 4])
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, ident)
    b = page_keys([1, 2, 3, 4, 5, 6, 7, 9], 4, ident)
    c = page_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, ident)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # same page tokens, other parent
    assert page_keys([1, 2, 3, 4], 4, cache_identity(["model", "float32", 8])) != a[:1]
    assert page_keys([1, 2, 3], 4, ident) == [] and page_keys(list(range(12)), 4, ident, 2) == page_keys(
        list(range(8)), 4, ident)


def test_allocator_evicts_lru_and_never_hands_out_a_keyed_page():
    a = PageAllocator(6, 2)  # 5 usable
    k = [bytes([i]) * 32 for i in range(5)]
    a.ensure(1, 4)
    assert a.register(1, k[:2]) == 2
    a.ensure(2, 4)
    a.register(2, k[2:4])
    a.free(1)
    a.free(2)
    assert a.num_free == 5 and a.num_cached == 4 and a.num_evictable == 4
    assert a.take_prefix(3, [k[2], k[3]]) == 2  # cache hit: the pages come back held
    a.ensure(4, 6)  # 3 pages: the free one, then the least recently released (sequence 1's tail first)
    assert a.match_prefix(k[:2]) == 0 and a.num_evicted == 2
    a.check()
    with pytest.raises(OutOfPagesError, match="evictable"):
        a.ensure(5, 2)
    a.free(3)
    a.free(4)
    assert a.num_free == 5
    a.check()


OPS = st.lists(st.tuples(st.sampled_from(["take", "grow", "register", "free", "fork", "clear"]),
                         st.integers(0, 5), st.integers(0, 5), st.integers(0, 12)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_allocator_invariants_under_random_operations(ops):
    """Refcounts equal holders, no page both free and held (or evictable), key <-> page one to one,
    keyed pages hold what they were registered with, and every page comes back."""
    a = PageAllocator(12, 2, max_pages_per_seq=6)
    keys = [bytes([i]) * 32 for i in range(8)]
    content: dict[int, bytes] = {}  # page -> the key of what was written into it (our model of the cache)
    for op, seq, other, n in ops:
        if op == "take" and not a.pages_of(seq):
            taken = a.take_prefix(seq, keys[: n % 6])
            assert all(content[p] == keys[i] for i, p in enumerate(a.pages_of(seq)[:taken]))
        elif op == "grow":
            before = set(a.pages_of(seq))
            try:
                a.ensure(seq, n)
            except OutOfPagesError:
                pass
            for p in set(a.pages_of(seq)) - before:
                assert a.key_of(p) is None  # a handed-out page is never still cached
                content[p] = b"written by %d" % seq
        elif op == "register":
            pages = a.pages_of(seq)
            m = min(len(pages), n % 6)
            # as the engine does: the sequence's page i holds key i's tokens once written
            before = {i: a.key_of(pages[i]) for i in range(m)}
            a.register(seq, keys[:m])
            for i in range(m):
                if before[i] is None and a.key_of(pages[i]) == keys[i]:
                    content[pages[i]] = keys[i]
        elif op == "free":
            a.free(seq)
        elif op == "fork" and seq != other and not a.pages_of(seq):
            a.fork(seq, other, min(n, len(a.pages_of(other))))
        elif op == "clear":
            a.clear_cache()
        a.check()
        for p in range(1, a.num_pages):  # what the cache says a keyed page holds, it holds
            if (k := a.key_of(p)) is not None:
                assert content[p] == k
    for s in list(a.owners()):
        a.free(s)
    assert a.num_free == a.num_usable
    a.check()


# ----------------------------------------------------------------------------- the engine, a fake device
@dataclass
class _Launched:
    order: list[int]
    ids: list[int]
    num_prefill_tokens: int
    num_decode_seqs: int
    step: int


class _FakeDevice:
    """A StepRunner whose 'cache' holds, per slot, the token history the slot was written with.
    Every read of a cached position checks the history is coherent; a position written by another
    sequence must have been written by a step already collected (prefix-cache pages), unless the
    reader is a choice of the writer's group (fork: ordered by the stream). The sampled token is a
    function of the history read from the cache, so a wrong page changes the tokens."""

    def __init__(self, info: SequenceInfo, vocab: int = 50, fail_every: int = 0) -> None:
        self.seq_info = info
        self.vocab = vocab
        self.slots: dict[tuple[int, int], tuple[tuple[int, ...], int, int]] = {}  # -> (history, seq, step)
        self.launches = 0
        self.collected = -1  # the last collected step
        self.prev: list[int] = []
        self.fail_every = fail_every
        self.groups: dict[int, int] = {}  # seq -> its group's choice-0 seq

    def launch(self, seqs, pages_of, specs, prompt_rows=None) -> _Launched:
        step = self.launches
        self.launches += 1
        if self.fail_every and step % self.fail_every == self.fail_every - 1:
            raise RuntimeError("the fake device failed")
        ps = self.seq_info.page_size
        order = self.seq_info.prepare_step(seqs, pages_of)
        by_id = {s.seq_id: s for s in seqs}
        ids, pre = [], 0
        for sid in order:
            s = by_id[sid]
            pages = pages_of(sid)
            hist: tuple[int, ...] = ()
            for p in range(s.num_cached):
                got = self.slots.get((pages[p // ps], p % ps))
                assert got is not None, f"seq {sid} reads position {p}, never written"
                h, writer, wstep = got
                assert len(h) == p + 1 and h[:p] == hist, f"seq {sid} reads a stale/foreign slot at {p}"
                if writer != sid and self.groups.get(sid) != self.groups.get(writer, writer):
                    assert wstep <= self.collected, f"seq {sid} reads position {p} that step {wstep} still writes"
                hist = h
            toks = [self.prev[s.src_row]] if s.src_row is not None else list(s.token_ids)
            for j, t in enumerate(toks):
                p = s.num_cached + j
                hist = hist + (t,)
                self.slots[(pages[p // ps], p % ps)] = (hist, sid, step)
            ids.append(sum((i + 1) * t for i, t in enumerate(hist)) % self.vocab)
            pre += 0 if s.is_decode else len(toks)
        self.prev = ids
        return _Launched(order, ids, pre, sum(by_id[i].is_decode for i in order), step)

    def collect(self, launched: _Launched) -> StepOutput:
        self.collected = launched.step  # steps complete in launch order
        return StepOutput(list(launched.ids), {}, {})

    def release(self, seq_id: int) -> None:
        pass


def _fake_engine(caching: bool, overlap: bool, num_pages: int = 24, fail_every: int = 0):
    info = SequenceInfo(max_batch_size=4, max_num_tokens=8, max_seq_len=32, page_size=2)
    dev = _FakeDevice(info, fail_every=fail_every)
    alloc = PageAllocator(num_pages, 2, info.max_pages_per_seq)
    return GenerationEngine(dev, alloc, vocab_size=50, overlap=overlap, prefix_caching=caching,
                            cache_identity=b"fake"), dev, alloc


STREAMS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(1, 6), st.integers(1, 3),
                             st.booleans()), min_size=1, max_size=14)


def _drive_stream(stream, caching, overlap, num_pages=24, fail_every=0, cancel_seed=None) -> dict[int, Any]:
    eng, dev, alloc = _fake_engine(caching, overlap, num_pages, fail_every)
    bases = [[(7 * b + 3 * i) % 49 + 1 for i in range(14)] for b in range(4)]
    rng = random.Random(cancel_seed)
    ids = []
    for i, (base, cut, tail, n, wait) in enumerate(stream):
        prompt = bases[base][:cut] + [(i + 5 * j) % 49 + 1 for j in range(tail)]
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        got = eng.add_group(prompt, params, n) if n > 1 else [eng.add_request(prompt, params)]
        for g in got:
            dev.groups[g] = got[0]
        ids += got
        for _ in range(2 if wait else 0):
            try:
                eng.step()
            except RuntimeError:
                eng.abandon_inflight("the fake device failed")
            if cancel_seed is not None and rng.random() < 0.3:
                eng.cancel(rng.choice(ids))
            alloc.check()
    while eng.has_work():
        try:
            eng.step()
        except RuntimeError:
            eng.abandon_inflight("the fake device failed")
        if cancel_seed is not None and rng.random() < 0.2:
            eng.cancel(rng.choice(ids))
        alloc.check()
    assert alloc.owners() == {} and alloc.num_free == alloc.num_usable
    alloc.check()
    return {i: eng.request(i) for i in ids}


@settings(max_examples=60, deadline=None)
@given(STREAMS, st.booleans())
def test_engine_over_random_streams_same_tokens_and_no_early_reads(stream, overlap):
    off = _drive_stream(stream, caching=False, overlap=overlap)
    on = _drive_stream(stream, caching=True, overlap=overlap)
    assert {i: r.generated for i, r in on.items()} == {i: r.generated for i, r in off.items()}
    assert all(r.finish_reason == "length" for r in on.values())


@settings(max_examples=40, deadline=None)
@given(STREAMS, st.booleans(), st.integers(0, 2**16), st.sampled_from([0, 5, 7]), st.sampled_from([10, 24]))
def test_engine_under_cancellation_failures_and_pressure_returns_every_page(stream, overlap, seed, fail_every,
                                                                             num_pages):
    got = _drive_stream(stream, caching=True, overlap=overlap, num_pages=num_pages, fail_every=fail_every,
                        cancel_seed=seed)
    ref = _drive_stream(stream, caching=False, overlap=overlap, num_pages=64)
    for i, r in got.items():  # whatever finished normally has the tokens of an undisturbed run
        if r.finish_reason == "length":
            assert r.generated == ref[i].generated
