"""Serving benchmark: the issue-12 workload in process (host/GPU overlap on and off) and through the
HTTP server (16 and 64 concurrent streaming clients), against the engine of commit 0f20270.

Workload (`autodeploy_mla.serving.bench.Workload.synthetic`): 64 requests, prompts uniform in
256-2048 tokens, 128 generated tokens each (ignore_eos), all arriving at once, seed 0, greedy.
Models (bf16, random weights, backend auto):

- `v2_lite`: the published DeepSeek-V2-Lite config (15.7 B parameters, 27 layers, 64 routed experts
  top-6, 2 shared, N 16, R 512, Dr 64, no q_lora), runtime from model_configs/deepseek_v2.yaml;
- `v3_4layer`: the 4-layer DeepSeek-V3-shaped model of benchmarks/lib/shapes.py (real MLA dims,
  16 routed experts x 1024, top-4), runtime from model_configs/deepseek_v3.yaml.

Per model, after one build, its warm-up (`om.warmup()`) and one untimed pass of the workload
(reported as `first pass`; the baseline likewise reports its second run):

- `in-process overlap`: `bench.run_in_process` (the engine stepped directly, step i+1 launched
  before step i is collected), every step timed on the device: `host share` = 1 - (sum of step
  device times) / wall, i.e. the part of the wall clock the GPU waited for the host;
- `in-process no overlap`: the same with `overlap=False` (launch, wait, then the next step);
- `server cN`: `autodeploy serve`'s app (uvicorn in a thread of this process), N concurrent
  streaming clients (`bench.run_against_server`, httpx), token ids in and out;
- `0f20270`: the engine before this work (host sampling of fp32 logits, no overlap), in a
  subprocess with PYTHONPATH=--baseline-root, the same prompts via `generate_requests` (run twice:
  the first run captures its CUDA graphs; the second is reported).

    python -m benchmarks.serving.serving --out /root/out/serving                 # on the GPU
    python -m benchmarks.serving.serving --render docs/benchmarks/archive/serving_2026-11-23.json   # markdown + plot (CPU ok)
    python -m benchmarks.serving.serving --quick --device cpu --out /tmp/serving # dry run of the plumbing
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

from benchmarks.lib import V2_LITE, v3_4layer

def model_layers(name: str, device: str, quick: bool) -> tuple[str, dict[str, Any]]:
    """(family, config layer) for a model of this benchmark (`quick`: the family's tiny config)."""
    family, hf = {"v2_lite": ("deepseek_v2", V2_LITE), "v3_4layer": ("deepseek_v3", None)}[name]
    layer: dict[str, Any] = {"model": {"device": device, "dtype": "bfloat16" if device != "cpu" else "float32"}}
    if not quick:
        layer["model"]["hf_config"] = hf if hf is not None else v3_4layer()
    return family, layer


# ----------------------------------------------------------------------------- the old engine
def baseline_child(spec_path: Path) -> None:
    """Run in a subprocess whose PYTHONPATH starts with the old package: print one JSON line."""
    spec = json.loads(spec_path.read_text())
    import torch

    from benchmarks.lib import optimize, package
    from benchmarks.lib import SamplingParams

    root = Path(spec["root"]).resolve()
    if root not in Path(package.__file__).resolve().parents:
        raise SystemExit(f"baseline child imported {package.__file__}, not the package under {root}")
    t0 = time.perf_counter()
    om = optimize(spec["family"], [spec["layer"]])
    build_s = time.perf_counter() - t0
    runs = []
    for _ in range(2):
        reqs = om.generate_requests(spec["prompts"], [SamplingParams(max_new_tokens=n) for n in spec["max_tokens"]])
        g = dict(om.last_generation)
        g["failed"] = sum(r.finish_reason == "error" for r in reqs)
        runs.append(g)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    print("BASELINE_JSON " + json.dumps({"build_s": build_s, "first": runs[0], "second": runs[1], "peak_gib": peak}))


def run_baseline(root: Path, family: str, layer: dict, wl: Any, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    spec = {"root": str(root), "family": family, "layer": layer, "prompts": [r.prompt for r in wl.requests],
            "max_tokens": [r.max_tokens for r in wl.requests]}
    spec_path = out_dir / f"baseline_spec_{family}.json"
    spec_path.write_text(json.dumps(spec))
    # the old package first, then this checkout for `benchmarks`; PYTHONSAFEPATH: the working directory
    # (`python -m` puts it first otherwise) does not decide where autodeploy_mla comes from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--baseline-child", str(spec_path)], env=env, cwd=str(root),
                          capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("BASELINE_JSON "):
            res = json.loads(line[len("BASELINE_JSON "):])
            g = res["second"]
            return {"label": "0f20270 (host sampling, no overlap)", "mode": "baseline", "requests": g["requests"],
                    "failed": g["failed"], "generated_tokens": g["generated_tokens"], "wall_s": g["seconds"],
                    "tokens_per_s": g["tokens_per_s"], "first_run_tokens_per_s": res["first"]["tokens_per_s"],
                    "build_s": res["build_s"], "peak_gib": res["peak_gib"]}
    raise RuntimeError(f"baseline child failed (rc {proc.returncode}): {proc.stderr[-3000:]}")


# ----------------------------------------------------------------------------- one model
def bench_model(name: str, args: argparse.Namespace, results: dict[str, Any], save: Any, t_start: float) -> None:
    import torch

    from benchmarks.lib import optimize
    from benchmarks.lib import serving_bench as bench
    from benchmarks.lib import ServerThread

    entry: dict[str, Any] = {"runs": [], "errors": []}
    results["models"][name] = entry
    family, layer = model_layers(name, args.device, args.quick)
    if args.backend:
        layer["transforms"] = {"insert_cached_mla_attention": {"backend": args.backend}}

    def over_budget(phase: str) -> bool:
        if time.perf_counter() - t_start > args.time_budget_s:
            entry["errors"].append(f"{phase}: skipped (over --time-budget-s {args.time_budget_s})")
            save()
            return True
        return False

    def phase(label: str, fn: Any) -> None:
        if over_budget(label):
            return
        print(f"[{name}] {label} ...", flush=True)
        t = time.perf_counter()
        try:
            r = fn()
            r["label"] = label
            entry["runs"].append(r)
            print(f"[{name}] {label}: {r.get('tokens_per_s') or 0:.1f} tok/s, host share "
                  f"{r.get('host_share')}, {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - record it and go on with the next phase
            entry["errors"].append(f"{label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        save()

    t = time.perf_counter()
    if args.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    om = optimize(family, [layer])
    entry["build_s"] = time.perf_counter() - t
    entry["parameters"] = sum(p.numel() for p in om.eager_model.parameters())
    entry["hf_config"] = {k: v for k, v in om.eager_model.config.to_dict().items()
                          if k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "q_lora_rank", "kv_lora_rank", "n_routed_experts", "num_experts_per_tok",
                                   "moe_intermediate_size", "intermediate_size")}
    entry["runtime"] = om.config.runtime.model_dump()
    entry["backends"] = sorted({d.backend for d in om.ctx.artifacts.decisions})
    t = time.perf_counter()
    entry["warmup"] = om.warmup()
    entry["warmup_s"] = time.perf_counter() - t
    wl = bench.Workload.synthetic(args.num_requests, bench.parse_range(args.prompt_len),
                                  bench.parse_range(args.output_len), om.vocab_size, seed=args.seed)
    wl.check_fits(om.seq_info.max_seq_len, name)
    entry["workload"] = wl.description
    print(f"[{name}] built in {entry['build_s']:.1f} s, {entry['parameters'] / 1e9:.2f} B parameters, "
          f"backends {entry['backends']}; {wl.description}", flush=True)
    save()

    # One untimed pass of the workload first: shapes past the warm-up's (other prefill lengths,
    # allocator growth) are met here, not in the first timed run.
    t = time.perf_counter()
    first = bench.run_in_process(om, wl, overlap=True)
    entry["first_pass"] = {"tokens_per_s": first.get("tokens_per_s"), "wall_s": first.get("wall_s"),
                           "seconds": time.perf_counter() - t}
    print(f"[{name}] untimed first pass: {first.get('tokens_per_s') or 0:.1f} tok/s", flush=True)
    phase("in-process overlap", lambda: bench.run_in_process(om, wl, overlap=True))
    phase("in-process no overlap", lambda: bench.run_in_process(om, wl, overlap=False))
    for c in args.concurrency:
        def via_server(c: int = c) -> dict[str, Any]:
            with ServerThread(om, None, name) as url:
                return bench.run_against_server(url, wl, max_concurrency=c, model=name)

        phase(f"server c{c}", via_server)
    if args.device != "cpu":
        entry["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    entry["pages_free_at_end"] = [om.allocator.num_free, om.allocator.num_usable]
    om = None  # free the model (its cache and weights) before the baseline subprocess
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    if args.baseline_root and not over_budget("0f20270"):
        print(f"[{name}] 0f20270 baseline ...", flush=True)
        try:
            left = max(30.0, args.time_budget_s - (time.perf_counter() - t_start) + 60)
            entry["runs"].append(run_baseline(Path(args.baseline_root).resolve(), family, layer, wl, args.out, left))
        except Exception as exc:  # noqa: BLE001
            entry["errors"].append(f"0f20270: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        save()


# ----------------------------------------------------------------------------- report
def render(path: Path) -> None:
    from benchmarks.lib import result_table

    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = ["# Serving: offline throughput and latency, in process and through the HTTP server", "",
             f"Machine: {meta.get('gpu')}, torch {meta.get('torch')}, flashinfer {meta.get('flashinfer')}, "
             f"transformers {meta.get('transformers')}, python {meta.get('python')}.", "",
             f"Command: `{meta.get('command')}` (total {meta.get('total_s', 0):.0f} s).", "",
             "Workload: " + str(next(iter(data["models"].values()), {}).get("workload", "")) +
             "; greedy, ignore_eos, bf16, random weights. `host share` = 1 - (sum of the steps' device "
             "times, CUDA events from a step's first kernel to its sampled ids' copy) / wall: the share of "
             "the wall clock the GPU waited for the host. TTFT from arrival (all at t=0) to the first token; "
             "TPOT = (last - first token) / (tokens - 1) per request; ITL = every gap between tokens "
             "(server: between SSE chunks as the client reads them).", ""]
    for name, m in data["models"].items():
        lines += [f"## {name}", "",
                  f"{m.get('parameters', 0) / 1e9:.2f} B parameters; config {m.get('hf_config')}; backends "
                  f"{m.get('backends')}; build {m.get('build_s', 0):.1f} s, warm-up {m.get('warmup_s', 0):.1f} s; "
                  f"peak {m.get('peak_gib') or 0:.1f} GiB; runtime max_batch_size "
                  f"{m.get('runtime', {}).get('max_batch_size')}, max_num_tokens {m.get('runtime', {}).get('max_num_tokens')}, "
                  f"page_size {m.get('runtime', {}).get('page_size')}; pages free at the end "
                  f"{m.get('pages_free_at_end')}."]
        if m.get("first_pass"):
            lines[-1] += (f" Untimed first pass (in-process overlap, after the warm-up): "
                          f"{m['first_pass']['tokens_per_s']:.1f} tok/s.")
        lines.append("")
        runs = [r for r in m["runs"] if "ttft_ms" in r]
        lines += result_table(runs)
        base = next((r for r in m["runs"] if r.get("mode") == "baseline"), None)
        if base:
            lines += ["", f"0f20270 engine, same prompts: {base['tokens_per_s']:.1f} generated tok/s "
                          f"({base['generated_tokens']} tokens in {base['wall_s']:.2f} s; first run, with graph "
                          f"capture, {base['first_run_tokens_per_s']:.1f}); build {base['build_s']:.1f} s."]
            ov = next((r for r in runs if r["label"] == "in-process overlap"), None)
            if ov:
                lines.append(f"In-process overlap vs 0f20270: **{ov['tokens_per_s'] / base['tokens_per_s']:.2f}x**.")
        for r in runs:
            if r.get("steps_by_kind"):
                k = r["steps_by_kind"]
                lines.append(f"- {r['label']}: {r['steps']} steps; prefill-carrying {k['prefill']['steps']} "
                             f"({k['prefill']['device_s']:.2f} s device), decode-only {k['decode']['steps']} "
                             f"({k['decode']['device_s']:.2f} s device); GPU busy {r['gpu_busy_s']:.2f} s of "
                             f"{r['wall_s']:.2f} s wall.")
        for e in m.get("errors", []):
            lines.append(f"- error: {e}")
        lines.append("")
    lines.append(f"![plot]({path.with_suffix('.png').name})")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(data, path.with_suffix(".png"))
    print("\n".join(lines))


def plot(data: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(data["models"].items())
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4 * len(models)), squeeze=False)
    for row, (name, m) in zip(axes, models):
        runs = m["runs"]
        labels = [r["label"].replace(" (host sampling, no overlap)", "") for r in runs]
        row[0].bar(range(len(runs)), [r.get("tokens_per_s") or 0 for r in runs], color="tab:blue")
        row[0].set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize=8)
        row[0].set_title(f"{name}: generated tokens/s")
        lat = [r for r in runs if "ttft_ms" in r]
        for ax, key, title in ((row[1], "ttft_ms", "TTFT (ms)"), (row[2], "tpot_ms", "TPOT (ms)")):
            for j, p in enumerate(("p50", "p90", "p99")):
                ax.bar([i + (j - 1) * 0.27 for i in range(len(lat))], [r[key][p] or 0 for r in lat], width=0.27,
                       label=p)
            ax.set_xticks(range(len(lat)), [r["label"] for r in lat], rotation=20, ha="right", fontsize=8)
            ax.set_title(f"{name}: {title}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/serving"))
    ap.add_argument("--render", type=Path, help="write the .md and .png next to this JSON and exit")
    ap.add_argument("--models", default="v2_lite,v3_4layer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", help="attention backend (default: auto)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="256:2048")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    ap.add_argument("--baseline-root", help="the old package root (.baseline_0f20270) to compare in a subprocess")
    ap.add_argument("--time-budget-s", type=float, default=420.0, help="skip phases that would start after this")
    ap.add_argument("--quick", action="store_true", help="the families' tiny configs (a CPU dry run)")
    ap.add_argument("--baseline-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_child:
        baseline_child(args.baseline_child)
        return
    if args.render:
        render(args.render)
        return
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = min(args.num_requests, 8), "4:40", "6"
    import torch
    import transformers

    try:
        import flashinfer

        fi = flashinfer.__version__
    except Exception:  # noqa: BLE001
        fi = None
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict[str, Any] = {"meta": {
        "command": "python -m benchmarks.serving.serving " + " ".join(sys.argv[1:]), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "flashinfer": fi,
        "gpu": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "models": {}}
    out_json = args.out / "serving.json"

    def save() -> None:
        results["meta"]["total_s"] = time.perf_counter() - t_start
        out_json.write_text(json.dumps(results, indent=2, default=str))

    for name in args.models.split(","):
        try:
            bench_model(name, args, results, save, t_start)
        except Exception as exc:  # noqa: BLE001 - the next model still runs
            results["models"].setdefault(name, {"runs": [], "errors": []})["errors"].append(
                f"build: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        save()
        gc.collect()
    render(out_json)


if __name__ == "__main__":
    main()
