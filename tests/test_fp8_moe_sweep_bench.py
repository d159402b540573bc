"""The FP8 MoE launch-config sweep's own plumbing on the CPU (`--smoke`: tiny shapes, Triton interpreted):
every row has a time or the error that stopped it, the FP8 rows match the fp32 emulation, and the
tables (best per size, every config per size) and the JSON are written; the sorted-rows path
(`persistent_sorted`) has its own rows."""

from __future__ import annotations

import json
from pathlib import Path

from background_runs import BackgroundRuns, written
from benchmarks.moe import sweep_moe_fp8


def _smoke(out: Path) -> dict:
    assert sweep_moe_fp8.main(["--smoke", "--out", str(out / "smoke")]) == 0
    return written(out / "smoke")


def _failing(out: Path) -> dict:
    # 48 columns per down tile: tl.arange needs a power of two, so the down kernel fails to build (the
    # driver is a process of its own: the module's grid is changed there only)
    sweep_moe_fp8.SMOKE_GRID = {"block_m": (16,), "num_warps": (4,), "num_stages": (1,), "down_n": (48,)}
    sweep_moe_fp8.main(["--smoke", "--no-bf16", "--no-sorted", "--out", str(out / "failing")])
    return written(out / "failing")


# Both sweeps (Triton interpreted: ~20 s) in a low-priority background driver from the start of the
# session (tests/background_runs.py), overlapping the tests before this file.
_BACKGROUND = BackgroundRuns(__name__, {"smoke": _smoke, "failing": _failing},
                             {"smoke": ["smoke"], "failing": ["failing"]})


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected
smoke = _BACKGROUND.fixture("smoke")
failing = _BACKGROUND.fixture("failing")


def test_smoke_run_writes_every_row_and_the_best_per_size(smoke):
    res = json.loads(smoke["moe_fp8_sweep.json"])
    rows = res["rows"]
    assert res["peaks"]["fp8_tflops"] > 0 and res["machine"]["command"]
    assert {(r["t"], r["kind"]) for r in rows} == {(t, k) for t in (5, 24) for k in ("bf16", "default", "grid", "sorted")}
    assert all(r["us"] is not None and r["bytes_floor_us"] > 0 and r["flop_floor_us"] > 0 for r in rows)
    fp8 = [r for r in rows if r["kind"] != "bf16"]
    assert all(r["rel_err"] < 1e-5 and r["x_bf16"] > 0 and r["x_floor"] > 0 for r in fp8)  # fp32: the emulation
    assert {r["config"] for r in rows if r["kind"] == "grid"} == {"bm16 w4 s1 dn32", "bm32 w4 s1 dn32"}
    assert {r["config"] for r in rows if r["kind"] == "sorted"} == {"sorted bm16 w4 s1 dn32", "sorted bm16 w4 s1 dn64"}
    md = smoke["moe_fp8_sweep.md"]
    assert "## Best config per size" in md and "| tiny | 5 | " in md and "| tiny | 24 | " in md
    assert "| sorted bm16 w4 s1 dn" in md  # the best sorted config per size, and its rows
    assert "## tiny (E 4, top-2, H 128, I 64), T=24" in md


def test_a_config_that_fails_is_a_row_with_its_error(failing):
    rows = json.loads(failing["moe_fp8_sweep.json"])["rows"]
    bad = [r for r in rows if r["kind"] == "grid"]
    assert bad and all(r["us"] is None and r["note"] for r in bad)
    assert all(r["us"] is not None for r in rows if r["kind"] == "default")
    assert not any(r["kind"] == "sorted" for r in rows)
    assert "bm16 w4 s1 dn48" in failing["moe_fp8_sweep.md"]
