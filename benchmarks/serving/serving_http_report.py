"""Merge `benchmarks/serving/serving_http.py` results (one directory per device call) into one JSON, and
render it as the markdown table and plot of docs/benchmarks/serving_http.{md,json,png}.

    python -m benchmarks.serving.serving_http_report --collect before=/tmp/r0 A=/tmp/r1 ... --json docs/benchmarks/serving_http.json
    python -m benchmarks.serving.serving_http_report --collect D=/tmp/r4 --append --json docs/benchmarks/serving_http.json
    python -m benchmarks.serving.serving_http_report --render docs/benchmarks/serving_http.json --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path
from typing import Any, Optional

STARTUP_KEYS = ("load_s", "passes_s", "runner_s", "compile_s", "capture_s", "warmup_s", "total_s")


def collect(dirs: list[str], notes: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """One call per LABEL=DIR; `notes[LABEL]`: what a reader must know to compare its rows (kept in the JSON)."""
    calls = []
    for item in dirs:
        label, _, path = item.partition("=")
        files = {}
        for f in sorted(glob.glob(f"{path}/serving_http_*.json")):
            d = json.loads(Path(f).read_text())
            files[Path(f).stem.removeprefix("serving_http_")] = d
        calls.append({"call": label, "files": files, **({"note": notes[label]} if notes and label in notes else {})})
    return {"calls": calls}


def _p50(run: dict[str, Any], key: str) -> Optional[float]:
    v = run.get(key)
    return v.get("p50") if isinstance(v, dict) else None


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render(data: dict[str, Any], out: Path) -> None:
    lines = ["# Serving through HTTP vs in process, and start-up (issue 42)", "",
             "Machine: one NVIDIA H200 (device tool, a fresh machine per call), torch 2.11.0+cu130, triton 3.6, "
             "flashinfer 0.7.2.post1, transformers 5.23.0, python 3.12. Command per run: the `command` field (each "
             "call ran `benchmarks/serving/serving_http.py` phases in the order of benchmarks/serving/serving_http_device.sh). "
             "Workload: 64 requests, prompts 256-2048 tokens (seed 0), 128 new tokens, greedy, ignore_eos, bf16, "
             "random weights, backend auto (flashinfer_mla). HTTP: benchmarks/lib/loadgen.py, the `openai` client, "
             "streaming, token-id prompts with return_token_ids, N in flight from client processes. `step b64/b16`: "
             "median wall time of a decode-only step with 64 / 16 sequences, in process.", ""]
    noted = [f"- **{c['call']}**: {c['note']}" for c in data["calls"] if c.get("note")]
    lines += ["## Notes on calls", "", *noted, ""] if noted else []
    lines += ["## Throughput and latency", "",
              "`in-process`: `generate_requests` on all 64 at once, the pass after an untimed one; `in-process timed per "
              "token`: the next pass, stepped by hand with per-token times. `vs in-process`: HTTP c64 over `in-process` "
              "of the same call (c16 has no in-process twin). `TPOT / step`: TPOT p50 over the decode-only step of the "
              "same concurrency (`step b64` for c64 and in-process, `step b16` for c16).", "",
              "| call | commit | model | run | tok/s | vs in-process | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | "
              "TPOT / step |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for call in data["calls"]:
        files = call["files"]
        by_model: dict[str, dict[str, Any]] = {}
        for name, d in files.items():
            key = d["model"]
            if set(d["runs"]) & set(by_model.get(key, {})):  # an A/B in one call: one row group per run
                key = f"{d['model']} ({name.removeprefix(d['model'] + '_')})"
            by_model.setdefault(key, {}).update({**d["runs"], "_commit": d.get("commit")})
        for model, runs in by_model.items():
            inproc = runs.get("in-process", {}).get("tokens_per_s")
            steps = {64: runs.get("step b64", {}).get("step_ms_p50"), 16: runs.get("step b16", {}).get("step_ms_p50")}
            for name, r in runs.items():
                if name.startswith("_") or name.startswith("step"):
                    continue
                tps = r.get("tokens_per_s")
                conc = 64 if "c64" in name or name.startswith("in-process") else 16 if "c16" in name else None
                step = steps.get(conc) if conc else None
                tpot = _p50(r, "tpot_ms")
                lines.append(f"| {call['call']} | {runs['_commit']} | {model} | {name} | {_f(tps)} | "
                             f"{_f(tps / inproc, 3) if tps and inproc and name.startswith('http c64') else '-'} | "
                             f"{_f(_p50(r, 'ttft_ms'))} | {_f(tpot, 2)} | {_f(_p50(r, 'itl_ms'), 2)} | "
                             f"{_f(tpot / step, 2) if tpot and step else '-'} |")
            for b in (64, 16):
                if steps[b]:
                    lines.append(f"| {call['call']} | {runs['_commit']} | {model} | step b{b} | - | - | - | "
                                 f"{_f(steps[b], 2)} | - | - |")
    lines += ["", "## Start-up of `autodeploy serve` to a ready /health", "",
              "`to ready`: from the command to the first 200 of GET /health. Phases: the engine core's start-up "
              "report (seconds; warm-up = compile + capture + warm steps).", "",
              "| call | commit | model | caches | to ready s | " + " | ".join(k.removesuffix("_s") for k in STARTUP_KEYS)
              + " |", "|---|---|---|---|---:|" + "---:|" * len(STARTUP_KEYS)]
    for call in data["calls"]:
        for name, d in call["files"].items():
            if "startup_to_ready_s" not in d:
                continue
            ph = _startup_phases(d)
            lines.append(f"| {call['call']} | {d.get('commit')} | {d['model']} | {name.removeprefix(d['model']).lstrip('_') or '-'} | "
                         f"{_f(d['startup_to_ready_s'])} | " + " | ".join(_f(ph.get(k)) for k in STARTUP_KEYS) + " |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_http.md").write_text("\n".join(lines) + "\n")
    _plot(data, out / "serving_http.png")


def _startup_phases(d: dict[str, Any]) -> dict[str, float]:
    """The phases the engine core printed on its `start-up:` summary line (from the serve log tail)."""
    tail = (d.get("serve_stop") or {}).get("log_tail", "")
    for line in tail.splitlines():
        if line.strip().startswith("start-up: load"):
            parts = dict(p.strip().rsplit(" ", 2)[:2] for p in line.split(":", 1)[1].split(","))
            return {f"{k.strip()}_s": float(v) for k, v in parts.items()}
    return {}


def _plot(data: dict[str, Any], path: Path) -> None:
    """Generated tokens/s of the V2-Lite config per call: in process and through HTTP at 64 streams."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    bars: list[tuple[str, float]] = []
    for call in data["calls"]:
        for d in call["files"].values():
            if d["model"] == "v2_lite":
                bars += [(f"{call['call']} {name}", r["tokens_per_s"]) for name, r in d["runs"].items()
                         if name in ("in-process", "http c64", "http c64 1 client process")]
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(bars) + 1))
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1], color="tab:blue")
    ax.set_xlabel("generated tokens/s, DeepSeek-V2-Lite config, 64 requests (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collect", nargs="*", default=[], metavar="LABEL=DIR")
    ap.add_argument("--note", action="append", default=[], metavar="LABEL=TEXT",
                    help="a note on the collected call LABEL (rendered above the tables)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--append", action="store_true", help="--collect adds its calls to those in --json")
    ap.add_argument("--render", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args()
    if args.collect:
        notes = dict(n.partition("=")[::2] for n in args.note)
        data = collect(args.collect, notes)
        dest = args.json or args.out / "serving_http.json"
        if args.append and dest.exists():  # later calls added to the ones recorded already
            data = {"calls": json.loads(dest.read_text())["calls"] + data["calls"]}
        dest.write_text(json.dumps(data, indent=1))
    if args.render:
        render(json.loads(args.render.read_text()), args.out)


if __name__ == "__main__":
    main()
