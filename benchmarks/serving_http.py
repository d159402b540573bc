"""The issue-42 serving workload through HTTP against the engine in process, with profiles.

Workload (`autodeploy_mla.serving.bench.Workload.synthetic`): 64 requests, prompts uniform in
256-2048 tokens, 128 generated tokens each, greedy, ignore_eos, seed 0; bf16, random weights,
backend auto. Models: `v2_lite` (the published DeepSeek-V2-Lite config) and `v3_4layer` (the
4-layer DeepSeek-V3-shaped model), as in benchmarks/serving.py.

In one process: the model is built (`optimize`) and warmed up, each start-up phase timed (py-spy
samples the start-up with `--profile`); then

- `in-process`: `om.generate_requests` on all 64 at once (after one untimed pass);
- `step b64` / `step b16`: the engine stepped by hand on the first 64 / 16 prompts, the wall time
  of every decode-only step with all of them running: the decode-step time the TPOT targets
  compare with (with the engine's host/GPU overlap, a step's wall time in steady state);
- `http cN`: the server (`--server thread`: `ServerThread`, uvicorn and the engine loop in threads
  of this process), loaded by benchmarks/loadgen.py (the `openai` client, streaming, token-id
  prompts, N in flight, from client processes of their own); py-spy samples this process during
  the first one with `--profile`. Greedy tokens are compared with the in-process ones.

    python benchmarks/serving_http.py --model v2_lite --out /tmp/sh --profile
    python benchmarks/serving_http.py --model v2_lite --quick --device cpu --out /tmp/sh   # plumbing
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from loadgen import run_load  # noqa: E402
from pyspy_summary import markdown as pyspy_markdown  # noqa: E402
from serving import model_layers  # noqa: E402


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
def step_times(om: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Step the engine by hand on all `prompts` at once; the wall time of each decode-only step
    with every prompt running (median and spread), and the run's generated tokens per second."""
    import torch

    from autodeploy_mla.runtime.sampling import SamplingParams

    eng = om.engine()
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
    walls: list[float] = []
    t0 = last = time.perf_counter()
    gen = 0
    while eng.has_work():
        nsteps = len(eng.steps)
        new = eng.step()
        now = time.perf_counter()
        gen += len(new)
        launched = eng.steps[nsteps] if len(eng.steps) > nsteps else None
        if launched is not None and launched.num_prefill_tokens == 0 and launched.num_seqs == len(prompts):
            walls.append(now - last)
        last = now
    eng.drain()
    if om.device.type == "cuda":
        torch.cuda.synchronize(om.device)
    wall = time.perf_counter() - t0
    walls = walls[2:]  # the first decode steps overlap the end of prefill
    return {"batch": len(prompts), "decode_steps": len(walls),
            "step_ms_p50": statistics.median(walls) * 1e3 if walls else None,
            "step_ms_p10": sorted(walls)[len(walls) // 10] * 1e3 if walls else None,
            "step_ms_p90": sorted(walls)[(9 * len(walls)) // 10] * 1e3 if walls else None,
            "tokens_per_s": gen / wall, "generated_tokens": gen, "wall_s": wall}


def in_process(om: Any, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    from autodeploy_mla.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    om.generate_requests(prompts, params)  # untimed: shapes the warm-up did not meet
    reqs = om.generate_requests(prompts, params)
    g = dict(om.last_generation)
    return {"tokens_per_s": g["tokens_per_s"], "wall_s": g["seconds"], "generated_tokens": g["generated_tokens"],
            "failed": g["failed"], "steps": g["steps"]}, [r.generated for r in reqs]


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v2_lite", choices=["v2_lite", "v3_4layer"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the family's tiny config (plumbing check)")
    ap.add_argument("--server", default="thread", choices=["thread"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="256:2048")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="64,16")
    ap.add_argument("--client-workers", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="py-spy the start-up and the first HTTP run")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "python": platform.python_version(), "model": args.model, "server": args.server, "runs": {}}

    def save() -> None:
        (args.out / f"serving_http_{args.model}.json").write_text(json.dumps(res, indent=1, default=str))

    spy = PySpy(os.getpid(), args.out / f"startup_{args.model}.raw", rate=20) if args.profile else None
    t_start = time.perf_counter()
    import torch

    from autodeploy_mla import optimize
    from autodeploy_mla.serving import bench

    res["versions"] = {"torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip() or os.environ.get("AUTODEPLOY_COMMIT")
    except OSError:
        res["commit"] = os.environ.get("AUTODEPLOY_COMMIT")
    family, layer = model_layers(args.model, args.device, args.quick)
    passes: list[tuple[str, float]] = []
    t = time.perf_counter()
    om = optimize(family, [layer], on_pass=lambda rec: passes.append((rec.name, rec.seconds)))
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    warm = om.warmup()
    warm_s = time.perf_counter() - t
    res["startup"] = {"import_s": t_start and (time.perf_counter() - t_start) - build_s - warm_s,
                      "build_s": build_s, "passes_s": sum(s for _, s in passes),
                      "passes": dict(passes), "warmup_s": warm_s, "warmup": warm,
                      "report_startup": om.report().get("startup")}
    if spy is not None:
        res["startup"]["profile_error"] = spy.stop()
    print(f"build {build_s:.1f} s (passes {res['startup']['passes_s']:.1f} s), warm-up {warm_s:.1f} s", flush=True)
    save()

    lo, _, hi = args.prompt_len.partition(":")
    wl = bench.Workload.synthetic(args.num_requests, (int(lo), int(hi or lo)), (args.output_len, args.output_len),
                                  om.vocab_size, seed=0)
    wl.check_fits(om.seq_info.max_seq_len, args.model)
    prompts = [r.prompt for r in wl.requests]
    res["workload"] = wl.description
    res["runs"]["in-process"], want = in_process(om, prompts, args.output_len)
    print(f"in-process: {res['runs']['in-process']['tokens_per_s']:.1f} tok/s", flush=True)
    for b in sorted({min(64, len(prompts)), min(16, len(prompts))}, reverse=True):
        res["runs"][f"step b{b}"] = step_times(om, prompts[:b], args.output_len)
        print(f"step b{b}: {res['runs'][f'step b{b}']}", flush=True)
    save()

    from autodeploy_mla.serving.server import ServerThread

    for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
        spy = PySpy(os.getpid(), args.out / f"http_c{c}_{args.model}.raw") if args.profile and i == 0 else None
        with ServerThread(om, None, "default") as url:
            load = run_load(url, "default", prompts, args.output_len, concurrency=c, workers=args.client_workers)
        if spy is not None:
            load["summary"]["profile_error"] = spy.stop()
        got = [r["token_ids"] for r in load["requests"]]
        load["summary"]["tokens_equal_in_process"] = sum(g == w for g, w in zip(got, want))
        res["runs"][f"http c{c}"] = load["summary"]
        print(f"http c{c}: {load['summary']}", flush=True)
        save()
    res["total_s"] = time.perf_counter() - t_start
    save()
    md = [f"# serving_http {args.model} ({res['date']}, commit {res.get('commit')}, {res['versions']})", "",
          f"`{res['command']}`", "", f"Start-up: {json.dumps(res['startup'], default=str)[:2000]}", "", "```",
          json.dumps(res["runs"], indent=1, default=str), "```", ""]
    for p in sorted(args.out.glob(f"*_{args.model}.raw")):
        md += pyspy_markdown(p, top=25, rate_hz=20.0 if p.name.startswith("startup") else 100.0)
    (args.out / f"serving_http_{args.model}.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
