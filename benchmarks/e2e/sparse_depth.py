"""Sparse MLA at depth (issue 45, item 4): a sparse decode step vs the dense decode step of the same model.

A 4-layer DeepSeek-V3.2-shaped model (benchmarks/deepseek_shape.py: hidden 7168, q_lora 1536, R 512,
Dr 64, Dn 128, Dv 128, indexer 64 heads x 128, index_topk 2048; random hashed weights, bf16) with
N = 128 attention heads, and N = 16 (one rank's share at tensor parallel 8), decodes one token for
each of `--batch` sequences at `--context` cached tokens. The dense model is the same config without
the indexer (DeepSeek-V3 shape: identical weights' shapes, attention over the whole history), so the
ratio sparse / dense is what DSA buys at that depth: each query reads its 2048 selected latents
instead of all `context`, and pays the indexer (an index key per cached token scored per query, then a
top-k). Target: sparse <= 0.3x dense at batch 64 x 32k.

Each step is timed as the runtime runs it (host metadata, whole-step decode CUDA graph where the
backend allows, argmax sync), median of `--steps`. The indexer's share of a sparse step comes from
torch.profiler over a few more steps run piecewise (decode graph off, so the indexer ops are visible
as ops): the device time of the ops whose name holds "dsa_indexer" over all kernel time.

    python -m benchmarks.e2e.sparse_depth                      # H200: table + JSON + plot in docs/benchmarks
    python -m benchmarks.e2e.sparse_depth --smoke --out /tmp/x # CPU, tiny dims (tests/test_sparse_depth_bench.py)

`--index-scores-config FILE` runs the Triton indexer's score kernel with the fastest config of a
`benchmarks/kernels/sweep_index_scores.py` JSON instead of the committed one (to try a sweep's result
in the same device call); the config used is recorded either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.lib import (IndexScoresConfig, StepSequence, deepseek_v3_shaped, deepseek_v32_shaped,
                            index_scores_launch_config, optimize, pyplot)

REPO = Path(__file__).resolve().parents[2]
STEM = "sparse_mla_depth"  # docs/benchmarks/sparse_mla.* holds the per-layer results of bench_sparse_mla.py
PROFILE_STEPS = 3
TARGET = 0.3


def model_config(args: argparse.Namespace, sparse: bool, heads: int) -> dict[str, Any]:
    ns = argparse.Namespace(**{**vars(args), "heads": heads})
    cfg = deepseek_v32_shaped(ns) if sparse else deepseek_v3_shaped(ns)
    cfg["max_position_embeddings"] = max(163840, args.context + 1024)  # both as long as the context
    return cfg


def build(args: argparse.Namespace, sparse: bool, heads: int, device: str):

    max_len = args.context + args.warmup + args.steps + PROFILE_STEPS + 8
    runtime = {"max_batch_size": args.batch, "max_seq_len": max_len, "max_num_tokens": args.batch,
               "page_size": args.page_size, "num_pages": 1 + args.batch * -(-max_len // args.page_size)}
    cfg = {"model": {"hf_config": model_config(args, sparse, heads), "device": device, "seed": 0,
                     "dtype": "bfloat16" if device == "cuda" else "float32", "init": "hashed"},
           "runtime": runtime,
           "transforms": {"insert_cached_mla_attention": {"backend": args.backend},
                          "piecewise": {"enabled": True, "on_cpu": device == "cpu", "buckets": [args.batch]}}}
    om = optimize(None, cfg)
    om.warmup()
    return om


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_decode(om, args: argparse.Namespace) -> dict[str, Any]:
    """Median decode step (ms) of `batch` sequences at `context` cached tokens (random cache contents),
    then the indexer's share of PROFILE_STEPS piecewise steps."""

    runner, dev, batch = om.runner, om.device, args.batch
    runner.allocator.ensure_many({s: args.context + args.warmup + args.steps + PROFILE_STEPS + 4 for s in range(batch)})
    g = torch.Generator(device=dev).manual_seed(batch * 7 + args.context)
    for c in runner.caches.caches.values():
        c.normal_(generator=g)
    tok = [1] * batch
    pos0 = args.context - args.warmup

    def step(i: int) -> None:
        nonlocal tok
        seqs = [StepSequence(s, [tok[s]], pos0 + i) for s in range(batch)]
        _, logits = runner.forward(seqs, runner.allocator.pages_of)
        tok = logits[0, :batch].argmax(-1).tolist()

    ts = []
    for i in range(args.warmup + args.steps):
        _sync(dev)
        t0 = time.perf_counter()
        step(i)
        if i >= args.warmup:
            ts.append((time.perf_counter() - t0) * 1e3)
    paths = dict(runner.piecewise.stats) if runner.piecewise is not None else {}
    row = {"step_ms": statistics.median(ts), "p10_ms": sorted(ts)[len(ts) // 10], "steps": len(ts),
           "paths": {k: v for k, v in paths.items() if isinstance(v, int)}}
    row.update(indexer_share(step, args.warmup + args.steps, runner, dev))
    for s in range(batch):
        runner.allocator.free(s)
    return row


def is_attention_op(key: str) -> bool:
    """The cached attention ops (every backend's, the DSA indexer included) are `autodeploy::*_with_cache`."""
    return key.startswith("autodeploy::") and key.endswith("_with_cache")


def indexer_share(step, first: int, runner, dev: torch.device) -> dict[str, Any]:
    """Profile PROFILE_STEPS steps with the whole-step decode graph off (static pieces still replay
    their graphs; the dynamic attention ops run as ops): the device time (CPU time on the CPU) of the
    ops named *dsa_indexer* over the steps' total kernel time."""
    from torch.profiler import ProfilerActivity, profile

    pw = runner.piecewise
    saved = pw.decode_graph if pw is not None else None
    if pw is not None:
        pw.decode_graph = False
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        _sync(dev)
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            for i in range(first, first + PROFILE_STEPS):
                step(i)
            _sync(dev)
        wall = (time.perf_counter() - t0) * 1e3 / PROFILE_STEPS
    finally:
        if pw is not None:
            pw.decode_graph = saved
    avg = prof.key_averages()
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in kernels) / 1e3 / PROFILE_STEPS
        index = sum(e.device_time_total for e in avg if "dsa_indexer" in e.key) / 1e3 / PROFILE_STEPS
        attention = sum(e.device_time_total for e in avg if is_attention_op(e.key)) / 1e3 / PROFILE_STEPS
    else:
        total = wall
        index = sum(e.cpu_time_total for e in avg if "dsa_indexer" in e.key) / 1e3 / PROFILE_STEPS
        attention = sum(e.cpu_time_total for e in avg if is_attention_op(e.key)) / 1e3 / PROFILE_STEPS
    top = sorted(avg, key=lambda e: -(e.device_time_total if cuda else e.cpu_time_total))[:8]
    return {"piecewise_step_ms": wall, "kernel_ms": total, "indexer_ms": index, "attention_ms": attention,
            "indexer_share": index / total if total else 0.0,
            "top_ops": [[e.key, round((e.device_time_total if cuda else e.cpu_time_total) / 1e3 / PROFILE_STEPS, 4)]
                        for e in top]}


