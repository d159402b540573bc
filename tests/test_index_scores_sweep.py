"""benchmarks/kernels/sweep_index_scores.py --quick: every swept launch config of the DSA indexer's score
kernel (one and several key tiles per program) matches the fp32 reference under the interpreter, and
the table names the config the op launches with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_index_scores_sweep_quick(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.sweep_index_scores", "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=repo)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads((tmp_path / "index_scores_sweep.json").read_text())
    assert len(res["rows"]) == 2 and {r["config"]["kv_iters"] for r in res["rows"]} == {1, 2}
    for r in res["rows"]:
        assert "error" not in r and r["rel_err"] < 1e-5, r
    assert sum(r["chosen"] for r in res["rows"]) == 1
    assert "(current)" in (tmp_path / "index_scores_sweep.md").read_text()
