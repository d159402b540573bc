"""Logprobs, prompt logprobs (echo), penalties and logit bias through the engine, on the tiny
default model in fp32: every value against the model's own logits (`prefill_logits` of the
prompt + the tokens generated, one full forward), with chunked prefill (prompts longer than
max_num_tokens and than the max_batch_size logits rows a step returns), mixed with plain requests
in one batch, with the engine's overlap on and off, and with gather_logits on and off."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.runtime import RequestError
from autodeploy_mla.runtime.sampling import BatchSampler, SamplingParams
from autodeploy_mla.testing import hf_greedy_generate
from tests.test_sampling_features import _Ops, host_reads_forbidden

BASE = ["model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=40",
        "runtime.max_num_tokens=10", "runtime.max_batch_size=3"]
LONG = [(7 * i + 3) % 251 + 1 for i in range(25)]  # 25 tokens: > max_num_tokens (10) and > 3 rows


@pytest.fixture(scope="module")
def om(optimized_family):
    return optimized_family("default", BASE)


@pytest.fixture(scope="module")
def om_per_token():
    return optimize("default", overrides=BASE + ["transforms.gather_logits.enabled=false"])


def _engine(om, overlap):
    eng = om.engine()
    eng.overlap = overlap
    return eng


def _ref(om, req, temperature=1.0):
    """log_softmax rows [S + G - 1, V] (float64) of the model over prompt + generated[:-1]."""
    logits = om.prefill_logits(req.prompt + req.generated[:-1]).double()
    return torch.log_softmax(logits / temperature, dim=-1)


def _same(lp, ref_row, token, k):
    assert lp.token == token
    assert abs(lp.logprob - float(ref_row[token])) < 1e-4
    want = torch.topk(ref_row, k)
    assert [i for i, _ in lp.top] == want.indices.tolist()
    assert max((abs(v - w) for (_, v), w in zip(lp.top, want.values.tolist())), default=0.0) < 1e-4


def _check_generated(om, req, temperature=1.0):
    k = req.params.logprobs
    assert len(req.logprobs) == len(req.generated) > 0
    ref = _ref(om, req, temperature)
    s = len(req.prompt)
    for i, (tok, lp) in enumerate(zip(req.generated, req.logprobs)):
        _same(lp, ref[s - 1 + i], tok, k)
        if req.params.greedy and k:
            assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely


def _check_prompt(om, req):
    k = req.params.prompt_logprobs
    assert len(req.prompt_logprobs) == len(req.prompt) and req.prompt_logprobs[0] is None
    ref = torch.log_softmax(om.prefill_logits(req.prompt).double(), dim=-1)
    for j in range(1, len(req.prompt)):
        _same(req.prompt_logprobs[j], ref[j - 1], req.prompt[j], k)


@pytest.mark.parametrize("overlap,gather", [(True, True), (False, True), (True, False)],
                         ids=["overlap", "sync", "per-token-logits"])
def test_logprobs_equal_the_model_s(om, om_per_token, overlap, gather):
    model = om if gather else om_per_token
    eng = _engine(model, overlap)
    scored = SamplingParams(max_new_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    plain = SamplingParams(max_new_tokens=4, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=5, temperature=0.8, top_k=20, top_p=0.9, seed=3, logprobs=2,
                             ignore_eos=True)
    single = SamplingParams(max_new_tokens=3, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    prompts = [LONG, [5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [9], LONG[:13]]
    params = [scored, plain, sampled, single, replace(plain, prompt_logprobs=4)]
    reqs = eng.run(prompts, params)
    assert all(r.finish_reason == "length" for r in reqs)
    a, b, c, d, e = reqs
    _check_generated(model, a)
    _check_prompt(model, a)
    assert b.generated == hf_greedy_generate(model.eager_model, [5, 6, 7], 4) and not b.logprobs
    assert b.prompt_logprobs == []
    _check_generated(model, c, temperature=0.8)  # processed logprobs: over the temperature, before top-k/p
    assert d.prompt_logprobs == [None] and all(lp.top == () for lp in d.logprobs)
    _check_generated(model, d)
    _check_prompt(model, e)
    assert not e.logprobs and e.generated == hf_greedy_generate(model.eager_model, LONG[:13], 4)
    assert eng.request(a.id) is a
    assert all(s.num_seqs <= 3 for s in eng.steps)
    assert model.runner.sampler.state.held() == {}  # nothing held once the requests ended
    assert model.allocator.num_free == model.allocator.num_usable


def test_prompt_logprobs_are_complete_with_the_first_token(om):
    """The server reads `prompt_logprobs` when the first token is streamed: complete by then, also
    when the prompt was scored over several steps (25 tokens, at most 3 rows a step)."""
    eng = om.engine()
    rid = eng.add_request(LONG, SamplingParams(max_new_tokens=3, prompt_logprobs=1, logprobs=1))
    other = eng.add_request(LONG[3:20], SamplingParams(max_new_tokens=3))
    seen_first = False
    while eng.has_work():
        for i, _ in eng.step():
            r = eng.request(i)
            if i == rid and len(r.generated) == 1:
                seen_first = True
                assert all(lp is not None for lp in r.prompt_logprobs[1:])
                assert len(r.logprobs) == 1
    assert seen_first and eng.request(other).finish_reason is not None
    # a scoring chunk leaves a row to the prompt behind it: both prefilled side by side
    assert any(s.num_seqs == 2 and s.num_prefill_tokens > 2 for s in eng.steps[:3])


# ----------------------------------------------------------------------------- penalties and bias
def _processed(row: torch.Tensor, p: SamplingParams, prompt, generated) -> torch.Tensor:
    """The test's own reference (float64): repetition over prompt + generated, frequency and
    presence over generated, then the bias."""
    x = row.double().clone()
    for t in set(prompt) | set(generated):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, n in Counter(generated).items():
        x[t] -= p.frequency_penalty * n + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    return x


def _check_penalised(om, req):
    """Step by step: token i is the argmax (greedy) or in the support (sampled) of the processed
    logits after prompt + generated[:i], and its logprob is theirs (over the temperature)."""
    p = req.params
    rows = om.prefill_logits(req.prompt + req.generated[:-1])
    s = len(req.prompt)
    t = p.temperature if p.temperature > 0 else 1.0
    for i, tok in enumerate(req.generated):
        x = _processed(rows[s - 1 + i], p, req.prompt, req.generated[:i])
        if p.greedy:
            assert tok == int(x.argmax()), f"token {i}"
        else:
            assert float(x[tok]) > float(x.max()) - 30  # a real candidate, not noise
        if p.logprobs is not None:
            _same(req.logprobs[i], torch.log_softmax(x / t, dim=-1), tok, p.logprobs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_penalties_and_bias_match_a_host_reference_step_by_step(om, overlap):
    eng = _engine(om, overlap)
    greedy = SamplingParams(max_new_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
                            logit_bias={16: 0.4, 172: -0.2}, logprobs=3, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, seed=5, frequency_penalty=1.0,
                             repetition_penalty=1.2, logprobs=2, ignore_eos=True)
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [LONG[:14], LONG[:14], [5, 6, 7, 8], LONG[2:9]]
    reqs = eng.run(prompts, [greedy, sampled, plain, replace(greedy, presence_penalty=-1.0, logprobs=None)])
    for r in (reqs[0], reqs[1], reqs[3]):
        _check_penalised(om, r)
    assert reqs[2].generated == hf_greedy_generate(om.eager_model, [5, 6, 7, 8], 8)
    assert om.runner.sampler.state.held() == {}


def test_strong_bias_forces_and_penalties_change_tokens(om):
    prompt = LONG[:8]
    base = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = hf_greedy_generate(om.eager_model, prompt, 8)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself here: the penalties have work
    cases = [replace(base, logit_bias={77: 100.0}), replace(base, temperature=1.0, seed=1, logit_bias={77: 100.0}),
             replace(base, frequency_penalty=2.0), replace(base, presence_penalty=2.0),
             replace(base, repetition_penalty=3.0), base]
    reqs = om.engine().run([prompt] * len(cases), cases)
    got = [r.generated for r in reqs]
    assert got[0] == got[1] == [77] * 8
    for g in got[2:5]:
        assert g != plain
    assert len(set(got[4])) == len(got[4])  # a strong repetition penalty: no token twice here
    assert got[5] == plain  # the plain request of the same batch is untouched
    for r in reqs[2:5]:
        _check_penalised(om, r)


def test_repetition_counts_the_prompt_frequency_and_presence_do_not(om):
    """Greedy's first token after LONG is a prompt token: the repetition penalty (prompt +
    generated) moves it, the frequency and presence penalties (generated only) do not."""
    base = SamplingParams(max_new_tokens=1, ignore_eos=True)
    first = hf_greedy_generate(om.eager_model, LONG, 1)[0]
    assert first in LONG
    cases = [replace(base, repetition_penalty=3.0), replace(base, frequency_penalty=2.0),
             replace(base, presence_penalty=2.0)]
    rep, freq, pres = (r.generated[0] for r in om.engine().run([LONG] * 3, cases))
    assert rep != first and freq == pres == first


def test_bias_ids_are_checked_against_the_vocabulary(om):
    eng = om.engine()
    with pytest.raises(RequestError, match=r"logit_bias token id 256 is outside the model's vocabulary \[0, 256\)"):
        eng.add_request([1, 2], SamplingParams(logit_bias={256: 1.0}))
    with pytest.raises(KeyError, match="no request 12345"):
        eng.request(12345)


# ----------------------------------------------------------------------------- nothing extra
def test_plain_requests_cost_nothing_extra(om, monkeypatch):
    """Requests with none of the new features, through the runner: the sampler launches only ops
    of the plain path (test_sampling_features pins their exact sequence), none of the feature
    paths' (state gathers, scatters, log_softmax, top-k), and allocates no penalty state and no
    logprob buffers: one host copy per step, the ids."""
    runner = om.runner
    fresh = BatchSampler(runner.seq_info.max_batch_size, runner.device)
    monkeypatch.setattr(runner, "sampler", fresh)
    monkeypatch.setattr(runner, "_lp_host", None)
    ops: list[str] = []
    draw, commit = fresh.draw, fresh.commit

    def traced(fn):
        def f(*a, **k):
            with _Ops() as rec:
                out = fn(*a, **k)
            ops.extend(rec.ops)
            return out
        return f

    monkeypatch.setattr(fresh, "draw", traced(draw))
    monkeypatch.setattr(fresh, "commit", traced(commit))
    prompts = [[5, 6, 7], LONG[:12], [9, 10]]
    params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=5, temperature=0.7, seed=2),
              SamplingParams(max_new_tokens=3, temperature=0.9, top_k=5, top_p=0.8, seed=4)]
    om.engine().run(prompts, params)
    feature_ops = {"index_select", "scatter_add", "index_put", "index_put_", "index_fill_", "log_softmax",
                   "_log_softmax", "topk", "cat", "bitwise_or", "__or__", "ne"}
    assert ops and not feature_ops & set(ops), feature_ops & set(ops)
    assert not fresh.state.allocated and runner._lp_host is None


def test_the_runner_s_sampling_path_reads_nothing_back(om, monkeypatch):
    """With every feature on, the device half of a step (row selection, draw, state update,
    logprobs, the queued host copies) reads no device value on the host: only `collect` does."""
    sample = om.runner._sample

    def guarded(*a, **k):
        with host_reads_forbidden():
            return sample(*a, **k)

    monkeypatch.setattr(om.runner, "_sample", guarded)
    p = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=9, seed=1, repetition_penalty=1.2,
                       frequency_penalty=0.5, presence_penalty=0.5, logit_bias={3: 1.0}, logprobs=4,
                       prompt_logprobs=2, ignore_eos=True)
    reqs = om.engine().run([LONG[:11], [4, 5, 6]], [p, SamplingParams(max_new_tokens=4)])
    assert all(r.finish_reason == "length" for r in reqs) and len(reqs[0].logprobs) == 4


def test_rows_of_sequences_that_ask_for_all_their_logits():
    """Metadata: `logits_index` lists every new token of an all_logits sequence and the last token
    of the others, in flat order; `sample_row` is each sequence's last row; at most B rows."""
    from autodeploy_mla.runtime import CapacityError, PageAllocator, SequenceInfo, StepSequence

    info = SequenceInfo(max_batch_size=8, max_num_tokens=16, max_seq_len=16, page_size=4)
    alloc = PageAllocator(20, 4, info.max_pages_per_seq)
    alloc.ensure_many({1: 4, 2: 3, 3: 5, 4: 2, 5: 2})
    seqs = [StepSequence(4, [9], 1), StepSequence(1, [1, 2, 3, 4], 0), StepSequence(2, [5, 6, 7], 0, all_logits=True),
            StepSequence(3, [8, 9], 3, all_logits=True)]
    assert info.prepare_step(seqs, alloc.pages_of) == [1, 2, 3, 4]  # flat tokens 0-3, 4-6, 7-8, 9
    h = info.host
    assert info.num_logits_rows == 7 and h["logits_index"].tolist() == [3, 4, 5, 6, 7, 8, 9, 0]
    assert h["sample_row"][:4].tolist() == [0, 3, 5, 6]
    assert info.row_start == [0, 1, 4, 6] and info.rows_per_seq == [1, 3, 2, 1]
    with pytest.raises(CapacityError, match="9 logits rows .* over max_batch_size=8"):
        info.prepare_step(seqs + [StepSequence(5, [1, 2], 0, all_logits=True)], alloc.pages_of)
