"""Tensor-parallel decode step latency: 1 GPU vs 2 GPUs (the `shard` pass, NCCL all-reduce).

Model: a DeepSeek-V3-shaped `transformers` model with the real MLA dims (N 128, q_lora 1536, R 512,
Dr 64, Dn 128, Dv 128, hidden 7168), a few layers (first dense, the rest MoE with fewer/smaller
routed experts than the real 256 x 2048), vocab 32768, random weights, bf16 - the same model as
benchmarks/e2e_decode.py. With 2 ranks every rank holds N/2 = 64 heads, half of every MLP/expert,
the full latent cache, and runs one all-reduce per attention block and one per MLP/MoE block.

One decode step = every sequence of the batch adds one token at context length C, through
`ModelRunner.forward`: host metadata, the graph (piecewise runner: CUDA graphs on by default,
collectives captured inside them), the sampling sync (argmax of this rank's logits rows -> host; no
rank-0 broadcast). Median over steps; for 2 ranks the slower rank's median is reported. Caches are
filled with random latents (no prefill is timed).

    python benchmarks/tp_decode.py --out /tmp/tp            # on a 2-GPU host (nvidia-h200-x2)
    python benchmarks/tp_decode.py --render /tmp/tp/tp_decode.json   # markdown table + plot (CPU ok)
    python benchmarks/tp_decode.py --quick --device cpu --out /tmp/tpq  # CPU/gloo dry run of the plumbing

Copy tp_decode.{json,md,png} into docs/benchmarks/ and quote the machine and command from the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from deepseek_shape import decode_runtime, deepseek_v3_shaped, extra_tokens  # benchmarks/ is sys.path[0] when run as a script

DEFAULT_BATCHES = (1, 8, 32, 64)
DEFAULT_CONTEXTS = (1024, 4096)
PROFILE_STEPS = 3  # steps run under torch.profiler with --profile


def build_config(args: argparse.Namespace, device: str) -> dict[str, Any]:
    return {
        "model": {"hf_config": deepseek_v3_shaped(args), "dtype": "bfloat16" if device == "cuda" else "float32",
                  "device": device, "seed": 0},
        "runtime": decode_runtime(args, extra_tokens(args, PROFILE_STEPS)),
        "transforms": {
            "insert_cached_mla_attention": {"backend": args.backend},
            "piecewise": {"enabled": True, "on_cpu": args.quick, "buckets": sorted(set(args.batches)),
                          "cuda_graphs": not args.no_cuda_graphs},
        },
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_rank(rank: int, args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    """One rank: build (shard pass on when world > 1), then time decode steps per (context, batch)."""
    import torch.distributed as dist

    from autodeploy_mla.api import optimize
    from autodeploy_mla.distributed.env import env_info
    from autodeploy_mla.runtime.sequence_info import StepSequence

    info = env_info()
    world = info.world_size
    device = f"cuda:{info.local_rank}" if device_type == "cuda" else "cpu"
    cfg = build_config(args, device_type)
    sets = [f"model.device={device}"]
    if world > 1:
        sets += ["transforms.shard.enabled=true"]
    t0 = time.perf_counter()
    om = optimize(None, cfg, overrides=sets)
    build_s = time.perf_counter() - t0
    dev = om.device
    runner = om.runner
    shard = next((r.summary for r in om.history if r.name == "shard" and r.enabled), "")
    backends = sorted({lay["backend"] for lay in om.report()["layers"]})
    heads = om.report()["layers"][0]["dims"]["num_heads"]
    mem_gb = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    rows = []
    extra = extra_tokens(args, PROFILE_STEPS)

    def step_paths() -> Counter:
        """How the piecewise runner has run steps so far (decode_graph, piecewise, eager)."""
        return Counter(runner.piecewise.stats) if runner.piecewise is not None else Counter()

    for context in args.contexts:
        for batch in args.batches:
            runner.allocator.ensure_many({sid: context + extra for sid in range(batch)})
            g = torch.Generator(device=dev).manual_seed(batch * 7 + context)
            for c in runner.caches.caches.values():
                c.normal_(generator=g)
            tok, ts = [1] * batch, []
            pos0 = context - args.warmup
            err, paths = None, {}
            paths0 = step_paths()

            def step(i: int) -> None:
                nonlocal tok
                seqs = [StepSequence(s, [tok[s]], pos0 + i) for s in range(batch)]
                _, logits = runner.forward(seqs, runner.allocator.pages_of)  # all decode: order = seqs
                tok = logits[0, :batch].argmax(-1).tolist()  # the sampling sync

            try:
                for i in range(args.warmup + args.steps):
                    _sync(dev)
                    t1 = time.perf_counter()
                    step(i)
                    if i == args.warmup - 1:
                        paths0 = step_paths()
                    if i >= args.warmup:
                        ts.append((time.perf_counter() - t1) * 1e3)
                paths = dict(step_paths() - paths0)
                if args.profile == [context, batch]:
                    profile_steps(step, args.warmup + args.steps, Path(args.out) / f"profile_w{world}_r{rank}.txt")
            except Exception as exc:  # noqa: BLE001 - recorded; every rank fails the same way
                err = f"{type(exc).__name__}: {exc}"[:400]
            for sid in range(batch):
                runner.allocator.free(sid)
            row: dict[str, Any] = {"world_size": world, "batch": batch, "context": context,
                                   # how the timed steps ran: decode_graph (one CUDA graph), piecewise, eager
                                   "paths": paths}
            if err:
                row["error"] = err
            else:
                ts.sort()
                med = statistics.median(ts)
                if world > 1:  # the slower rank decides
                    t = torch.tensor([med], dtype=torch.float64, device=dev if device_type == "cuda" else "cpu")
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    med = float(t.item())
                row.update({"step_ms": med, "p10_ms": ts[len(ts) // 10], "p90_ms": ts[(9 * len(ts)) // 10],
                            "steps": len(ts), "tokens_per_s": batch / med * 1e3})
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    return {"world_size": world, "rows": rows, "build_s": build_s, "shard": shard, "backends": backends,
            "heads_per_rank": heads, "max_memory_gb": mem_gb}


def profile_steps(step: Any, first: int, path: Path) -> None:
    """Run PROFILE_STEPS more steps under torch.profiler; write the ops by device time and by host time to `path`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for i in range(first, first + PROFILE_STEPS):
            step(i)
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    avg = prof.key_averages()
    path.write_text(f"{PROFILE_STEPS} decode steps, torch threads {torch.get_num_threads()}\n"
                    + avg.table(sort_by=key, row_limit=25) + "\nby host time\n"
                    + avg.table(sort_by="self_cpu_time_total", row_limit=25))


