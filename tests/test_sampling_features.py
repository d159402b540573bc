"""The batched sampler's penalties, logit bias and logprobs, against the plain references
(`target_probs`, `target_logprobs`), with no model: each processing step alone and together,
greedy and sampled, over several steps of one request (the device counts), slots reused, rows
independent of their batch; a plain batch launches exactly the ops it launched before these
features; and the per-step path never reads a device value on the host."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autodeploy_mla.runtime.sampling import (GREEDY, MAX_LOGPROBS, BatchSampler, RowSpec, SamplingParams, ScoredRows,
                                             target_logprobs, target_probs)

V = 64
PROMPT = [3, 5, 5, 9, 11, 40, 63]
CASES = {
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition<1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=-1.2),
    "bias": SamplingParams(logit_bias=((4, 3.0), (9, -5.0), (63, 1.5))),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6,
                          logit_bias={2: 2.0, 5: -1.0}),
    "all-sampled": SamplingParams(temperature=0.9, top_k=12, top_p=0.9, repetition_penalty=1.3,
                                  frequency_penalty=0.4, presence_penalty=0.6, logit_bias={2: 2.0}),
    "temperature": SamplingParams(temperature=1.3),
}


def _rows(step: int, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(100 + step)) * 2.0


def _check_logprobs(lp_chosen, top_ids, top_vals, ref, token, k=MAX_LOGPROBS):
    assert abs(float(lp_chosen) - float(ref[token])) < 1e-5
    want = torch.topk(ref, k)
    assert torch.allclose(top_vals.double(), want.values, atol=1e-5)
    assert top_ids.tolist() == want.indices.tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_a_request_over_several_steps_matches_the_reference(name):
    """Step by step, as the engine drives one request: counts of the drawn tokens live on the
    device; the token is the reference's argmax (greedy) or in its support (sampled), and the
    logprobs are the reference's (processed, over the temperature, before top-k / top-p)."""
    params = replace(CASES[name], logprobs=MAX_LOGPROBS)
    s = BatchSampler(4, "cpu")
    generated: list[int] = []
    for step in range(8):
        row = _rows(step)
        out = s.run(row, [RowSpec.of(params, 7, step, key=3, prompt=PROMPT)])
        tok = int(out.ids[0])
        if params.greedy:
            assert tok == int(target_probs(row[0], params, PROMPT, generated).argmax())
        else:
            assert float(target_probs(row[0], params, PROMPT, generated)[tok]) > 0
        lp = out.logprobs
        assert lp is not None and lp.sampled == [0]
        _check_logprobs(lp.chosen[0], lp.top_ids[0], lp.top_vals[0],
                        target_logprobs(row[0], params, PROMPT, generated), tok)
        if params.greedy:
            assert int(lp.top_ids[0, 0]) == tok
        generated.append(tok)
    if params.penalized:
        assert s.state.counts is not None and int(s.state.counts[s.state.held()[3]].sum()) == 8


