"""benchmarks/e2e/sparse_depth.py (issue 45 item 4) runs end to end on the CPU at tiny sizes (--smoke): both
models build, decode, and the indexer's share is measured and written with the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_sparse_depth_smoke(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    # the package importable from a checkout that is not pip-installed, as pytest's rootdir makes it here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "benchmarks.e2e.sparse_depth", "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=repo)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads((tmp_path / "sparse_mla_depth.json").read_text())
    assert data["smoke"] and len(data["rows"]) == 1
    row = data["rows"][0]
    assert row["dense_backends"] == ["torch"] and row["sparse_backends"] == ["torch"]
    for kind in ("dense", "sparse"):
        assert row[kind]["step_ms"] > 0 and row[kind]["steps"] == 2
    assert row["dense"]["indexer_ms"] == 0 and 0 < row["sparse"]["indexer_share"] < 1
    assert "| sparse / dense |" in (tmp_path / "sparse_mla_depth.md").read_text()
