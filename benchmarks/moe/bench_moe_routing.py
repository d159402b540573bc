"""MoE routing after the gate GEMM: HF's op soup vs Inductor vs our one-kernel op, per router (issue 13).

Routers (the published configs' routing): DeepSeek-V2-Lite (64 experts, top-6, softmax, greedy),
GLM-4.7-Flash (64, top-4, sigmoid + correction bias, normalised, x1.8), DeepSeek-V2 (160, top-6,
softmax, group-limited 3 of 8 groups by max, x16), DeepSeek-V3 / Kimi-K2-like (256, top-8, sigmoid
+ bias, 4 of 8 groups by top-2 sum, normalised, x2.5). T tokens in {1, 8, 64, 512, 2048}; fresh
fp32 logits (the routers compute in fp32). Device time of one call as a CUDA-graph replay of 20
calls (how decode and the static pieces run), for

- `hf_eager`: `route_reference` = HF's own torch calls (the exported graph's ops, eager),
- `inductor`: the same function through `torch.compile` (what `piecewise.compile: inductor` makes of
  the model's routing; `topk` stays an ATen kernel),
- `triton`: `autodeploy::triton_moe_route` (one kernel).

Every variant is checked against the reference first (ids equal per row, weights within 1e-5).

    python -m benchmarks.moe.bench_moe_routing --out /tmp/route
    python -m benchmarks.moe.bench_moe_routing --out /tmp/route --gate      # + the gate GEMM (moe_routing_gate.*)
    python -m benchmarks.moe.bench_moe_routing --render docs/benchmarks/moe_routing.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch


from benchmarks.lib import (
    RoutingSpec,
    gate_logits,
    graph_time_ms,
    route_reference,
)

ROUTERS: dict[str, tuple[int, RoutingSpec, bool]] = {  # name: (experts, spec, correction bias)
    "v2_lite": (64, RoutingSpec(6, 1, 1, "softmax", "top2sum", 0.0, "choice", False, 1.0), False),
    "glm_4_7_flash": (64, RoutingSpec(4, 1, 1, "sigmoid", "top2sum", float("-inf"), "scores", True, 1.8), True),
    "deepseek_v2": (160, RoutingSpec(6, 8, 3, "softmax", "max", 0.0, "choice", False, 16.0), False),
    "deepseek_v3": (256, RoutingSpec(8, 8, 4, "sigmoid", "top2sum", float("-inf"), "scores", True, 2.5), True),
}
TOKENS = (1, 8, 64, 512, 2048)
REPS = 20


def graph_time_us(fn: Callable[[], Any]) -> float:
    """Median device µs of one call: REPS calls in one CUDA graph, 10 replays (bench_moe's timer)."""
    return graph_time_ms(fn, reps=10, calls=REPS) * 1e3


def _sorted(w, ids):
    o = ids.argsort(-1)
    return w.gather(1, o), ids.gather(1, o)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    rows = []
    compiled = {}
    for name, (e, spec, has_bias) in ROUTERS.items():
        def ref(lg, b, spec=spec):
            return route_reference(lg, b, spec)
        compiled[name] = torch.compile(ref, dynamic=False)
        for t in TOKENS:
            g = torch.Generator(device=dev).manual_seed(t * 7 + e)
            logits = torch.randn(t, e, generator=g, device=dev)
            bias = torch.randn(e, generator=g, device=dev) * 0.1 if has_bias else None
            w0, i0 = _sorted(*route_reference(logits, bias, spec))
            variants = {
                "hf_eager": lambda: route_reference(logits, bias, spec),
                "inductor": lambda: compiled[name](logits, bias),
                "triton": lambda: torch.ops.autodeploy.triton_moe_route(logits, bias, *spec.args()),
            }
            if args.gate:  # with the gate GEMM: HF's fp32 linear + ops vs fp32 linear + kernel vs the gate op
                x = torch.randn(t, args.hidden, generator=g, device=dev).to(torch.bfloat16)
                gw = (torch.randn(e, args.hidden, generator=g, device=dev) / args.hidden ** 0.5).to(torch.bfloat16)
                gw0, gi0 = _sorted(*route_reference(gate_logits(x, gw), bias, spec))
                variants = {
                    "gate_hf_eager": lambda: route_reference(gate_logits(x, gw), bias, spec),
                    "gate_then_triton": lambda: torch.ops.autodeploy.triton_moe_route(gate_logits(x, gw), bias,
                                                                                    *spec.args()),
                    "gate_in_op": lambda: torch.ops.autodeploy.triton_moe_gate_route(x, gw, bias, *spec.args()),
                }
                w0, i0 = gw0, gi0
            row: dict[str, Any] = {"router": name, "experts": e, "top_k": spec.top_k, "tokens": t}
            for v, fn in variants.items():
                w1, i1 = _sorted(*fn())
                same = (i0 == i1).all(-1)
                # the gate op's tensor-core GEMM sums in another order than cuBLAS's sgemm: near-ties may
                # flip (>= 99% rows equal)
                ok = (bool(same.all()) or (v == "gate_in_op" and same.float().mean().item() >= 0.99)) and \
                    torch.allclose(w1[same], w0[same], rtol=1e-4 if v == "gate_in_op" else 1e-5, atol=1e-6)
                row[f"{v}_ok"] = ok
                row[f"{v}_us"] = graph_time_us(fn)
            rows.append(row)
            print(f"{name:14s} T={t:5d}: " + "  ".join(f"{v} {row[f'{v}_us']:7.1f} us{'' if row[f'{v}_ok'] else ' WRONG'}"
                                                    for v in variants), flush=True)
    return {"rows": rows}


def _variants(rows: list[dict[str, Any]]) -> list[str]:
    return [k[: -len("_us")] for k in rows[0] if k.endswith("_us")] if rows else []


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    meta = data["meta"]
    rows = data["rows"]
    vs = _variants(rows)
    ours, others = vs[-1], vs[:-1]  # the last variant is ours (triton / gate_in_op)
    lines = ["# MoE routing after the gate GEMM: HF's ops vs Inductor vs one Triton kernel", "",
             f"Machine: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`.",
             "", "Device µs per call (CUDA-graph replay of 20 calls, median of 10 replays); fp32 logits (`gate_*`: "
             "bf16 hidden states and gate weight, the fp32 gate GEMM included). `ok`: ids equal to the reference on "
             "every row (the gate op's tensor-core GEMM: >= 99% of rows, near-ties), weights within 1e-5 (1e-4).", "",
             "| router | experts | top-k | tokens | " + " | ".join(f"{v} µs" for v in vs)
             + f" | {ours} vs best other | ok |",
             "|---|---:|---:|---:|" + "---:|" * len(vs) + "---:|---|"]
    for r in rows:
        best = min(r[f"{v}_us"] for v in others)
        ok = "yes" if all(r[f"{v}_ok"] for v in vs) else "**NO**"
        lines.append(f"| {r['router']} | {r['experts']} | {r['top_k']} | {r['tokens']} | "
                     + " | ".join(f"{r[f'{v}_us']:.1f}" for v in vs)
                     + f" | {best / r[f'{ours}_us']:.1f}x faster | {ok} |")
    lines.append("")
    lines.append(f"![plot]({path.with_suffix('.png').name})")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    routers = list(dict.fromkeys(r["router"] for r in rows))
    fig, axes = plt.subplots(1, len(routers), figsize=(4 * len(routers), 3.5), squeeze=False)
    for ax, name in zip(axes[0], routers):
        rs = [r for r in rows if r["router"] == name]
        for v in vs:
            ax.plot([r["tokens"] for r in rs], [r[f"{v}_us"] for r in rs], marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per call")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--gate", action="store_true",
                    help="time the gate GEMM with the routing (bf16 hidden states, --hidden): HF, cuBLAS + kernel, "
                         "the gate op (transforms.fuse_routing.gate_gemm: tensor-core GEMM + kernel)")
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    if args.render:
        render(args.render)
        return
    if args.out is None:
        ap.error("--out (or --render) is required")
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = bench(args)
    data["meta"] = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                    "total_s": time.perf_counter() - t0}
    out = args.out / ("moe_routing_gate.json" if args.gate else "moe_routing.json")
    out.write_text(json.dumps(data, indent=1))
    render(out)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