def attention_cells(r: dict[str, Any]) -> str:
    d, sp = r["dense"].get("attention_ms"), r["sparse"].get("attention_ms")
    if d is None or sp is None:  # a JSON written before the attention split was recorded
        return "- | -"
    return f"{d:.3f} / {sp:.3f} | {sp / d:.2f}" if d else f"{d:.3f} / {sp:.3f} | -"


def render(data: dict[str, Any], out: Path) -> None:
    """Markdown table next to the JSON, and a bar plot of sparse vs dense step time per N."""
    lines = [f"# Sparse vs dense decode at depth: {data['model']}", "",
             f"Command: `{data['command']}`  ", f"Machine: {data['machine']}  ",
             f"Indexer score kernel config: {data.get('index_scores_config', 'committed')}", "",
             "| N | batch x context | dense ms | sparse ms | sparse / dense | indexer ms | indexer share | "
             "attention ms dense / sparse | attention sparse / dense | backend (sparse) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['heads']} | {r['batch']} x {r['context']} | error: {r['error'][:120]} |||||")
            continue
        ratio = r["sparse"]["step_ms"] / r["dense"]["step_ms"]
        lines.append(f"| {r['heads']} | {r['batch']} x {r['context']} | {r['dense']['step_ms']:.3f} | "
                     f"{r['sparse']['step_ms']:.3f} | {ratio:.2f}{' (target <= 0.3)' if ratio > TARGET else ''} | "
                     f"{r['sparse']['indexer_ms']:.3f} | {r['sparse']['indexer_share']:.0%} | "
                     f"{attention_cells(r)} | {', '.join(r['sparse_backends'])} |")
    lines += ["", "Indexer share: ops named *dsa_indexer* over all kernel time of 3 steps run piecewise (decode graph "
              "off); the sparse and dense columns are whole-step times as served (decode graph where allowed). "
              "Attention: device time of the cached attention ops (`autodeploy::*_with_cache`: the indexer and the "
              "sparse attention, or the dense attention) in those profiled steps; the rest of a step (projections, "
              "MoE, norms, host work) is the same in both models.", ""]
    (out / f"{STEM}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    rows = [r for r in data["rows"] if "error" not in r]
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["dense"]["step_ms"] for r in rows], 0.4, label="dense MLA")
    ax.bar([x + 0.2 for x in xs], [r["sparse"]["step_ms"] for r in rows], 0.4, label="sparse (DSA)")
    ax.bar([x + 0.2 for x in xs], [r["sparse"]["indexer_ms"] for r in rows], 0.4, label="of which indexer",
           hatch="//", fill=False)
    ax.set_xticks(list(xs), [f"N {r['heads']}\n{r['batch']} x {r['context']}" for r in rows])
    ax.set_ylabel("decode step, ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{STEM}.png", dpi=120)


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} torch {torch.__version__}"
    return f"CPU torch {torch.__version__}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[128, 16])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU: checks the script, measures nothing")
    ap.add_argument("--render", help="re-render the table and plot of this JSON into --out, and exit")
    ap.add_argument("--index-scores-config", help="a sweep_index_scores.py JSON: launch its fastest config")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(json.loads(Path(args.render).read_text()), out)
        return 0
    dims = dict(vocab=32768, hidden=7168, intermediate=4096, moe_intermediate=1024, layers=4, experts=16, topk=4,
                q_lora=1536, kv_lora=512, dn=128, dr=64, dv=128, index_heads=64, index_dim=128, index_topk=2048)
    if args.smoke:
        args.device, args.heads, args.batch, args.context = "cpu", [4], 2, 24
        args.steps, args.warmup, args.page_size = 2, 1, 8
        dims = dict(vocab=256, hidden=64, intermediate=96, moe_intermediate=32, layers=2, experts=4, topk=2, q_lora=48,
                    kv_lora=40, dn=24, dr=16, dv=20, index_heads=12, index_dim=32, index_topk=8)
    for k, v in dims.items():
        setattr(args, k, v)
    override = contextlib.nullcontext()
    index_cfg = "committed (tuning.index_scores_config)"
    if args.index_scores_config:
        sweep = json.loads(Path(args.index_scores_config).read_text())
        best = min((r for r in sweep["rows"] if "us" in r), key=lambda r: r["us"])
        override = index_scores_launch_config(IndexScoresConfig(**best["config"]))
        index_cfg = f"{best['config']} (fastest of {args.index_scores_config}: {best['us']:.1f} us)"
    with override:
        rows = measure(args)
    what = (f"{args.layers}-layer DeepSeek-V3.2 shape (hidden {args.hidden}, R {args.kv_lora}, Dr {args.dr}, indexer "
            f"{args.index_heads} x {args.index_dim}, index_topk {args.index_topk})")
    data = {"model": what, "machine": machine(args.device), "smoke": args.smoke,
            "command": "python -m benchmarks.e2e.sparse_depth " + " ".join(sys.argv[1:] if argv is None else argv),
            "index_scores_config": index_cfg, "rows": rows}
    (out / f"{STEM}.json").write_text(json.dumps(data, indent=1, default=str))
    render(data, out)
    return 0 if all("error" not in r for r in rows) else 1


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Dense then sparse, for each N: one row each (an error is a row too; the other N still runs)."""
    rows = []
    for heads in args.heads:
        row: dict[str, Any] = {"heads": heads, "batch": args.batch, "context": args.context}
        try:
            for kind in ("dense", "sparse"):
                t0 = time.perf_counter()
                om = build(args, kind == "sparse", heads, args.device)
                row[f"{kind}_build_s"] = time.perf_counter() - t0
                row[f"{kind}_backends"] = sorted({lay["backend"] for lay in om.report()["layers"]})
                row[kind] = time_decode(om, args)
                del om
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - recorded in the table; the other N still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        print(json.dumps({k: v for k, v in row.items() if k not in ("dense", "sparse")}), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
