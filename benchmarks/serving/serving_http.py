"""The issue-42 serving workload through HTTP against the engine in process, with profiles.

Workload (`autodeploy_mla.serving.bench.Workload.synthetic`): 64 requests, prompts uniform in
256-2048 tokens, 128 generated tokens each, greedy, ignore_eos, seed 0; bf16, random weights,
backend auto. Models: `v2_lite` (the published DeepSeek-V2-Lite config) and `v3_4layer` (the
4-layer DeepSeek-V3-shaped model), as in benchmarks/serving/serving.py.

Phases (`--phases`, in this order, each in processes of its own, so nothing is A/B'd against a
model built second in one process):

- `serve`: `autodeploy serve` as users start it (a subprocess: the API server process, and its
  engine-core process that builds and warms up the model), timed from the command to the first
  200 of GET /health (with `AUTODEPLOY_CACHE_DIR` empty or filled by an earlier run: fresh or warm
  start); then `http cN`: benchmarks/lib/loadgen.py (the `openai` client, streaming, token-id prompts,
  N in flight, from client processes of their own; `--single-client`: also from one process, the
  generator's own limit), py-spy sampling both server processes during the first run with
  `--profile`; then Ctrl-C (SIGINT), timed to the exit. `startup`: start and stop only.
- `inproc`: the model built in this process: `om.generate_requests` on all 64 at once (after one
  untimed pass), the same stepped by hand with per-token times (TTFT/TPOT as the engine sees them),
  and `step b64` / `step b16`: the engine stepped by hand on the first 64 / 16 prompts, the wall
  time of every decode-only step with all of them running (with the host/GPU overlap, a step's
  wall time in steady state): the decode-step time the TPOT targets compare with.

    python -m benchmarks.serving.serving_http --model v2_lite --out /tmp/sh --profile --single-client
    python -m benchmarks.serving.serving_http --model v2_lite --phases startup --label warm --out /tmp/sh
    python -m benchmarks.serving.serving_http --model v2_lite --quick --device cpu --out /tmp/sh   # plumbing

The first table of docs/benchmarks/serving_http.md (before the engine core) came from this script at
c75e953, when it served with `ServerThread` (uvicorn and the engine loop in threads of one process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional


from benchmarks.lib import pyspy_markdown, run_load


# ----------------------------------------------------------------------------- py-spy
class PySpy:
    """`py-spy record` of one process (raw collapsed stacks, per thread) until `stop()`."""

    def __init__(self, pid: int, out: Path, rate: int = 100, subprocesses: bool = False) -> None:
        # --idle: a thread waiting (for the GPU, a lock, a compile worker) is where the time goes too;
        # --nonblocking: sampling must not pause the process it measures.
        exe = os.environ.get("PYSPY") or shutil.which("py-spy")
        self.out, self.proc, self.error = out, None, None
        if exe is None:
            self.error = "py-spy not found"
            return
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--threads", "--idle",
               "--nonblocking", "-o", str(out)]
        if subprocesses:
            cmd.append("--subprocesses")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(0.5)
        if self.proc.poll() is not None:
            self.error = f"py-spy exited: {self.proc.stdout.read()[-500:]}"
            self.proc = None

    def stop(self) -> Optional[str]:
        if self.proc is None:
            return self.error
        self.proc.send_signal(signal.SIGINT)
        try:
            log = self.proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            log = "py-spy did not stop"
        return None if self.out.exists() else f"no profile written: {log[-500:]}"


# ----------------------------------------------------------------------------- in-process measurements
def step_times(om: Any, prompts: list[list[int]], max_tokens: int,
               profile_to: Optional[Path] = None) -> dict[str, Any]:
    """Step the engine by hand on all `prompts` at once; the wall time of each decode-only step
    with every prompt running (median and spread), and the run's generated tokens per second.
    `profile_to`: the torch profiler over 10 of those decode steps (from the 20th), its op table
    written there (what a slow step spends its time on: graph replays, kernels, host ops)."""
    import torch

    from benchmarks.lib import SamplingParams

    eng = om.engine()
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
    walls: list[float] = []
    prof: Any = None
    prof_summary: dict[str, Any] = {}
    t0 = last = time.perf_counter()
    gen = 0
    while eng.has_work():
        if profile_to is not None and prof is None and len(walls) == 20:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_from = len(walls)
        nsteps = len(eng.steps)
        new = eng.step()
        now = time.perf_counter()
        gen += len(new)
        launched = eng.steps[nsteps] if len(eng.steps) > nsteps else None
        if launched is not None and launched.num_prefill_tokens == 0 and launched.num_seqs == len(prompts):
            walls.append(now - last)
        last = now
        if prof is not None and not prof_summary and len(walls) >= prof_from + 10:
            if om.device.type == "cuda":
                torch.cuda.synchronize(om.device)
            prof.__exit__(None, None, None)
            ka = prof.key_averages()
            profile_to.write_text(ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n"
                                  + ka.table(sort_by="self_cpu_time_total", row_limit=25))
            prof_summary = {"steps": len(walls) - prof_from, "table": str(profile_to),
                            "cuda_graph_launches": sum(e.count for e in ka if e.key == "cudaGraphLaunch"),
                            "self_cuda_ms": sum(e.self_device_time_total for e in ka) / 1e3,
                            "self_cpu_ms": sum(e.self_cpu_time_total for e in ka) / 1e3}
    eng.drain()
    if om.device.type == "cuda":
        torch.cuda.synchronize(om.device)
    wall = time.perf_counter() - t0
    walls = walls[2:]  # the first decode steps overlap the end of prefill
    return {"batch": len(prompts), "decode_steps": len(walls),
            "step_ms_p50": statistics.median(walls) * 1e3 if walls else None,
            "step_ms_p10": sorted(walls)[len(walls) // 10] * 1e3 if walls else None,
            "step_ms_p90": sorted(walls)[(9 * len(walls)) // 10] * 1e3 if walls else None,
            "tokens_per_s": gen / wall, "generated_tokens": gen, "wall_s": wall,
            **({"profile": prof_summary} if prof_summary else {})}


def in_process(om: Any, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    from benchmarks.lib import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    om.generate_requests(prompts, params)  # untimed: shapes the warm-up did not meet
    reqs = om.generate_requests(prompts, params)
    g = dict(om.last_generation)
    return {"tokens_per_s": g["tokens_per_s"], "wall_s": g["seconds"], "generated_tokens": g["generated_tokens"],
            "failed": g["failed"], "steps": g["steps"]}, [r.generated for r in reqs]


# ----------------------------------------------------------------------------- the server as users start it
def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class ServeProcess:
    """`autodeploy serve` in a subprocess (its engine core in a process of its own), timed from the
    command to the first 200 of GET /health."""

    def __init__(self, family: str, layer: dict[str, Any], out: Path, label: str, env: dict[str, str],
                 world_size: int = 1) -> None:
        import yaml

        from benchmarks.lib import free_port

        cfg_path = out / f"{label}_config.yaml"
        cfg_path.write_text(yaml.safe_dump(layer))
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = out / f"{label}_serve.log"
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "autodeploy_mla.cli", "serve", "--model", family, "--config",
                                      str(cfg_path), "--port", str(self.port), "--served-model-name", "default",
                                      "--log-level", "warning", "--world-size", str(world_size)],
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        import httpx

        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"autodeploy serve exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"not ready after {timeout_s} s: {self.log_path.read_text()[-3000:]}")

    @property
    def engine_pid(self) -> Optional[int]:
        kids = _children(self.proc.pid)
        return max(kids) if kids else None

    def stop(self) -> dict[str, Any]:
        t = time.perf_counter()
        self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "killed after 120 s"
        return {"exit_code": rc, "stop_s": time.perf_counter() - t, "log_tail": self.log_path.read_text()[-4000:]}


def http_runs(url: str, prompts: list[list[int]], args: argparse.Namespace, want: Optional[list[list[int]]],
              spy_pids: list[tuple[str, int]]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    plan = [(int(c), args.client_workers) for c in args.concurrency.split(",")]
    if args.single_client:
        plan.append((plan[0][0], 1))
    for i, (c, workers) in enumerate(plan):
        name = f"http c{c}" + (" 1 client process" if workers == 1 else "")
        if name in runs:  # --concurrency 64,64: the same load again (first-run effects), kept apart
            name += f" (run {i + 1})"
        spies = [PySpy(pid, args.out / f"http_c{c}_{who}_{args.model}.raw") for who, pid in spy_pids] \
            if args.profile and i == 0 else []
        load = run_load(url, "default", prompts, args.output_len, concurrency=c, workers=workers)
        load["summary"]["profile_errors"] = [e for e in (s.stop() for s in spies) if e]
        got = [r["token_ids"] for r in load["requests"]]
        if want is not None:
            load["summary"]["sequences_equal_in_process"] = sum(g == w for g, w in zip(got, want))
            load["summary"]["first_tokens_equal_in_process"] = sum(g[:1] == w[:1] for g, w in zip(got, want))
        runs[name] = {**load["summary"], "timeline": load["timeline"]}
        print(f"{name}: {json.dumps(load['summary'], default=str)}", flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v2_lite", choices=["v2_lite", "v3_4layer", "glm_4_7_flash"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the family's tiny config (plumbing check)")
    ap.add_argument("--phases", default="serve,inproc",
                    help="serve: `autodeploy serve` subprocess (start-up, HTTP runs, stop); startup: the same, start "
                         "and stop only; inproc: build here, in-process runs and step times")
    ap.add_argument("--label", default="", help="suffix of this run's result files")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="256:2048")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="64,16")
    ap.add_argument("--client-workers", type=int, default=8)
    ap.add_argument("--single-client", action="store_true",
                    help="also the first concurrency from one client process (the generator's own limit)")
    ap.add_argument("--profile", action="store_true", help="py-spy the first HTTP run (API and engine processes)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="inproc: the torch profiler over 10 decode steps of each `step bN` (op tables in --out)")
    ap.add_argument("--runtime", action="append", default=[], metavar="KEY=VALUE",
                    help="a `runtime:` setting of the built model (YAML value), e.g. prefix_caching=false: an A/B "
                         "against a tree from before a default changed (the in-process run repeats its prompts)")
    ap.add_argument("--world-size", type=int, default=1,
                    help="serve: `autodeploy serve --world-size N` (data-parallel attention ranks; with --shard)")
    ap.add_argument("--shard", action="append", default=[], metavar="KEY=VALUE",
                    help="a `transforms.shard` setting of the served model, e.g. attention=data (issue 47's layouts)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.model}{'_' + args.label if args.label else ''}"
    res: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "python": platform.python_version(), "model": args.model, "runs": {},
                           "cache_dir": os.environ.get("AUTODEPLOY_CACHE_DIR"),
                           "commit": os.environ.get("AUTODEPLOY_COMMIT")}

    def save() -> None:
        (args.out / f"serving_http_{tag}.json").write_text(json.dumps(res, indent=1, default=str))

    t_start = time.perf_counter()
    from benchmarks.lib import serving_bench as bench
    from benchmarks.lib import PUBLISHED, v3_4layer

    family = {"v2_lite": "deepseek_v2", "v3_4layer": "deepseek_v3", "glm_4_7_flash": "glm_4_7_flash"}[args.model]
    layer: dict[str, Any] = {"model": {"device": args.device,
                                       "dtype": "bfloat16" if args.device != "cpu" else "float32"}}
    import yaml

    for kv in args.runtime:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--runtime takes KEY=VALUE, got {kv!r}")
        layer.setdefault("runtime", {})[key] = yaml.safe_load(value)
    for kv in args.shard:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--shard takes KEY=VALUE, got {kv!r}")
        layer.setdefault("transforms", {}).setdefault("shard", {})[key] = yaml.safe_load(value)
    if not args.quick:
        layer["model"]["hf_config"] = v3_4layer() if args.model == "v3_4layer" else PUBLISHED[args.model]
    phases = args.phases.split(",")
    lo, _, hi = args.prompt_len.partition(":")
    vocab = (layer["model"].get("hf_config") or {}).get("vocab_size") or 256
    wl = bench.Workload.synthetic(args.num_requests, (int(lo), int(hi or lo)), (args.output_len, args.output_len),
                                  vocab, seed=0)
    prompts = [r.prompt for r in wl.requests]
    res["workload"] = wl.description
    want: Optional[list[list[int]]] = None

    if "serve" in phases or "startup" in phases:
        srv = ServeProcess(family, layer, args.out, tag, dict(os.environ), args.world_size)
        try:
            res["startup_to_ready_s"] = srv.wait_ready()
            print(f"autodeploy serve ready after {res['startup_to_ready_s']:.1f} s", flush=True)
            save()
            if "serve" in phases:
                pids = [("api", srv.proc.pid)] + ([("engine", srv.engine_pid)] if srv.engine_pid else [])
                res["runs"].update(http_runs(srv.url, prompts, args, None, pids))
        finally:
            res["serve_stop"] = srv.stop()
        save()

    if "inproc" in phases:
        import torch

        from benchmarks.lib import optimize

        res["versions"] = {"torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        t = time.perf_counter()
        om = optimize(family, [layer])
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        om.warmup()
        res["inproc_startup"] = {"build_s": build_s, "warmup_s": time.perf_counter() - t,
                                 "report": om.report().get("startup")}
        wl.check_fits(om.seq_info.max_seq_len, args.model)
        res["runs"]["in-process"], want = in_process(om, prompts, args.output_len)
        run = bench.run_in_process(om, wl, time_steps=False)
        res["runs"]["in-process timed per token"] = {k: run[k] for k in ("tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms")
                                                     if k in run}
        print(f"in-process: {json.dumps(res['runs']['in-process'])}; per token: "
              f"{json.dumps(res['runs']['in-process timed per token'], default=str)}", flush=True)
        # which kernels served those runs (routes per backend session: the A/B's first suspect)
        res["backend_sessions"] = om.report().get("backend_sessions")
        for b in sorted({min(64, len(prompts)), min(16, len(prompts))}, reverse=True):
            prof_to = args.out / f"step_b{b}_{tag}_profile.txt" if args.torch_profile else None
            res["runs"][f"step b{b}"] = step_times(om, prompts[:b], args.output_len, prof_to)
            print(f"step b{b}: {res['runs'][f'step b{b}']}", flush=True)
        save()
    res["total_s"] = time.perf_counter() - t_start
    save()
    md = [f"# serving_http {tag} ({res['date']}, commit {res.get('commit')})", "", f"`{res['command']}`", "", "```",
          json.dumps({k: v for k, v in res.items() if k not in ("command",)}, indent=1, default=str)[:20000], "```", ""]
    for p in sorted(args.out.glob(f"*_{tag}.raw")):
        md += pyspy_markdown(p, top=25)
    (args.out / f"serving_http_{tag}.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
