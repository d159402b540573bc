"""Helpers of the benchmark scripts that run without a GPU."""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # benchmarks run as modules from here: python -m benchmarks.<topic>.<name>


def test_inductor_launch_configs_reads_the_chosen_config():
    """e2e_profile --inductor-kernels: per matching Inductor kernel, its size hints, its candidate
    configs and the config its launcher runs (what autotuning settled on); other kernels and objects
    without launchers are skipped, and a kernel held by two modules is listed once."""
    from benchmarks.e2e.e2e_profile import inductor_launch_configs

    def config(xblock, warps):
        return types.SimpleNamespace(kwargs={"XBLOCK": xblock}, num_warps=warps, num_stages=1)

    silu = types.SimpleNamespace(fn=types.SimpleNamespace(src="def k(): pass"), size_hints={"x": 8192},
                                 configs=[config(256, 4), config(128, 4)],
                                 launchers=[types.SimpleNamespace(config=config(128, 4), n_regs=32, n_spills=0,
                                                                  shared=0)])
    norm = types.SimpleNamespace(fn=lambda: None, size_hints={"x": 2048}, configs=[config(64, 1)], launchers=[])
    mod_a = types.SimpleNamespace(__file__="/tmp/a.py", triton_poi_fused_mul_silu_slice_2=silu,
                                  triton_red_fused_rsqrt_0=norm, helper=object())
    mod_b = types.SimpleNamespace(__file__="/tmp/b.py", triton_poi_fused_mul_silu_slice_2=silu)
    got = inductor_launch_configs("silu", [mod_a, mod_b])
    assert got == [{"name": "triton_poi_fused_mul_silu_slice_2", "module": "/tmp/a.py", "size_hints": {"x": 8192},
                    "candidates": [{"XBLOCK": 256, "num_warps": 4, "num_stages": 1},
                                   {"XBLOCK": 128, "num_warps": 4, "num_stages": 1}],
                    "chosen": [{"XBLOCK": 128, "num_warps": 4, "num_stages": 1, "n_regs": 32, "n_spills": 0,
                                "shared": 0}],
                    "src": "def k(): pass"}]
    # After autotuning Inductor drops the candidates (configs=None): the chosen config is still read.
    silu.configs = None
    assert inductor_launch_configs("silu", [mod_a])[0]["candidates"] == []
    assert [k["name"] for k in inductor_launch_configs("triton_", [mod_a])] == [
        "triton_poi_fused_mul_silu_slice_2", "triton_red_fused_rsqrt_0"]


def test_e2e_roofline_runs_each_variant_in_its_own_process(tmp_path):
    """`e2e_roofline.py` (plumbing, tiny dims on CPU): two variants, each built and timed in a child
    process of its own (the second model built in one process measured slower on the GPU), merged into
    one JSON whose runs keep the peaks their process measured."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "benchmarks.e2e.e2e_roofline", "--quick", "--device", "cpu", "--out", str(tmp_path), "--models", "v2_lite",
           "--variants", "base,moe", "--batches", "1", "--contexts", "32", "--chunks", "16", "--steps", "2",
           "--warmup", "1", "--prefill-reps", "1", "--prefill-stream", "0", "--decode-stream", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "e2e_roofline.json").read_text())
    assert data["meta"]["isolated"] and not data["errors"], data["errors"]
    assert [r["variant"] for r in data["runs"]] == ["base", "moe"]
    assert all(r["peaks"]["copy_gb_s"] > 0 and r["decode"] and r["prefill"] for r in data["runs"])
    assert proc.stdout.count("in a fresh process") == 2


def test_host_floor_smoke(tmp_path):
    """`host_floor.py --smoke` (CPU, the kernels through the Triton interpreter): every piece of the
    lean decode call and their sequence are timed and written to the JSON."""
    import json
    import os
    import subprocess

    out = tmp_path / "floor.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.diagnostics.host_floor", "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pieces = json.loads(out.read_text())["pieces"]
    assert "sequence: 2 bmm + 1 empty + 3 launches" in pieces and len(pieces) == 5
    assert all(p["p10_us"] <= p["median_us"] <= p["p90_us"] for p in pieces.values())


def test_read_floor_smoke_and_report(tmp_path):
    """`read_floor.py --smoke` (CPU, the stream kernel through the Triton interpreter) sums a paged
    cache as torch does; `--report-from` renders the committed H200 results without a GPU, with the
    floor-vs-target verdict of every row and both flush modes' tables."""
    import os
    import subprocess

    root = ROOT
    script = ["-m", "benchmarks.kernels.read_floor"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, *script, "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, *script, "--report-from", str(root / "docs/benchmarks/read_floor.json"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "read_floor.md").read_text()
    assert "floor ≤ target?" in md and "clean L2 flush" in md
    assert md.count("| no: unreachable |") == 2  # the two 168 MB Mistral rows under do_bench's flush


def test_bench_mla_kernels_refuses_an_unknown_flush_mode():
    """`--flush` takes the modes FLUSH_MODES names; anything else is an error naming them, not a
    silent default."""
    import pytest
    from benchmarks.lib import FLUSH_MODES, do_bench

    assert FLUSH_MODES == ("zero", "read")
    with pytest.raises(ValueError, match="'dirty'.*zero"):
        do_bench(lambda: None, 1.0, "dirty")


def test_parallel_layouts_report_merges_runs_by_label(tmp_path):
    """Runs of different layouts at the same world size in one table: speed-up over the baseline's queued
    step, the collective share, the served rows; an unknown baseline is refused."""
    import json

    import pytest

    from benchmarks.tp import parallel_layouts_report as rep

    def run(world, stream, layout="data", coll="allgather_reducescatter", share=None):
        row = {"world_size": world, "batch": 64, "context": 1024, "step_ms": stream + 3, "stream_ms": stream,
               "profiled_kernel_ms": stream - 1}
        if share:
            row.update(profiled_allreduce_ms=share * stream, profiled_allreduce_share=share)
        path = tmp_path / f"w{world}_{coll}.json"
        path.write_text(json.dumps({"command": "python tp_decode.py", "layout": layout, "dp_mlp": "replicate",
                                    "ep_collective": coll, "rows": [row],
                                    "worlds": [{"world_size": world, "build_s": 50, "warmup_s": 20,
                                                "max_memory_gb": 30.0, "shard": "x"}]}))
        return str(path)

    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"command": "python serving_http.py", "workload": "64 requests",
                                 "startup_to_ready_s": 100.0,
                                 "runs": {"http c64": {"requests": 64, "failed": 0, "concurrency": 64,
                                                       "tokens_per_s": 2000.0, "ttft_ms": {"p50": 700, "p99": 900},
                                                       "tpot_ms": {"p50": 24.0, "p99": 26.0}}}}))
    out = tmp_path / "out"
    rep.main(["--decode", "one@abc=" + run(1, 20.0), "--decode", "two@def=" + run(2, 10.0, share=0.1),
              "--serve", f"served@def={serve}", "--baseline", "one", "--date", "2026-11-29", "--out", str(out)])
    md = (out / "parallel_layouts.md").read_text()
    assert "| two | def | 2 | data | replicate | allgather_reducescatter | 1024 x 64 | 13.00 | 10.00 | 2.00x |" in md
    assert "1.00 (10%)" in md and "| served | def | http c64 | 100.0 | 64 (0) | 2000 | 700 / 900 |" in md
    assert json.loads((out / "parallel_layouts.json").read_text())["baseline"] == "one"
    with pytest.raises(SystemExit):
        rep.main(["--decode", "one@abc=" + run(1, 20.0), "--baseline", "nope", "--date", "d", "--out", str(out)])
