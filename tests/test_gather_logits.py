"""gather_logits: the LM head runs on one row per sequence; results are unchanged."""

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.runtime import CapacityError, StepSequence
from autodeploy_mla.testing import hf_greedy_generate

BASE = ["model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=48",
        "runtime.max_num_tokens=12", "runtime.max_batch_size=3"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [3, 4], [9, 9, 8]]


@pytest.fixture(scope="module")
def pair():
    on = optimize("deepseek_v2", overrides=BASE)
    off = optimize("deepseek_v2", overrides=BASE + ["transforms.gather_logits.enabled=false"])
    return on, off


def _one_step(om):
    om.allocator.ensure_many({0: 9, 1: 2})
    seqs = [StepSequence(0, list(range(1, 10)), 0), StepSequence(1, [4, 5], 0)]
    try:
        _, full = om.runner.forward(seqs, om.allocator.pages_of)
        _, rows = om.runner.step(seqs, om.allocator.pages_of)  # appends the same tokens again: idempotent
        return full, rows
    finally:
        om.allocator.free(0)
        om.allocator.free(1)


def test_graph_returns_one_row_per_sequence(pair):
    on, off = pair
    full, rows_off = _one_step(off)
    gathered, rows_on = _one_step(on)
    assert full.shape[1] == 11 and gathered.shape[1] == 3  # [1, T, V] vs [1, max_batch_size, V]
    assert torch.allclose(rows_on, rows_off, atol=1e-5)
    assert torch.allclose(rows_on, full[0, [8, 10]], atol=1e-5)  # each sequence's last token
    rep = {p["name"]: p for p in on.report()["passes"]}
    assert rep["gather_logits"]["summary"].startswith("LM head on 3 rows")
    assert not {p["name"]: p for p in off.report()["passes"]}["gather_logits"]["enabled"]


def test_generation_and_prefill_logits_unchanged(pair):
    on, off = pair
    ref = [hf_greedy_generate(on.eager_model, p, 5) for p in PROMPTS]
    assert on.generate(PROMPTS, max_new_tokens=5) == ref
    assert off.generate(PROMPTS, max_new_tokens=5) == ref
    a, b = on.prefill_logits(PROMPTS[0]), off.prefill_logits(PROMPTS[0])  # chunks of 3 vs 12 tokens
    with torch.no_grad():
        hf = on.eager_model(torch.tensor([PROMPTS[0]])).logits[0]
    assert a.shape == b.shape == hf.shape
    assert (a - hf).abs().max() < 1e-4 and (b - hf).abs().max() < 1e-4


def test_all_rows_mode_is_bounded(pair):
    on, _ = pair
    on.allocator.ensure(0, 5)
    try:
        with pytest.raises(CapacityError, match="at most max_batch_size=3"):
            on.seq_info.prepare_step([StepSequence(0, [1, 2, 3, 4, 5], 0)], on.allocator.pages_of, logits_for="all")
    finally:
        on.allocator.free(0)


def test_not_applied_when_the_output_is_not_a_plain_lm_head():
    from tests.test_native_torch_mla_model import NativeMLALM

    class Scaled(NativeMLALM):
        def forward(self, input_ids, position_ids=None, use_cache=False):
            return super().forward(input_ids, position_ids, use_cache) * 0.5

    model = Scaled(scale=None, by_keyword=True).eval()
    om = optimize(model, overrides=["model.device=cpu", "runtime.page_size=4", "runtime.max_num_tokens=6",
                                    "runtime.max_seq_len=40"])
    rep = {p["name"]: p for p in om.report()["passes"]}
    assert rep["gather_logits"]["summary"].startswith("not applied: the output is not produced by a final linear")
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        ids = list(prompt)
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert om.generate([prompt], max_new_tokens=4)[0] == ids[len(prompt):]
