"""One table of the parallel layouts (issue 47): tp_decode runs of several layouts against one GPU, and
the same layouts served (`serving_http --world-size N`).

Each tp_decode run measures one layout (its JSON says which: layout, MLP placement, EP collective);
runs of different layouts at the same world size cannot share one `tp_decode --render` table, so this
merges them by label. The speed-up is the queued step (the engine's steady state) of the baseline run
(one GPU) over each run's; the collective share comes from the run's profile (NCCL kernels' device
time, incl. waiting on the slower rank, over all kernels').

    python -m benchmarks.tp.parallel_layouts_report \\
        --decode "1 GPU@73d7a2d=w1/tp_decode.json" --decode "DP+EP ag@73d7a2d=ag/tp_decode.json" \\
        --serve "DP+EP ag, 2 GPUs@348dc4a=h/serving_http_glm_4_7_flash.json" --baseline "1 GPU" \\
        --date 2026-11-29 --note "..." --out docs/benchmarks    # writes parallel_layouts.{md,json,png}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from benchmarks.lib import pyplot


def _spec(text: str) -> tuple[str, str, Path]:
    """'LABEL@COMMIT=PATH' -> (label, commit, path)."""
    head, sep, path = text.rpartition("=")
    label, at, commit = head.partition("@")
    if not sep or not at or not label or not commit:
        raise argparse.ArgumentTypeError(f"expected LABEL@COMMIT=PATH, got {text!r}")
    return label, commit, Path(path)


def decode_rows(specs: list[tuple[str, str, Path]]) -> list[dict[str, Any]]:
    rows = []
    for label, commit, path in specs:
        data = json.loads(path.read_text())
        worlds = {w["world_size"]: w for w in data["worlds"]}
        for r in data["rows"]:
            w = worlds.get(r["world_size"], {})
            rows.append({
                "label": label, "commit": commit, "command": data["command"],
                "world_size": r["world_size"], "layout": data.get("layout") or "tensor",
                "dp_mlp": data.get("dp_mlp"), "ep_collective": data.get("ep_collective"),
                "batch": r["batch"], "context": r["context"], "error": r.get("error"),
                **{k: r.get(k) for k in ("step_ms", "stream_ms", "profiled_kernel_ms", "profiled_allreduce_ms",
                                         "profiled_allreduce_share", "paths")},
                "build_s": w.get("build_s"), "warmup_s": w.get("warmup_s"), "peak_memory_gb": w.get("max_memory_gb"),
                "shard": w.get("shard"), "environment": data.get("environment"),
            })
    return rows


def serve_rows(specs: list[tuple[str, str, Path]]) -> list[dict[str, Any]]:
    rows = []
    for label, commit, path in specs:
        data = json.loads(path.read_text())
        for name, run in data.get("runs", {}).items():
            rows.append({"label": label, "commit": commit, "command": data["command"], "run": name,
                         "workload": data.get("workload"), "startup_to_ready_s": data.get("startup_to_ready_s"),
                         **{k: run.get(k) for k in ("requests", "failed", "concurrency", "tokens_per_s", "ttft_ms",
                                                    "tpot_ms")}})
    return rows


def _f(v: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(out: Path, decode: list[dict[str, Any]], serve: list[dict[str, Any]], baseline: str, date: str,
           notes: list[str]) -> str:
    base = next((r for r in decode if r["label"] == baseline and r.get("stream_ms")), None)
    lines = ["# Parallel layouts: data-parallel attention + expert-parallel MoE (NVIDIA H200)", "",
             f"Date {date}. Commands: per row below (`python -m benchmarks.tp.tp_decode ...`, "
             "`python -m benchmarks.serving.serving_http ...`); merged by `python -m "
             "benchmarks.tp.parallel_layouts_report`.", "",
             "Decode step of the whole batch (each data-parallel rank runs batch / world of its sequences). Queued = "
             "steps queued as the engine queues them (its steady state, the inter-token time a batch sees); isolated "
             "adds the host's metadata and the sampling sync per step. Speed-up = the baseline's queued step over "
             "the row's. Collectives = NCCL kernels' device time per step on the slower rank (incl. waiting for the "
             "other), from 3 profiled steps.", "",
             "| run | commit | GPUs | attention | dense MLPs | experts by | context x batch | isolated ms | queued ms "
             "| speed-up (queued) | kernels ms | collectives ms (share) | build + warm-up s | peak GiB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        sp = (f"{base['stream_ms'] / r['stream_ms']:.2f}x" if base and r.get("stream_ms") else "-")
        coll = ("-" if not r.get("profiled_allreduce_ms") else
                f"{r['profiled_allreduce_ms']:.2f} ({r['profiled_allreduce_share']:.0%})")
        att = "data" if r["layout"] == "data" and r["world_size"] > 1 else ("-" if r["world_size"] == 1 else r["layout"])
        lines.append(f"| {r['label']} | {r['commit']} | {r['world_size']} | {att} | "
                     f"{(r['dp_mlp'] or '-') if r['world_size'] > 1 else '-'} | "
                     f"{(r['ep_collective'] or '-') if r['world_size'] > 1 else '-'} | {r['context']} x {r['batch']} | "
                     f"{_f(r.get('step_ms'))} | {_f(r.get('stream_ms'))} | {sp} | {_f(r.get('profiled_kernel_ms'))} | "
                     f"{coll} | {_f(r.get('build_s'), '{:.0f}')} + {_f(r.get('warmup_s'), '{:.0f}')} | "
                     f"{_f(r.get('peak_memory_gb'), '{:.1f}')} |")
    if serve:
        lines += ["", "Served (`autodeploy serve --world-size N`, the `openai` client, streaming; "
                  f"workload: {serve[0]['workload']}):", "",
                  "| run | commit | HTTP run | ready after s | requests (failed) | tokens/s | TTFT p50 / p99 ms "
                  "| TPOT p50 / p99 ms |", "|---|---|---|---|---|---|---|---|"]
        for r in serve:
            lines.append(f"| {r['label']} | {r['commit']} | {r['run']} | {_f(r['startup_to_ready_s'], '{:.1f}')} | "
                         f"{r['requests']} ({r['failed']}) | {_f(r['tokens_per_s'], '{:.0f}')} | "
                         f"{_f(r['ttft_ms']['p50'], '{:.0f}')} / {_f(r['ttft_ms']['p99'], '{:.0f}')} | "
                         f"{_f(r['tpot_ms']['p50'])} / {_f(r['tpot_ms']['p99'])} |")
    lines += ["", "Commands:", ""] + [f"- {r['label']}: `{r['command']}`" for r in decode + serve]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    md = "\n".join(lines) + "\n"
    (out / "parallel_layouts.md").write_text(md)
    (out / "parallel_layouts.json").write_text(json.dumps(
        {"date": date, "baseline": baseline, "decode": decode, "serve": serve, "notes": notes}, indent=1, default=str))
    plt = pyplot()
    if plt is not None:
        ok = [r for r in decode if r.get("stream_ms")]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([f"{r['label']} ({r['commit']})" for r in ok], [r["stream_ms"] for r in ok], color="tab:blue",
                label="queued step")
        ax.barh([f"{r['label']} ({r['commit']})" for r in ok], [r.get("profiled_allreduce_ms") or 0 for r in ok],
                color="tab:orange", label="collectives (profiled)")
        ax.set_xlabel("ms per decode step (batch 64 x 1k context)")
        ax.invert_yaxis()
        ax.legend()
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "parallel_layouts.png", dpi=120)
    return md


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", type=_spec, action="append", default=[], metavar="LABEL@COMMIT=PATH",
                    help="a tp_decode JSON")
    ap.add_argument("--serve", type=_spec, action="append", default=[], metavar="LABEL@COMMIT=PATH",
                    help="a serving_http JSON")
    ap.add_argument("--baseline", required=True, help="the --decode label the speed-ups divide (one GPU)")
    ap.add_argument("--date", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.baseline not in {label for label, _, _ in args.decode}:
        ap.error(f"--baseline {args.baseline!r} names no --decode run")
    args.out.mkdir(parents=True, exist_ok=True)
    print(render(args.out, decode_rows(args.decode), serve_rows(args.serve), args.baseline, args.date, args.note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