def environment(device_type: str) -> dict[str, Any]:
    from autodeploy_mla.custom_ops import library_versions

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "host": platform.node()}
    env.update({f"lib_{k}": v for k, v in library_versions().items()})
    if device_type == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update({"gpu": p.name, "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    return env


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    rows = data["rows"]
    by = {(r["world_size"], r["context"], r["batch"]): r for r in rows}
    worlds = sorted({r["world_size"] for r in rows})
    m = data["model"]
    lines = [f"# Tensor-parallel decode step latency ({data['environment'].get('gpu', 'cpu')})", "",
             f"Command: `{data['command']}`", "",
             f"Model: DeepSeek-V3-shaped, {m['num_hidden_layers']} layers, N {m['num_attention_heads']}, "
             f"R {m['kv_lora_rank']}, dtype {data['dtype']}. Step = host metadata + graph + argmax sync; "
             "median ms (2 ranks: the slower rank).", "",
             "| context | batch | " + " | ".join(f"{w} GPU ms" for w in worlds) + " | speed-up | timed steps ran as |",
             "|---|---|" + "---|" * len(worlds) + "---|---|"]
    for context in sorted({r["context"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            cells, ms = [], {}
            for w in worlds:
                r = by.get((w, context, batch), {})
                if "step_ms" in r:
                    ms[w] = r["step_ms"]
                    cells.append(f"{r['step_ms']:.3f}")
                else:
                    cells.append(r.get("error", "-")[:40])
            sp = f"{ms[1] / ms[max(worlds)]:.2f}x" if 1 in ms and max(worlds) in ms and max(worlds) > 1 else "-"
            paths = "; ".join(f"{w}: " + ", ".join(f"{k} {v}" for k, v in sorted(by[(w, context, batch)]["paths"].items()))
                              for w in worlds if by.get((w, context, batch), {}).get("paths"))
            lines.append(f"| {context} | {batch} | " + " | ".join(cells) + f" | {sp} | {paths or '-'} |")
    lines.append("")
    for w in data["worlds"]:
        mem = "-" if w["max_memory_gb"] is None else f"{w['max_memory_gb']:.1f} GiB"
        lines.append(f"- {w['world_size']} rank(s): backends {w['backends']}, heads/rank {w['heads_per_rank']}, "
                     f"build {w['build_s']:.1f}s, peak memory {mem}; {w['shard'] or 'no sharding'}")
    if data.get("notes"):  # added by hand after the run: what was measured around it
        lines += ["", "Notes:", *[f"- {n}" for n in data["notes"]]]
    md = path.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for w in worlds:
        for context in sorted({r["context"] for r in rows}):
            pts = sorted((r["batch"], r["step_ms"]) for r in rows
                         if r["world_size"] == w and r["context"] == context and "step_ms" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{w} GPU, context {context}")
    ax.set_xlabel("batch (sequences per decode step)")
    ax.set_ylabel("decode step latency (ms)")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("DeepSeek-V3-shaped MLA decode: tensor parallel 1 vs 2 GPUs")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/tp_decode")
    ap.add_argument("--render", help="render table + plot from this JSON and exit")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_BATCHES))
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_CONTEXTS))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--q-lora", type=int, default=1536)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--dn", type=int, default=128)
    ap.add_argument("--dr", type=int, default=64)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="piecewise pieces run eagerly")
    ap.add_argument("--profile", type=lambda s: [int(x) for x in s.split(",")], metavar="CONTEXT,BATCH",
                    help="also profile 3 steps of this (context, batch) in every rank -> <out>/profile_w*_r*.txt")
    ap.add_argument("--quick", action="store_true", help="tiny dims for a CPU dry run (gloo)")
    args = ap.parse_args(argv)
    if args.render:
        render(Path(args.render))
        return 0
    if args.quick:
        args.hidden, args.heads, args.intermediate, args.moe_intermediate, args.vocab = 128, 4, 128, 32, 256
        args.q_lora, args.kv_lora, args.dn, args.dr, args.dv = 64, 64, 16, 16, 16
        args.experts, args.layers, args.page_size, args.steps, args.warmup = 4, 2, 16, 3, 1
        args.batches, args.contexts = [1, 4], [32]

    from autodeploy_mla.distributed import spawn

    device_type = args.device
    if device_type == "cuda" and torch.cuda.device_count() < max(args.world_sizes):
        print(f"need {max(args.world_sizes)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(device_type),
        "model": deepseek_v3_shaped(args),
        "dtype": "bfloat16" if device_type == "cuda" else "float32",
        "rows": [],
        "worlds": [],
    }
    path = out_dir / "tp_decode.json"
    backend = "nccl" if device_type == "cuda" else "gloo"
    for world in args.world_sizes:
        t0 = time.perf_counter()
        res = spawn(bench_rank, world, args, device_type, backend=backend)
        print(f"world {world}: {time.perf_counter() - t0:.0f}s, {res['shard'] or 'no sharding'}", flush=True)
        result["rows"] += res.pop("rows")
        result["worlds"].append(res)
        path.write_text(json.dumps(result, indent=1, default=str))
    render(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