def test_processing_changes_what_is_drawn():
    """Each feature moves the argmax where the reference says so (not a vacuous comparison)."""
    row = torch.zeros(1, V)
    row[0, 5], row[0, 6] = 2.0, 1.5  # 5 wins; 5 is in the prompt
    s = BatchSampler(4, "cpu")
    plain = int(s.sample(row, [GREEDY]))
    rep = int(s.sample(row, [RowSpec.of(SamplingParams(repetition_penalty=2.0), 0, 0, key=1, prompt=[5])]))
    bias = int(s.sample(row, [RowSpec.of(SamplingParams(logit_bias={30: 100.0}), 0, 0, key=2)]))
    assert (plain, rep, bias) == (5, 6, 30)
    # frequency: after drawing 5 once, 5 loses 1.0 and 6 wins
    spec = SamplingParams(frequency_penalty=1.0)
    assert [int(s.sample(row, [RowSpec.of(spec, 0, c, key=4)])) for c in range(2)] == [5, 6]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, repetition_penalty=1.6, logit_bias={10: 1.5, 3: -2.0}),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9, repetition_penalty=0.7, logit_bias={1: 4.0}),
], ids=["rep-bias", "rep-bias-topk-topp"])
def test_frequencies_match_the_processed_distribution(params):
    """Thousands of first draws of one prompt (a key per row, so a state slot each) sample from
    the processed distribution."""
    logits = _rows(99)[0]
    s = BatchSampler(512, "cpu")
    counts = torch.zeros(V, dtype=torch.float64)
    n = 0
    for batch in range(24):
        specs = [RowSpec.of(params, 1000 * batch + i, 0, key=i, prompt=PROMPT) for i in range(512)]
        ids = s.sample(logits[None].expand(512, V).contiguous(), specs)
        counts += torch.bincount(ids, minlength=V).double()
        n += 512
        for i in range(512):
            s.release(i)
    emp, tgt = counts / n, target_probs(logits, params, PROMPT)
    assert bool(((emp > 0) <= (tgt > 0)).all()), "a token outside the candidates was drawn"
    assert 0.5 * float((emp - tgt).abs().sum()) < 0.03


def test_rows_are_independent_of_their_batch():
    """Plain, penalised and biased rows in one batch draw what each draws alone (each state
    request with a fresh sampler, over the same steps)."""
    kinds = [(SamplingParams(), 0), (CASES["all"], 0), (SamplingParams(temperature=1.0), 3), (CASES["all-sampled"], 5),
             (CASES["bias"], 0), (SamplingParams(logprobs=3), 0)]
    together = BatchSampler(8, "cpu")
    alone = [BatchSampler(8, "cpu") for _ in kinds]
    for step in range(5):
        rows = _rows(step, len(kinds))
        specs = [RowSpec.of(p, seed, step, key=i, prompt=PROMPT) for i, (p, seed) in enumerate(kinds)]
        batch = together.sample(rows, specs)
        for i, spec in enumerate(specs):
            assert int(alone[i].sample(rows[i : i + 1], [spec])) == int(batch[i])


def test_slots_are_reused_and_reinitialised():
    s = BatchSampler(2, "cpu")
    rep = SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0, logit_bias={7: 2.0})
    for c in range(3):
        s.sample(_rows(c), [RowSpec.of(rep, 0, c, key=10, prompt=[1, 2, 3])])
    s.sample(_rows(0), [RowSpec.of(SamplingParams(logit_bias={8: 1.0}), 0, 0, key=11)])
    with pytest.raises(RuntimeError, match="all 2 slots .* held by requests \\[10, 11\\]"):
        s.sample(_rows(0), [RowSpec.of(rep, 0, 0, key=12, prompt=[4])])
    slot = s.state.held()[10]
    s.release(10)
    # the new request gets the slot back, with nothing left of the old one: its logprobs are its own
    params = SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0, logprobs=5)
    out = s.run(_rows(5), [RowSpec.of(params, 0, 0, key=12, prompt=[4, 5])])
    assert s.state.held()[12] == slot
    ref = target_logprobs(_rows(5)[0], params, [4, 5])
    _check_logprobs(out.logprobs.chosen[0], out.logprobs.top_ids[0], out.logprobs.top_vals[0], ref, int(out.ids[0]), 5)
    # a key seen again at counter 0 is a new request (another engine reusing ids): re-initialised too
    out = s.run(_rows(6), [RowSpec.of(params, 0, 0, key=12, prompt=[9])])
    ref = target_logprobs(_rows(6)[0], params, [9])
    _check_logprobs(out.logprobs.chosen[0], out.logprobs.top_ids[0], out.logprobs.top_vals[0], ref, int(out.ids[0]), 5)


