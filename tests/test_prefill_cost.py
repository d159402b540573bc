"""The prefill cost model (custom_ops/attention/prefill_cost.py) against the measurements it was fit to.

docs/benchmarks/flashinfer_plan.md (H200) timed steps with prefill tokens on FlashInfer's absorbed
path and on Triton's expanded path; the SM90 facts must pick the measured winner of each, from the
dims and the per-sequence lengths alone, and the FLOP counts must follow the formulas by hand.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
from autodeploy_mla.custom_ops.attention.prefill_cost import SM90_FACTS, path_costs, step_flops

DS = lambda n: MLADims(n, 128, 64, 128, 512)  # noqa: E731  DeepSeek per-head dims at N heads

# (N, q_lens, kv_lens, measured winner) from the table "steps with prefill tokens" (both timed)
MEASURED = [
    (128, [128], [128], "flashinfer"),  # 171.5 vs 261.5 us
    (128, [512], [512], "flashinfer"),  # 204.4 vs 270.0
    (128, [2048], [2048], "triton"),  # 1373.6 vs 736.7
    (128, [512] * 8, [512] * 8, "triton"),  # 1246.1 vs 696.7
    (128, [512] * 4, [4096] * 4, "triton"),  # chunked on 3584 cached: 4125.7 vs 2867.6
    (128, [128] + [1] * 32, [128] + [1024] * 32, "flashinfer"),  # mixed: 180.2 vs 599.2
    (128, [512] * 2 + [1] * 62, [512] * 2 + [2048] * 62, "flashinfer"),  # mixed: 661.6 vs 816.1
]


@pytest.mark.parametrize("n, q, kv, winner", MEASURED)
def test_sm90_facts_pick_the_measured_winner(n, q, kv, winner):
    absorbed, expanded = path_costs(DS(n), torch.tensor(q), torch.tensor(kv), SM90_FACTS)
    assert ("triton" if expanded < absorbed else "flashinfer") == winner, (absorbed, expanded)


def test_flops_by_hand():
    d = MLADims(2, 3, 1, 5, 7)  # N, Dn, Dr, Dv, R
    f = step_flops(d, torch.tensor([3, 1]), torch.tensor([4, 6]))
    # seq 0: 3 new tokens on 1 cached -> visible 2 + 3 + 4 = 9; seq 1: decode on 6 -> 6
    assert f.absorbed == pytest.approx(2 * 2 * (3 * 7 + 7 * 5) * 4 + 2 * 2 * (2 * 7 + 1) * 15)
    assert f.expanded_prefill == pytest.approx(2 * 2 * 7 * (3 + 5) * 4 + 2 * 2 * (3 + 1 + 5) * 9)
    assert f.decode == pytest.approx(2 * 2 * (3 * 7 + 7 * 5) * 1 + 2 * 2 * (2 * 7 + 1) * 6)
