"""benchmarks/e2e/sparse_depth.py (issue 45 item 4) runs end to end on the CPU at tiny sizes (--smoke): both
models build, decode, and the indexer's share is measured and written with the table."""

from __future__ import annotations

import json
from pathlib import Path

from background_runs import BackgroundRuns, run_module


def _smoke(out: Path) -> dict:
    return run_module("benchmarks.e2e.sparse_depth", out, "--smoke")


# The smoke (two model builds in a process of its own) in a low-priority background driver from the
# start of the session (tests/background_runs.py), overlapping the tests before this file.
_BACKGROUND = BackgroundRuns(__name__, {"smoke": _smoke}, {"smoke": ["smoke"]})


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected
smoke = _BACKGROUND.fixture("smoke")


def test_sparse_depth_smoke(smoke):
    data = json.loads(smoke["sparse_mla_depth.json"])
    assert data["smoke"] and len(data["rows"]) == 1
    row = data["rows"][0]
    assert row["dense_backends"] == ["torch"] and row["sparse_backends"] == ["torch"]
    for kind in ("dense", "sparse"):
        assert row[kind]["step_ms"] > 0 and row[kind]["steps"] == 2
    assert row["dense"]["indexer_ms"] == 0 and 0 < row["sparse"]["indexer_share"] < 1
    assert "| sparse / dense |" in smoke["sparse_mla_depth.md"]
