"""Where a whole-model step spends its device time, by kernel class (issue 13).

Builds a model config as e2e_roofline.py does (bf16, random weights), then profiles decode steps
(batch B x context C) and one prefill chunk with torch.profiler and sums the device time of every
kernel per step into classes by kernel name: attention, dense GEMM, grouped GEMM (MoE experts),
MoE routing (sort/topk/histc/scatter/index), Inductor-fused Triton kernels, other elementwise and
reduction kernels, copies; our fused MoE kernels as their own class. Prints a table per case and the top kernels, writes JSON.

    python -m benchmarks.e2e.e2e_profile --out /tmp/prof --models v2_lite --variants base,moe
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


from benchmarks.lib import (
    build_model,
    decode_step,
    device_events,
    fill_ours,
    ints,
)

#: (class, regex on the kernel name), first match wins.
CLASSES = (
    ("fused_moe", r"^(count_kernel|place_kernel|gather_kernel|up_kernel|down_kernel|up_sorted_kernel|down_sorted_kernel)$"),
    ("routing", r"^route_kernel$"),
    ("attention", r"flashinfer|BatchMLA|mla_|_mla|Mla|MLA|attn|Attention|fmha|flash|"
                  r"^(expanded_prefill_kernel|split_reduce_kernel|gather_kv_kernel|append_kernel)$"),
    ("grouped_gemm", r"grouped|Grouped|moe|Moe|MoE"),
    ("gemm", r"gemm|Gemm|GEMM|nvjet|cutlass|xmma|cublas|sm90_|sm80_|splitK|gemv|Kernel2"),
    ("routing", r"sort|Sort|topk|TopK|histc|histogram|cumsum|scan|Scan|scatter|gather|index|Index|radix"),
    ("triton", r"^triton_|triton"),
    ("copy", r"copy|Memcpy|Memset|memcpy|memset|CatArray|cat_"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|Reduce|softmax|Softmax|norm|Norm"),
)


def classify(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name):
            return cls
    return "other"


#: idle gaps between consecutive device events, by length (us): launch gaps inside a CUDA graph are
#: the first bins, host work the device waits for (plan, eager launches, sampling) the last ones
GAP_BINS = ((0.0, 3.0), (3.0, 20.0), (20.0, 200.0), (200.0, float("inf")))


def gaps(prof, steps: int) -> dict[str, float]:
    """Device idle time per step between consecutive kernels/copies, in ms per GAP_BINS bin."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    out = {f"{lo:g}-{hi:g}us": 0.0 for lo, hi in GAP_BINS}
    end = spans[0][1] if spans else 0.0
    for s, e in spans[1:]:
        g = s - end
        if g > 0:
            lo, hi = next(b for b in GAP_BINS if b[0] <= g < b[1])
            out[f"{lo:g}-{hi:g}us"] += g / 1e3 / steps
        end = max(end, e)
    return out


def gap_sites(prof, steps: int, min_us: float = 20.0, top: int = 12) -> list[dict[str, Any]]:
    """Where the device waits: idle gaps of at least `min_us`, summed per (kernel before, kernel after)
    pair of names, largest first: a host-bound stretch shows up as the same boundary in every layer."""
    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > 0))
    sites: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    if evs:
        end, prev = evs[0][1], evs[0][2]
        for s, e, name in evs[1:]:
            g = s - end
            if g >= min_us:
                site = sites[(prev[:70], name[:70])]
                site[0] += g
                site[1] += 1
            if e >= end:
                end, prev = e, name
    return [{"before": b, "after": a, "ms": v[0] / 1e3 / steps, "count": v[1] / steps}
            for (b, a), v in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]]


def launch_floor(kernels: int = 1000, reps: int = 20) -> dict[str, float]:
    """Device time per kernel of a CUDA graph of `kernels` tiny dependent kernels (a 1-element add):
    the least a graph node costs on this GPU, whatever the kernel does."""
    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return {"kernels": kernels, "us_per_kernel": a.elapsed_time(b) * 1e3 / reps / kernels}


