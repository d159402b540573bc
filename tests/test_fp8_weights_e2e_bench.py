"""benchmarks/e2e/fp8_weights_e2e.py (issue 44, targets 2 and 3) runs end to end on the CPU at tiny dims
(--smoke): the three V2-Lite builds in their own processes, the FP8 / bf16 ratios and the accuracy
comparison written with the table; the Mistral-Small-4 mode's build facts, cache capacity and bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "benchmarks.e2e.fp8_weights_e2e", "--smoke", "--out", str(tmp_path),
                          *extra], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_v2_lite_smoke_times_both_builds_and_compares_fp8_with_its_dequantized_weights(tmp_path):
    _run(tmp_path)
    data = json.loads((tmp_path / "fp8_weights_e2e.json").read_text())
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
    md = (tmp_path / "fp8_weights_e2e.md").read_text()
    assert "target <= 0.6" in md and "target >= 1.4" in md and "positions identical" in md
    # phases run alone keep the others' results from the JSON in --out
    _run(tmp_path, "--phases", "bf16", "--no-accuracy")
    again = json.loads((tmp_path / "fp8_weights_e2e.json").read_text())
    assert set(again["phases"]) == {"bf16", "fp8", "dequant"} and again["accuracy"] == acc


def test_mistral_small_4_smoke_reports_build_memory_capacity_and_bench(tmp_path):
    _run(tmp_path, "--model", "mistral_small_4_119b")
    r = json.loads((tmp_path / "fp8_weights_e2e_mistral_small_4_119b.json").read_text())["phases"]["serve"]
    assert "error" not in r and r["build_s"] > 0 and r["fp8_linears"]
    assert r["cache"]["pages"] > 0 and r["cache"]["tokens"] == r["cache"]["pages"] * r["cache"]["page_size"]
    b = r["bench"]
    assert b["failed"] == 0 and b["generated_tokens"] == 3 * 4 and b["tokens_per_s"] > 0
    assert b["ttft_ms"]["p50"] > 0 and b["tpot_ms"]["p50"] > 0