def test_scored_rows_are_the_raw_distribution():
    """Prompt rows: log_softmax of the raw logits at the targets, whatever the sampled rows do."""
    s = BatchSampler(4, "cpu")
    all_rows = _rows(1, 6)
    specs = [RowSpec.of(replace(CASES["all-sampled"], logprobs=2), 3, 0, key=0, prompt=PROMPT), GREEDY]
    scored = ScoredRows(all_rows, [0, 2, 3], [7, 1, 60], 4)
    out = s.run(all_rows[[4, 5]], specs, scored)
    lp = out.logprobs
    assert lp.sampled == [0] and lp.chosen.shape == (4,) and lp.top_ids.shape == (4, 4)
    ref = torch.log_softmax(all_rows.double(), dim=-1)
    for j, (r, t) in enumerate(zip([0, 2, 3], [7, 1, 60])):
        _check_logprobs(lp.chosen[1 + j], lp.top_ids[1 + j], lp.top_vals[1 + j], ref[r], t, 4)
    sampled_ref = target_logprobs(all_rows[4], CASES["all-sampled"], PROMPT)
    _check_logprobs(lp.chosen[0], lp.top_ids[0, :2], lp.top_vals[0, :2], sampled_ref, int(out.ids[0]), 2)


# ----------------------------------------------------------------------------- what runs
class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops(sampler, rows, specs):
    with _Ops() as rec:
        sampler.sample(rows, specs)
    return rec.ops


_HASH = ("bitwise_and __rshift__ bitwise_and mul mul bitwise_and mul add bitwise_and bitwise_xor __rshift__ bitwise_xor "
         "mul mul bitwise_and mul add bitwise_and __rshift__ bitwise_xor mul mul bitwise_and mul add bitwise_and "
         "__rshift__ bitwise_xor bitwise_and mul mul bitwise_and mul add bitwise_and bitwise_xor __rshift__ bitwise_xor "
         "mul mul bitwise_and mul add bitwise_and __rshift__ bitwise_xor mul mul bitwise_and mul add bitwise_and "
         "__rshift__ bitwise_xor bitwise_xor __rshift__ bitwise_xor mul mul bitwise_and mul add bitwise_and __rshift__ "
         "bitwise_xor mul mul bitwise_and mul add bitwise_and __rshift__ bitwise_xor")
_NOISE = ("unsqueeze unsqueeze mul mul bitwise_and mul add bitwise_and bitwise_xor __rshift__ bitwise_xor mul mul "
          "bitwise_and mul add bitwise_and __rshift__ bitwise_xor mul mul bitwise_and mul add bitwise_and __rshift__ "
          "bitwise_xor __rshift__ _to_copy add mul log neg log neg")
_PARAMS = "argmax lift_fresh slice copy_ lift_fresh slice copy_ " + "slice select " * 5
# Recorded from the sampler before penalties / bias / logprobs existed (commit cec5ffd).
BEFORE = {
    "greedy": "argmax",
    "temperature": f"{_PARAMS}arange {_HASH} clamp_min unsqueeze div {_NOISE} add argmax gt where",
    "top-k/top-p": (f"{_PARAMS}{_HASH} clamp_min unsqueeze div sort arange gt clamp full_like where unsqueeze unsqueeze "
                    f"ge masked_fill _softmax cumsum sub unsqueeze gt masked_fill {_NOISE} gather add argmax gather "
                    "select gt where"),
}


def test_plain_rows_launch_exactly_the_ops_they_did_before():
    """Requests that use none of the new features cost nothing extra: the same aten ops, in the
    same order, as the sampler of cec5ffd (the arange of the vocab ids is cached after the first
    sampled step), and no penalty state is allocated."""
    rows = _rows(0, 4)
    s = BatchSampler(8, "cpu")
    assert " ".join(_ops(s, rows, [GREEDY] * 4)) == BEFORE["greedy"]
    assert " ".join(_ops(s, rows, [RowSpec(1.0, 0, 1.0, 3, 0)] * 4)) == BEFORE["temperature"]
    mixed = [GREEDY, RowSpec(0.7, 5, 0.9, 4, 2), RowSpec(1.0, 0, 1.0, 3, 0), GREEDY]
    assert " ".join(_ops(s, rows, mixed)) == BEFORE["top-k/top-p"]
    assert not s.state.allocated


