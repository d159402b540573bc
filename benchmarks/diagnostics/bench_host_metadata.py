"""Host cost of building one step's batch metadata (`SequenceInfo.prepare_step`).

This runs on the host every step, outside any CUDA graph, so it adds directly to decode latency.
Runs on CPU (no GPU needed); writes host_metadata.{md,json,png} into --out.

    python -m benchmarks.diagnostics.bench_host_metadata --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.lib import PageAllocator, SequenceInfo, StepSequence

CASES = [  # (sequences, new tokens each, cached tokens each)
    (1, 1, 1024), (8, 1, 1024), (32, 1, 1024), (64, 1, 4096), (128, 1, 4096), (256, 1, 4096),
    (1, 2048, 0), (4, 512, 3584), (16, 64, 1024),
]


def time_case(b: int, new: int, cached: int, page_size: int, max_seq_len: int, reps: int) -> dict:
    info = SequenceInfo(b, b * new, max_seq_len, page_size)
    alloc = PageAllocator(1 + b * info.max_pages_per_seq, page_size, info.max_pages_per_seq)
    alloc.ensure_many({i: cached + new for i in range(b)})
    seqs = [StepSequence(i, [1] * new, cached) for i in range(b)]
    info.prepare_step(seqs, alloc.pages_of)  # warm-up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        info.prepare_step(seqs, alloc.pages_of)
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"seqs": b, "new": new, "cached": cached, "tokens": b * new, "median_ms": statistics.median(samples),
            "p90_ms": sorted(samples)[int(0.9 * len(samples))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    rows = [time_case(b, n, c, args.page_size, args.max_seq_len, args.reps) for b, n, c in CASES]
    meta = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
            f"{platform.python_version()}", "page_size": args.page_size, "max_seq_len": args.max_seq_len}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_metadata.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = ["# Host cost of one step's metadata (`SequenceInfo.prepare_step`)", "",
             f"Command: `{meta['command']}`; machine: {meta['machine']}; page size {args.page_size}, "
             f"max_seq_len {args.max_seq_len}; median over {args.reps} steps.", "",
             "| sequences | new tokens each | cached each | median ms | p90 ms |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['seqs']} | {r['new']} | {r['cached']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} |" for r in rows]
    (out / "host_metadata.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        dec = [r for r in rows if r["new"] == 1]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([r["seqs"] for r in dec], [r["median_ms"] for r in dec], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode sequences per step")
        ax.set_ylabel("prepare_step ms (host)")
        ax.set_title("Host metadata cost per decode step")
        fig.tight_layout()
        fig.savefig(out / "host_metadata.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