def summarize(events: list[tuple[str, float]], steps: int, wall_ms: float, top: int = 25) -> dict[str, Any]:
    by_cls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us in events:
        c = by_cls[classify(name)]
        c[0] += us
        c[1] += 1
        k = by_name[name]
        k[0] += us
        k[1] += 1
    total = sum(v[0] for v in by_cls.values())
    return {
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": total / 1e3 / steps,
        "kernels_per_step": sum(v[1] for v in by_cls.values()) / steps,
        "classes": {k: {"ms": v[0] / 1e3 / steps, "count": v[1] / steps, "share": v[0] / max(total, 1e-9)}
                    for k, v in sorted(by_cls.items(), key=lambda kv: -kv[1][0])},
        "top": [{"name": n[:160], "ms": v[0] / 1e3 / steps, "count": v[1] / steps, "class": classify(n)}
                for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def profile_decode(om, batch: int, context: int, steps: int = 5, warm: int = 3) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fill_ours(om, batch, context, warm + steps + 8)
    tok = [1] * batch
    pos = context
    try:
        for _ in range(warm):
            tok = decode_step(om.runner, batch, pos, tok).argmax(-1).tolist()
            pos += 1
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = decode_step(om.runner, batch, pos, tok).argmax(-1).tolist()
                pos += 1
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        for sid in list(om.runner.allocator.owners()):
            om.runner.allocator.free(sid)
    return {**summarize(device_events(prof), steps, wall), "gaps_ms": gaps(prof, steps),
            "gap_sites": gap_sites(prof, steps)}


def profile_prefill(om, tokens: int, steps: int = 2) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.lib import StepSequence

    runner = om.runner
    ids = torch.randint(2, om.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()

    def one() -> None:
        runner.allocator.ensure(0, tokens)
        try:
            _, logits = runner.forward([StepSequence(0, ids, 0)], runner.allocator.pages_of)
            logits[0, :1].argmax(-1).tolist()
        finally:
            runner.allocator.free(0)

    one()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    return {**summarize(device_events(prof), steps, wall), "gaps_ms": gaps(prof, steps),
            "gap_sites": gap_sites(prof, steps)}


def inductor_launch_configs(pattern: str, modules: Any = None) -> list[dict[str, Any]]:
    """The launch config each loaded Inductor Triton kernel whose name matches `pattern` settled on
    (after its autotuning, once it has run): name, size hints, the candidate configs and the chosen
    one(s). Reads torch._inductor's PyCodeCache (`modules`: a list of modules, for tests)."""
    if modules is None:
        from torch._inductor.codecache import PyCodeCache

        modules = list(PyCodeCache.modules)
    rx = re.compile(pattern)
    out, seen = [], set()
    for mod in modules:
        for attr, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if not hasattr(obj, "launchers") or fn is None or not rx.search(attr) or id(obj) in seen:
                continue
            seen.add(id(obj))

            def cfg(c: Any) -> dict[str, Any]:
                return {**(getattr(c, "kwargs", None) or {}), "num_warps": getattr(c, "num_warps", None),
                        "num_stages": getattr(c, "num_stages", None)}

            # `configs` is None once Inductor has pruned its candidates after autotuning.
            out.append({"name": attr, "module": getattr(mod, "__file__", ""),
                        "size_hints": getattr(obj, "size_hints", None),
                        "candidates": [cfg(c) for c in (getattr(obj, "configs", None) or [])],
                        "chosen": [{**cfg(getattr(ln, "config", None)), "n_regs": getattr(ln, "n_regs", None),
                                    "n_spills": getattr(ln, "n_spills", None),
                                    "shared": getattr(ln, "shared", None)} for ln in obj.launchers],
                        "src": getattr(fn, "src", "")})
    return out


def print_case(title: str, r: dict[str, Any]) -> None:
    print(f"\n## {title}: wall {r['wall_ms_per_step']:.2f} ms/step, kernels {r['kernel_ms_per_step']:.2f} ms "
          f"({r['kernels_per_step']:.0f} per step)")
    print("| class | ms/step | kernels/step | share |\n|---|---:|---:|---:|")
    for k, v in r["classes"].items():
        print(f"| {k} | {v['ms']:.3f} | {v['count']:.0f} | {100 * v['share']:.1f}% |")
    if "gaps_ms" in r:
        print("device idle between kernels, ms/step by gap length: "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["gaps_ms"].items()))
    print("| top kernel | class | ms/step | per step |\n|---|---|---:|---:|")
    for t in r["top"][:15]:
        print(f"| `{t['name'][:90]}` | {t['class']} | {t['ms']:.3f} | {t['count']:.0f} |")
    for g in r.get("gap_sites", []):
        print(f"gap {g['ms']:.3f} ms/step x{g['count']:.0f}: after `{g['before']}` before `{g['after']}`")


def render(path: Path) -> None:
    """Markdown next to the JSON: per run and case, device time by kernel class, idle gaps, top kernels."""
    data = json.loads(path.read_text())
    lines = ["# Where a step's device time goes, by kernel class", "", f"Command: `{data['command']}`", ""]
    for c in data.get("calls", []):
        lines.append(f"- `{c['command']}`{': ' + c['note'] if c.get('note') else ''}")
    if "launch_floor" in data:
        lf = data["launch_floor"]
        lines += ["", f"CUDA-graph launch floor: {lf['us_per_kernel']:.2f} us per kernel ({lf['kernels']} dependent "
                  "1-element adds in one graph)."]
    for run in data["runs"]:
        for case, r in run["cases"].items():
            lines += ["", f"## {run['model']} / {run['variant']} — {case}", "",
                      f"wall {r['wall_ms_per_step']:.2f} ms/step, kernels {r['kernel_ms_per_step']:.2f} ms "
                      f"({r['kernels_per_step']:.0f} kernels per step)."]
            if "gaps_ms" in r:
                lines.append("Device idle between kernels (ms/step, by gap length; the longest bin includes the "
                             "host work between profiled steps): "
                             + ", ".join(f"{k} {v:.3f}" for k, v in r["gaps_ms"].items()) + ".")
            lines += ["", "| class | ms/step | kernels/step | share |", "|---|---:|---:|---:|"]
            lines += [f"| {k} | {v['ms']:.3f} | {v['count']:.0f} | {100 * v['share']:.1f}% |"
                      for k, v in r["classes"].items()]
            lines += ["", "| top kernel | class | ms/step | per step |", "|---|---|---:|---:|"]
            lines += [f"| `{t['name'][:90]}` | {t['class']} | {t['ms']:.3f} | {t['count']:.0f} |" for t in r["top"][:10]]
            if r.get("gap_sites"):
                lines += ["", "| idle gaps >= 20 us: after kernel | before kernel | ms/step | per step |",
                          "|---|---|---:|---:|"]
                lines += [f"| `{g['before'][:60]}` | `{g['after'][:60]}` | {g['ms']:.3f} | {g['count']:.0f} |"
                          for g in r["gap_sites"][:8]]
    lines += ["", "![plot](" + path.with_suffix(".png").name + ")"]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(data, path.with_suffix(".png"))


def plot(data: dict[str, Any], out: Path) -> None:
    """One stacked bar per (run, case): ms per step by kernel class, plus the idle time up to the wall."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    bars = [(f"{run['model']} {run['variant'].split(' [')[0]}{' [' + run['variant'].split(' [')[1][:10] + ']' if ' [' in run['variant'] else ''} {case}",
             r) for run in data["runs"] for case, r in run["cases"].items()]
    classes = [c for c, _ in CLASSES] + ["other"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 1.5))
    left = [0.0] * len(bars)
    for i, cls in enumerate(classes):
        vals = [r["classes"].get(cls, {}).get("ms", 0.0) for _, r in bars]
        ax.barh(range(len(bars)), vals, left=left, label=cls, color=f"C{i % 10}")
        left = [a + b for a, b in zip(left, vals)]
    idle = [max(0.0, r["wall_ms_per_step"] - r["kernel_ms_per_step"]) for _, r in bars]
    ax.barh(range(len(bars)), idle, left=left, label="idle / host", color="lightgray")
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=6)
    ax.set_xlabel("ms per step (profiled)")
    ax.legend(fontsize=6, ncol=5, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path, help="write the markdown of an e2e_profile.json and exit")
    ap.add_argument("--models", default="v2_lite")
    ap.add_argument("--variants", default="base", help="as e2e_roofline.py --variants")
    ap.add_argument("--batches", type=ints, default=[1, 64])
    ap.add_argument("--contexts", type=ints, default=[1024])
    ap.add_argument("--chunks", type=ints, default=[2048])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="PASS.OPTION=JSON",
                    help="pass options for the build, e.g. --set fuse_moe.enabled=false")
    ap.add_argument("--inductor-kernels", default="", metavar="REGEX",
                    help="after each model's cases, record the launch configs Inductor's Triton kernels "
                         "whose names match settled on (e.g. 'silu'): run['inductor_kernels']")
    args = ap.parse_args()
    if args.render:
        render(args.render)
        return
    if args.out is None:
        ap.error("--out is required (or --render)")
    args.out.mkdir(parents=True, exist_ok=True)
    transforms: dict[str, dict[str, Any]] = {}
    for item in args.set:
        key, _, val = item.partition("=")
        pname, _, opt = key.partition(".")
        transforms.setdefault(pname, {})[opt] = json.loads(val)
    data: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "runs": []}
    if args.device == "cuda":
        data["launch_floor"] = launch_floor()
        print(f"CUDA-graph launch floor: {data['launch_floor']['us_per_kernel']:.2f} us per kernel")
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            om = build_model(name, variant, args, transforms)
            om.warmup()
            run: dict[str, Any] = {"model": name, "variant": variant, "cases": {}}
            for b in args.batches:
                for c in args.contexts:
                    r = profile_decode(om, b, c, args.steps, args.warmup)
                    run["cases"][f"decode_B{b}_C{c}"] = r
                    print_case(f"{name}/{variant} decode B{b} C{c}", r)
            for t in args.chunks:
                r = profile_prefill(om, t)
                run["cases"][f"prefill_{t}"] = r
                print_case(f"{name}/{variant} prefill {t}", r)
            if args.inductor_kernels:
                run["inductor_kernels"] = inductor_launch_configs(args.inductor_kernels)
                shown: set[str] = set()  # each piece compiles its own copy: print a source once
                for k in run["inductor_kernels"]:
                    src = "" if k["src"] in shown else "\n" + k["src"]
                    shown.add(k["src"])
                    print(f"inductor kernel {k['name']}: size hints {k['size_hints']}, chosen {k['chosen']}, "
                          f"of {len(k['candidates'])} candidates ({k['module']}){src}")
            data["runs"].append(run)
            (args.out / "e2e_profile.json").write_text(json.dumps(data, indent=1, default=str))
            render(args.out / "e2e_profile.json")
            del om
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