class _NoHostReads(TorchDispatchMode):
    """Fails on any device value read by the host: item(), bool(), int(), float() (aten's
    _local_scalar_dense), and on tolist() / cpu() / numpy() (not dispatched: patched)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            raise AssertionError("a device value was read on the host in the per-step path")
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads_forbidden() -> Iterator[None]:
    """Inside: reading a tensor's values on the host raises (the per-step device path's rule)."""
    def forbid(name):
        def f(*a, **k):
            raise AssertionError(f"Tensor.{name}() in the per-step path")
        return f

    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "item")}
    try:
        for name in saved:
            setattr(torch.Tensor, name, forbid(name))
        with _NoHostReads():
            yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


@pytest.fixture
def no_host_reads():
    with host_reads_forbidden():
        yield


def test_the_step_path_reads_nothing_back(no_host_reads):
    s = BatchSampler(8, "cpu")
    rows = _rows(3, 6)
    specs = [RowSpec.of(replace(CASES["all"], logprobs=3), 1, 0, key=0, prompt=PROMPT),
             RowSpec.of(CASES["all-sampled"], 2, 0, key=1, prompt=PROMPT), GREEDY, RowSpec(1.0, 5, 0.8, 4, 0)]
    for step in range(3):
        step_specs = [sp._replace(counter=step) for sp in specs]
        out = s.run(rows[:4], step_specs, ScoredRows(rows, [4, 5], [1, 2], 5))
        assert out.logprobs is not None


def test_parameters_are_validated_with_the_value_and_the_limit():
    for bad, match in (
        ({"presence_penalty": 2.5}, r"presence_penalty=2.5: must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty=-3.0: must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0: must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
        ({"logit_bias": {5: 101.0}}, r"bias 101.0 for token 5 is outside \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "token id -1 is negative"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "token id 5 appears twice"),
        ({"logit_bias": [("5", 1.0)]}, "expected \\(token id, bias\\)"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "301 entries, over the limit of 300"),
        ({"logprobs": 21}, r"logprobs=21: must be None \(off\) or an integer in \[0, 20\]"),
        ({"logprobs": -1}, "logprobs=-1"),
        ({"prompt_logprobs": True}, "prompt_logprobs=True"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    p = SamplingParams(logit_bias={3: 1, 1: -2.5})
    assert p.logit_bias == ((3, 1.0), (1, -2.5)) and hash(p)  # kept as pairs, still hashable
    assert not SamplingParams(logprobs=0).penalized and SamplingParams(repetition_penalty=1.1).penalized
    assert RowSpec.of(SamplingParams(temperature=0.5, top_k=3), 1, 2, key=4, prompt=[1]).extra is None  # plain
    with pytest.raises(ValueError, match="needs its request's key"):
        BatchSampler(2, "cpu").sample(_rows(0), [RowSpec.of(SamplingParams(presence_penalty=1.0), 0, 0)])


@pytest.mark.gpu
def test_gpu_sampler_matches_the_cpu_sampler_with_every_feature():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    specs = [RowSpec.of(replace(CASES["all"], logprobs=5), 1, 0, key=0, prompt=PROMPT),
             RowSpec.of(replace(CASES["all-sampled"], logprobs=3), 2, 0, key=1, prompt=PROMPT), GREEDY]
    cpu, gpu = BatchSampler(4, "cpu"), BatchSampler(4, "cuda")
    for step in range(6):
        rows = _rows(step, 5)
        sp = [s._replace(counter=step) for s in specs]
        a = cpu.run(rows[:3], sp, ScoredRows(rows, [3, 4], [1, 2], 4))
        b = gpu.run(rows[:3].cuda(), sp, ScoredRows(rows.cuda(), [3, 4], [1, 2], 4))
        assert a.ids.tolist() == b.ids.cpu().tolist()
        assert torch.allclose(a.logprobs.chosen, b.logprobs.chosen.cpu(), atol=1e-4)
        assert torch.equal(a.logprobs.top_ids, b.logprobs.top_ids.cpu())
