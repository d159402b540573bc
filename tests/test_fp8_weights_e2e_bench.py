"""benchmarks/e2e/fp8_weights_e2e.py (issue 44, targets 2 and 3) runs end to end on the CPU at tiny dims
(--smoke): the three V2-Lite builds in their own processes, the FP8 / bf16 ratios and the accuracy
comparison written with the table; the Mistral-Small-4 mode's build facts, cache capacity and bench."""

from __future__ import annotations

import json
from pathlib import Path

from background_runs import BackgroundRuns, run_module

MODULE = "benchmarks.e2e.fp8_weights_e2e"


def _v2_lite(out: Path) -> dict:
    """All three phases, then bf16 alone into the same --out (it keeps the others' results)."""
    first = run_module(MODULE, out, "--smoke")
    again = run_module(MODULE, out, "--smoke", "--phases", "bf16", "--no-accuracy")
    return {"first": first, "again": again}


def _mistral(out: Path) -> dict:
    return run_module(MODULE, out, "--smoke", "--model", "mistral_small_4_119b")


# Both smokes (several model builds in processes of their own) run in a low-priority background driver
# from the start of the session (tests/background_runs.py), overlapping the tests before this file.
_BACKGROUND = BackgroundRuns(__name__, {"v2_lite": _v2_lite, "mistral": _mistral},
                             {"v2_lite_smoke": ["v2_lite"], "mistral_smoke": ["mistral"]})


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected
v2_lite_smoke = _BACKGROUND.fixture("v2_lite", "v2_lite_smoke")
mistral_smoke = _BACKGROUND.fixture("mistral", "mistral_smoke")


def test_v2_lite_smoke_times_both_builds_and_compares_fp8_with_its_dequantized_weights(v2_lite_smoke):
    data = json.loads(v2_lite_smoke["first"]["fp8_weights_e2e.json"])
    ph = data["phases"]
    assert set(ph) == {"bf16", "fp8", "dequant"} and not any("error" in r for r in ph.values())
    assert ph["bf16"]["fp8_linears"] == {} and ph["fp8"]["fp8_linears"] and ph["dequant"]["fp8_linears"] == {
        "torch": sum(ph["fp8"]["fp8_linears"].values())}
    for name in ("bf16", "fp8"):
        assert ph[name]["decode"]["step_ms"] > 0 and ph[name]["prefill"]["tokens_per_s"] > 0
    assert "dequant" in ph and "decode" not in ph["dequant"]  # the reference is not timed
    s = data["summary"]
    assert s["decode_metric"] == "step_ms" and s["decode_step_ms_ratio"] > 0 and s["prefill_ratio"] > 0
    acc = data["accuracy"]
    # on the CPU both builds run the reference ops (W8A16 on the same FP8 weights): the same model
    assert acc["positions_identical"] == 1.0 and acc["picks_identical"] == 1.0
    assert acc["logit_rel_l2_max"] < 1e-5 and acc["forced_positions"] == 2 * 16
    md = v2_lite_smoke["first"]["fp8_weights_e2e.md"]
    assert "target <= 0.6" in md and "target >= 1.4" in md and "positions identical" in md
    # phases run alone keep the others' results from the JSON in --out
    again = json.loads(v2_lite_smoke["again"]["fp8_weights_e2e.json"])
    assert set(again["phases"]) == {"bf16", "fp8", "dequant"} and again["accuracy"] == acc


def test_mistral_small_4_smoke_reports_build_memory_capacity_and_bench(mistral_smoke):
    r = json.loads(mistral_smoke["fp8_weights_e2e_mistral_small_4_119b.json"])["phases"]["serve"]
    assert "error" not in r and r["build_s"] > 0 and r["fp8_linears"]
    assert r["cache"]["pages"] > 0 and r["cache"]["tokens"] == r["cache"]["pages"] * r["cache"]["page_size"]
    b = r["bench"]
    assert b["failed"] == 0 and b["generated_tokens"] == 3 * 4 and b["tokens_per_s"] > 0
    assert b["ttft_ms"]["p50"] > 0 and b["tpot_ms"]["p50"] > 0
