"""Prefill and mixed steps: piecewise (attention eager between captured pieces) vs one whole-graph
mixed CUDA graph per token bucket (issue 14, item 1: the op on static bounds).

One model (bf16, random weights, the Triton attention backend), one runner; per scenario the same
step (same sequences, same cached lengths: re-running it rewrites the same cache slots) runs in both
modes by switching `PiecewiseRunner.mixed_graph_max_tokens` (0 = piecewise). Reported per mode: the
median wall time of `ModelRunner.forward` (metadata, prepare, graph or pieces, logits copy, one
sync), the device time of the same steps (CUDA events around the graph), and the largest relative
difference of the logits between the modes.

    python -m benchmarks.e2e.bench_mixed_graph --out $OUT/mixed                   # GPU
    python -m benchmarks.e2e.bench_mixed_graph --render docs/benchmarks/mixed_graph.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


from benchmarks.lib import GLM_47_FLASH, V2_LITE, build_hf

MODELS = {"v2_lite": V2_LITE, "glm_4_7_flash": GLM_47_FLASH}

#: name -> sequences of the step as (new tokens, cached tokens); decode rows are (1, context)
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "prefill_32": [(32, 0)],
    "prefill_128": [(128, 0)],
    "mixed_4dec_c1k+chunk60": [(60, 0)] + [(1, 1024)] * 4,
    "mixed_8dec_c1k+chunk120@1k": [(120, 1024)] + [(1, 1024)] * 8,
    "mixed_16dec_c2k+chunk240@4k": [(240, 4096)] + [(1, 2048)] * 16,
    "prefill_256": [(256, 0)],
    "spec_verify_16x4_c1k": [(4, 1024)] * 16,
    # decode-only steps run the whole-graph decode graph in both modes (a control, and the decode
    # graphs' split chunks: the cache capacity here is 8192 tokens per sequence)
    "decode_8_c1k": [(1, 1024)] * 8,
    "decode_32_c1k": [(1, 1024)] * 32,
    "decode_32_ragged": [(1, 256 + 240 * i) for i in range(32)],
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(args: argparse.Namespace, dev: torch.device):
    from benchmarks.lib import optimize

    cfg = dict(MODELS[args.model])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model = build_hf(cfg, dev, torch.bfloat16)
    om = optimize(model, {
        "runtime": {"max_batch_size": 32, "max_num_tokens": 256, "max_seq_len": 8192, "page_size": 64,
                    "num_pages": 32 * 8192 // 64 + 64},
        "transforms": {
            "insert_cached_mla_attention": {"backend": args.backend},
            "piecewise": {"enabled": True, "compile": args.compile, "mixed_graph_max_tokens": 256},
        },
    })
    del model
    return om, cfg


def run_scenario(om, seqs_spec: list[tuple[int, int]], reps: int, warm: int) -> dict[str, Any]:
    from benchmarks.lib import StepSequence

    mr = om.runner
    pw = mr.piecewise
    alloc = mr.allocator
    for sid in alloc.owners():
        alloc.free(sid)
    alloc.ensure_many({i: n + c for i, (n, c) in enumerate(seqs_spec)})
    g = torch.Generator().manual_seed(len(seqs_spec))
    seqs = [StepSequence(i, torch.randint(0, om.vocab_size, (n,), generator=g).tolist(), c)
            for i, (n, c) in enumerate(seqs_spec)]
    dev = mr.device
    out: dict[str, Any] = {"tokens": sum(n for n, _ in seqs_spec), "seqs": len(seqs_spec)}
    logits = {}
    saved = pw.mixed_graph_max_tokens
    try:
        for mode, limit in (("piecewise", 0), ("mixed_graph", saved)):
            pw.mixed_graph_max_tokens = limit
            before = dict(pw.stats)
            for _ in range(warm):
                mr.forward(seqs, alloc.pages_of)
            _sync(dev)
            wall, device = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                order, step = mr.prepare(seqs, alloc.pages_of)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                lg = mr.execute(step)
                e1.record()
                lg = lg[0, : len(seqs)].float().clone() if mr.compiled.logits is not None else lg[0].float().clone()
                _sync(dev)
                wall.append((time.perf_counter() - t0) * 1e3)
                device.append(e0.elapsed_time(e1))
            used = {k: pw.stats[k] - before.get(k, 0) for k in pw.stats if pw.stats[k] != before.get(k, 0)}
            logits[mode] = lg
            out[mode] = {"wall_ms": statistics.median(wall), "wall_p10_ms": sorted(wall)[len(wall) // 10],
                         "device_ms": statistics.median(device), "runner_stats": used}
    finally:
        pw.mixed_graph_max_tokens = saved
        for sid in alloc.owners():
            alloc.free(sid)
    a, b = logits["mixed_graph"], logits["piecewise"]
    out["logits_rel_diff"] = float((a - b).norm() / b.norm().clamp_min(1e-30))
    out["argmax_equal"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return out


def table(res: dict[str, Any]) -> str:
    lines = [
        "| scenario | tokens | seqs | piecewise wall ms (device) | mixed graph wall ms (device) | wall speed-up | "
        "logits rel diff | argmax equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in res["scenarios"].items():
        p, m = r["piecewise"], r["mixed_graph"]
        lines.append(f"| {name} | {r['tokens']} | {r['seqs']} | {p['wall_ms']:.2f} ({p['device_ms']:.2f}) | "
                     f"{m['wall_ms']:.2f} ({m['device_ms']:.2f}) | {p['wall_ms'] / m['wall_ms']:.2f}x | "
                     f"{r['logits_rel_diff']:.1e} | {r['argmax_equal']:.2f} |")
    return "\n".join(lines)


def render(path: Path) -> None:
    res = json.loads(path.read_text())
    md = [f"# Mixed-step whole-graph CUDA graphs vs piecewise ({res['model']}, {res['layers']} layers)", "",
          f"Machine: {res['env']['gpu']}, torch {res['env']['torch']}, triton {res['env']['triton']}; "
          f"backend {res['backend']}, compile {res['compile']}.", f"Command: `{res['command']}`", "", table(res), ""]
    path.with_suffix(".md").write_text("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(res["scenarios"])
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([i - 0.2 for i in x], [res["scenarios"][n]["piecewise"]["wall_ms"] for n in names], 0.4, label="piecewise")
    ax.bar([i + 0.2 for i in x], [res["scenarios"][n]["mixed_graph"]["wall_ms"] for n in names], 0.4,
           label="mixed graph")
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("step wall ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v2_lite", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the model's)")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--compile", default="none", choices=["none", "inductor", "auto"])
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    args = ap.parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    dev = torch.device("cuda")
    t0 = time.time()
    om, cfg = build(args, dev)
    pw = om.runner.piecewise
    print(f"built in {time.time() - t0:.0f} s; runner: {json.dumps({k: pw.summary()[k] for k in ('buckets', 'mixed_graph_max_tokens', 'mixed_graph_reason')})}", flush=True)
    import triton

    res: dict[str, Any] = {
        "model": args.model, "layers": cfg["num_hidden_layers"], "backend": args.backend, "compile": args.compile,
        "command": "python -m benchmarks.e2e.bench_mixed_graph " + " ".join(sys.argv[1:] if argv is None else argv),
        "env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M")},
        "scenarios": {},
    }
    for name in args.scenarios:
        r = run_scenario(om, SCENARIOS[name], args.reps, args.warm)
        res["scenarios"][name] = r
        print(f"{name}: piecewise {r['piecewise']['wall_ms']:.2f} ms (dev {r['piecewise']['device_ms']:.2f}) "
              f"{r['piecewise']['runner_stats']}, mixed graph {r['mixed_graph']['wall_ms']:.2f} ms "
              f"(dev {r['mixed_graph']['device_ms']:.2f}) {r['mixed_graph']['runner_stats']}, "
              f"rel diff {r['logits_rel_diff']:.1e}, argmax equal {r['argmax_equal']:.2f}", flush=True)
    res["failures"] = pw.summary()["failures"]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "mixed_graph.json"
        path.write_text(json.dumps(res, indent=1))
        render(path)
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
