"""Several choices of one prompt (`GenerationEngine.add_group`, OpenAI's `n`): the choices share
the prompt's full cache pages (reference-counted in the PageAllocator) and prefill only the tail;
their tokens are what separate requests give (greedy: identical; seeded: choice i is seed + i);
shared pages are counted once and every page comes back, also when choice 0 or another choice is
cancelled before or after the sharing, mid-prefill or mid-decode, and when the cache is short."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy_mla.runtime import SCRATCH_PAGE, OutOfPagesError, PageAllocator, RequestError
from autodeploy_mla.runtime.sampling import SamplingParams
from autodeploy_mla.testing import hf_greedy_generate

BASE = ("model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=40",
        "runtime.max_num_tokens=10", "runtime.max_batch_size=3")
PROMPT = [(5 * i + 2) % 251 + 1 for i in range(13)]  # 3 full pages shared (12 tokens), a 1-token tail
LONG = [(7 * i + 3) % 251 + 1 for i in range(25)]  # 6 full pages shared; choice 0 prefills in 3 steps
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def om(optimized_family):
    return optimized_family("default", BASE)


@pytest.fixture(autouse=True)
def _no_cached_prefixes(om):
    """These tests are about the fork path: choice 0 prefills the prompt, nothing cached by an earlier
    test gives it a head start (tests/test_prefix_caching.py covers how the two compose)."""
    om.allocator.clear_cache()


def _pages(om, prompt_len, new):
    return om.allocator.pages_needed(prompt_len + new)


def _drive(eng, on_step=None):
    """Step until the engine is idle; `on_step(eng, i)` after step i."""
    i = 0
    while eng.has_work():
        eng.step()
        if on_step is not None:
            on_step(eng, i)
        i += 1


def _record_steps(om, monkeypatch):
    """The StepSequences of every launched step, in order."""
    steps: list[list] = []
    launch = om.runner.launch

    def rec(seqs, *a, **k):
        steps.append(list(seqs))
        return launch(seqs, *a, **k)

    monkeypatch.setattr(om.runner, "launch", rec)
    return steps


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_choices_share_pages_and_equal_a_plain_request(om, overlap, monkeypatch):
    steps = _record_steps(om, monkeypatch)
    eng = om.engine(overlap=overlap)
    ids = eng.add_group(PROMPT, GREEDY, 3)
    alloc = om.allocator
    used: list[int] = []
    refs: list[int] = []
    _drive(eng, lambda e, i: (used.append(alloc.num_usable - alloc.num_free),
                              refs.append(max((alloc.refcount(p) for p in alloc.pages_of(ids[0])), default=0))))
    want = hf_greedy_generate(om.eager_model, PROMPT, 6)
    assert [eng.request(i).generated for i in ids] == [want] * 3
    assert [eng.request(i).choice for i in ids] == [0, 1, 2]
    assert [eng.request(i).shared_tokens for i in ids] == [0, 12, 12]
    full, shared = _pages(om, len(PROMPT), 6), (len(PROMPT) - 1) // 4
    assert max(used) == full + 2 * (full - shared)  # the shared pages counted once
    assert max(refs) == 3
    assert alloc.num_free == alloc.num_usable and alloc.owners() == {}
    # the others start after choice 0's step that queued the shared pages, with only the tail
    first = {sid: next(i for i, st in enumerate(steps) if any(s.seq_id == sid for s in st)) for sid in ids}
    assert first[ids[1]] > first[ids[0]] and first[ids[2]] > first[ids[0]]
    tail = [s for s in steps[first[ids[1]]] if s.seq_id == ids[1]][0]
    assert tail.num_cached == 12 and list(tail.token_ids) == PROMPT[12:]


def test_seeded_choices_are_reproducible_and_use_seed_plus_i(om):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=40, ignore_eos=True)
    eng = om.engine()
    a = [eng.request(i) for i in eng.add_group(PROMPT, params, 3)]
    _drive(eng)
    eng2 = om.engine(overlap=False)
    b = [eng2.request(i) for i in eng2.add_group(PROMPT, params, 3)]
    _drive(eng2)
    got = [r.generated for r in a]
    assert got == [r.generated for r in b]
    assert len({tuple(g) for g in got}) == 3  # the choices differ
    assert [r.params.seed for r in a] == [40, 41, 42]
    alone = om.engine().run([PROMPT] * 3, [replace(params, seed=40 + i) for i in range(3)])
    assert [r.generated for r in alone] == got  # choice i is the request with seed + i
    eng3 = om.engine()
    c = [eng3.request(i) for i in eng3.add_group(PROMPT, replace(params, seed=None), 3)]
    _drive(eng3)
    assert len({r.seed for r in c}) == 3 and len({tuple(r.generated) for r in c}) == 3


def test_choices_with_logprobs_prompt_logprobs_and_penalties(om):
    """Each choice reports its own logprobs; the prompt logprobs of the shared part come from
    choice 0's rows, the tail's from its own; penalties see the whole prompt in every choice."""
    params = SamplingParams(max_new_tokens=5, logprobs=2, prompt_logprobs=2, repetition_penalty=1.5,
                            frequency_penalty=0.5, ignore_eos=True)
    prompt = LONG[:23]  # 5 shared pages (20 tokens), a 3-token tail each choice scores itself
    eng = om.engine()
    ids = eng.add_group(prompt, params, 3)
    seen_first: set[int] = set()

    def check(e, i):
        for rid in ids:
            r = e.request(rid)
            if r.generated and rid not in seen_first:
                seen_first.add(rid)
                assert all(lp is not None for lp in r.prompt_logprobs[1:])

    _drive(eng, check)
    alone = om.engine().run([prompt], params)[0]
    reqs = [eng.request(i) for i in ids]
    assert seen_first == set(ids)
    for r in reqs:
        assert r.generated == alone.generated
        assert [lp.token for lp in r.logprobs] == alone.generated
        for x, y in zip(r.logprobs + r.prompt_logprobs[1:], alone.logprobs + alone.prompt_logprobs[1:]):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert om.runner.sampler.state.held() == {} and om.allocator.num_free == om.allocator.num_usable


# ----------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_choice_0_cancelled_before_the_others_could_share(om, overlap):
    """Choice 0 cancelled mid-prefill (its shared pages not all queued): the others prefill their
    whole prompt themselves, and give the plain tokens."""
    eng = om.engine(overlap=overlap)
    ids = eng.add_group(LONG, GREEDY, 3)

    def cancel(e, i):
        if i == 0:
            assert e.request(ids[0]).num_scheduled < 24 and e.request(ids[1]) in e.waiting
            assert e.cancel(ids[0])

    _drive(eng, cancel)
    want = hf_greedy_generate(om.eager_model, LONG, 6)
    assert eng.request(ids[0]).finish_reason == "cancelled"
    assert [eng.request(i).generated for i in ids[1:]] == [want, want]
    assert all(eng.request(i).shared_tokens == 0 for i in ids[1:])  # they did not share
    assert om.allocator.num_free == om.allocator.num_usable


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("victim,when", [(0, "decode"), (1, "decode"), (1, "prefill"), (0, "prefill")])
def test_a_choice_cancelled_after_the_sharing(om, overlap, victim, when):
    """Choice 0 or another choice cancelled once the pages are shared, while the others still
    prefill their tail (scored prompts: a few rows a step, so the tail takes several steps) or
    decode: the rest go on with the plain tokens; the shared pages stay until their last holder
    ends; every page comes back."""
    prompt = LONG[:15]  # 3 shared pages, a 3-token tail
    eng = om.engine(overlap=overlap)
    ids = eng.add_group(prompt, replace(GREEDY, prompt_logprobs=0), 3)
    alloc = om.allocator
    done = []

    def cancel(e, i):
        r = [e.request(x) for x in ids]
        if done or not all(x in e.running for x in r):
            return
        if (when == "decode") != all(x.generated for x in r) or (when == "prefill" and r[1].generated):
            return
        shared = alloc.pages_of(ids[0])[:3]
        assert all(alloc.refcount(p) == 3 for p in shared)
        assert e.cancel(ids[victim])
        done.append(i)
        assert all(alloc.refcount(p) == 2 for p in shared)  # one holder fewer, the pages stay

    _drive(eng, cancel)
    assert done
    want = hf_greedy_generate(om.eager_model, prompt, 6)
    for k, rid in enumerate(ids):
        r = eng.request(rid)
        if k == victim:
            assert r.finish_reason == "cancelled" and r.generated == want[: len(r.generated)]
            assert bool(r.generated) == (when == "decode")
        else:
            assert r.generated == want and r.finish_reason == "length"
    assert alloc.num_free == alloc.num_usable and alloc.owners() == {}
    assert om.runner.sampler.state.held() == {}


@pytest.mark.parametrize("fail_at", [2, 4], ids=["before-sharing", "after-sharing"])
def test_a_failing_step_leaves_the_counts_right(om, monkeypatch, fail_at):
    """A step that raises fails its requests (and, as the server does, the step in flight); the
    choices left go on (alone if choice 0 failed first), and every page and slot comes back."""
    calls = {"n": 0}
    real = om.runner.launch

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    prompt = LONG[:15]  # choice 0 prefills in steps 1-2; the others share from step 3
    params = replace(GREEDY, repetition_penalty=1.2)
    want = om.engine().run([prompt], params)[0].generated
    om.allocator.clear_cache()  # choice 0 prefills again: the steps below count on it
    monkeypatch.setattr(om.runner, "launch", flaky)
    eng = om.engine()
    ids = eng.add_group(prompt, params, 3)
    failures = 0
    while eng.has_work():
        try:
            eng.step()
        except RuntimeError:
            failures += 1
            eng.abandon_inflight("device fell over")
    assert failures == 1
    reqs = [eng.request(i) for i in ids]
    assert all(r.finished for r in reqs) and reqs[0].finish_reason == "error"
    assert all(r.generated == want for r in reqs if r.finish_reason == "length")
    if fail_at == 2:  # choice 0 failed before the others could share: they ran alone
        assert [r.finish_reason for r in reqs[1:]] == ["length", "length"]
    assert om.allocator.num_free == om.allocator.num_usable and om.allocator.owners() == {}
    assert om.runner.sampler.state.held() == {}


def test_short_cache_the_group_waits_or_fails_cleanly(optimized_family):
    """Pages for choice 0 and one other only: the third waits for pages, then runs (alone, if
    choice 0 ended first); a group that does not fit an empty cache fails whole, pages back."""
    # 13-token prompt + 6: choice 0 needs 5 pages, each other choice 2 of its own: 9 for all three
    om = optimized_family("default", BASE + ("runtime.num_pages=9",))  # 8 usable
    alloc = om.allocator
    eng = om.engine()
    ids = eng.add_group(PROMPT, GREEDY, 3)
    running: list[int] = []
    _drive(eng, lambda e, i: running.append(len(e.running)))
    want = hf_greedy_generate(om.eager_model, PROMPT, 6)
    assert [eng.request(i).generated for i in ids] == [want] * 3
    assert max(running) == 2 and alloc.num_free == alloc.num_usable
    reqs = om.engine().run([list(range(1, 30))], SamplingParams(max_new_tokens=6))
    assert reqs[0].finish_reason == "error"
    eng = om.engine()
    ids = eng.add_group(list(range(1, 30)), SamplingParams(max_new_tokens=6), 3)  # 9 pages each: never fits
    _drive(eng)
    assert all(eng.request(i).finish_reason == "error" and "out of cache pages" in eng.request(i).error for i in ids)
    assert alloc.num_free == alloc.num_usable and alloc.owners() == {}


def test_group_requests_are_validated(om):
    eng = om.engine()
    for n in (0, -1, 2.0, True):
        with pytest.raises(RequestError, match="number of choices must be an integer >= 1"):
            eng.add_group([1, 2], GREEDY, n)
    with pytest.raises(RequestError, match="seed \\+ i, which must stay below 2\\*\\*63"):
        eng.add_group([1, 2], replace(GREEDY, seed=2**63 - 2), 3)
    with pytest.raises(RequestError, match="empty prompt"):
        eng.add_group([], GREEDY, 2)
    assert not eng.has_work()
    one = eng.add_group([4, 5, 6], GREEDY, 1)  # n = 1: a plain request; short prompts share nothing
    two = eng.add_group([4, 5, 6], GREEDY, 2)
    assert eng.request(two[1]).leader is None and eng.request(two[1]).shared_tokens == 0
    _drive(eng)
    assert eng.request(one[0]).generated == eng.request(two[0]).generated == eng.request(two[1]).generated


# ----------------------------------------------------------------------------- the allocator
ops = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 40)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    max_size=50,
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(2, 24), page_size=st.integers(1, 8), script=ops)
def test_allocator_sharing_invariants(num_pages, page_size, script):
    """A page's count is its holders; the pool and the held pages partition the usable pages
    (a shared page counted once); failed calls change nothing; the last holder frees a page."""
    alloc = PageAllocator(num_pages, page_size)
    for op, a, b in script:
        before = (alloc.owners(), alloc.num_free)
        if op == "grow":
            try:
                alloc.ensure(a, max(b, len(alloc.pages_of(a)) * page_size))
            except OutOfPagesError:
                assert (alloc.owners(), alloc.num_free) == before
        elif op == "fork":
            src, n = alloc.pages_of(b), len(alloc.pages_of(b)) // 2
            if alloc.pages_of(a):
                with pytest.raises(ValueError, match="already holds pages"):
                    alloc.fork(a, b, n)
                assert (alloc.owners(), alloc.num_free) == before
            else:
                assert alloc.fork(a, b, n) == src[:n]
        else:
            alloc.free(a)
        owners = alloc.owners()
        held = [p for pages in owners.values() for p in pages]
        for p in set(held):
            assert alloc.refcount(p) == held.count(p)
        assert SCRATCH_PAGE not in held and not set(held) & set(alloc._free)
        assert len(set(held)) + alloc.num_free == num_pages - 1
    for s in list(alloc.owners()):
        alloc.free(s)
    assert alloc.num_free == num_pages - 1


def test_fork_errors_and_counts():
    alloc = PageAllocator(10, 4)
    alloc.ensure(0, 12)
    pages = alloc.pages_of(0)
    assert alloc.fork(1, 0, 2) == pages[:2] and alloc.num_free == 6
    alloc.ensure(1, 16)  # grows after the shared pages with its own
    assert alloc.pages_of(1)[:2] == pages[:2] and alloc.num_free == 4
    with pytest.raises(ValueError, match="already holds pages"):
        alloc.fork(1, 0, 1)
    with pytest.raises(ValueError, match="holds 3 pages, cannot share 4"):
        alloc.fork(2, 0, 4)
    assert alloc.free(0) == 1  # pages[:2] are still held by 1
    assert [alloc.refcount(p) for p in pages] == [1, 1, 0]
    assert alloc.free(1) == 4 and alloc.free(1) == 0 and alloc.num_free == 9
    assert torch.tensor([alloc.refcount(p) for p in range(10)]).eq(0).all()
