"""The batched sampler: distributions, filters, seeds. Distribution checks, not timing.

Each check draws thousands of tokens from one logits row (one row per counter value, as a request
advancing through its tokens would) and compares their frequencies with `target_probs`, the
distribution written out plainly. The GPU test runs the same sampler on CUDA against the CPU one on
fixed seeds.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.runtime.sampling import GREEDY, BatchSampler, RowSpec, SamplingParams, row_keys, target_probs

V = 64
CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.5, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=1),
]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2.0


def _draw(sampler, logits, params, seed, n, device="cpu", batch=512):
    counts = torch.zeros(V, dtype=torch.float64)
    ids_all = []
    for c0 in range(0, n, batch):
        specs = [RowSpec.of(params, seed, c) for c in range(c0, min(n, c0 + batch))]
        rows = logits.to(device)[None].expand(len(specs), V).contiguous()
        ids = sampler.sample(rows, specs).cpu()
        ids_all.append(ids)
        counts += torch.bincount(ids, minlength=V).double()
    return counts / n, torch.cat(ids_all)


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_frequencies_match_the_target_distribution(params):
    logits = _logits(1)
    emp, _ = _draw(BatchSampler(512, "cpu"), logits, params, seed=5, n=20000)
    tgt = target_probs(logits, params)
    assert bool(((emp > 0) <= (tgt > 0)).all()), "a token outside the top-k/top-p set was drawn"
    tv = 0.5 * float((emp - tgt).abs().sum())
    assert tv < 0.03, tv  # 20000 draws: sampling noise of the TV distance is well below this


def test_filters_keep_the_right_candidates():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[:2] > 0).all() and (p[2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-12
    # top-p keeps the smallest prefix reaching p: candidate 0 alone has 0.64 < 0.7, so 0 and 1 stay
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (p[:2] > 0).all() and (p[2:] == 0).all()
    assert target_probs(logits, SamplingParams())[0] == 1.0  # greedy


def test_greedy_rows_are_argmax_and_mixed_batches_are_row_independent():
    torch.manual_seed(0)
    rows = torch.randn(6, V)
    s = BatchSampler(8, "cpu")
    assert torch.equal(s.sample(rows, [GREEDY] * 6), rows.argmax(-1))
    specs = [GREEDY, RowSpec(1.0, 0, 1.0, 3, 0), RowSpec(0.7, 5, 0.9, 4, 2), GREEDY, RowSpec(1.2, 0, 0.5, 9, 1), GREEDY]
    mixed = s.sample(rows, specs)
    assert [int(mixed[i]) for i in (0, 3, 5)] == [int(rows[i].argmax()) for i in (0, 3, 5)]
    for i, spec in enumerate(specs):  # a row draws the same token alone or in any batch
        assert int(s.sample(rows[i : i + 1], [spec])) == int(mixed[i])


def test_seeds_and_counters():
    logits = _logits(2)
    s = BatchSampler(512, "cpu")
    params = SamplingParams(temperature=1.0)
    _, a = _draw(s, logits, params, seed=42, n=512)
    _, b = _draw(s, logits, params, seed=42, n=512)
    _, c = _draw(s, logits, params, seed=43, n=512)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(set(a.tolist())) > 10  # counters draw different tokens
    keys = row_keys(torch.tensor([0, 1, 2**62, 2**63 - 1]), torch.tensor([0, 0, 0, 7]))
    assert len(set(keys.tolist())) == 4 and bool(((keys >= 0) & (keys < 2**32)).all())


def test_parameters_are_validated():
    for bad, match in (({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                       ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"seed": -1}, "seed"),
                       ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="3 logits rows but 2 row specs"):
        BatchSampler(4, "cpu").sample(torch.zeros(3, V), [GREEDY, GREEDY])


@pytest.mark.gpu
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_gpu_sampler_matches_the_cpu_sampler(params):
    logits = _logits(3)
    emp_gpu, ids_gpu = _draw(BatchSampler(512, "cuda"), logits, params, seed=17, n=8192, device="cuda")
    _, ids_cpu = _draw(BatchSampler(512, "cpu"), logits, params, seed=17, n=8192)
    same = float((ids_gpu == ids_cpu).double().mean())
    assert same > 0.99, same  # identical hash bits; only float rounding of near-ties may differ
    tgt = target_probs(logits, params)
    assert 0.5 * float((emp_gpu - tgt).abs().sum()) < 0.05
