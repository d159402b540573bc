"""Launch configs of the block-FP8 MoE experts op (`fused_moe_fp8`: up_fp8_kernel + down_fp8_kernel).

The op's launch config comes from `moe_fp8_config` (custom_ops/moe/tuning.py), set from this sweep: before
it, the 16-bit op's config made the FP8 op ~2x slower than the 16-bit one at prefill (DeepSeek-V2-Lite,
T=2048: 1058 vs 473 us).
For each family (`--families`: E, top-k, H, I of benchmarks.lib's FP8_FAMILIES) and T (`--tokens`), on
random uniform top-k routing and random 128 x 128 block-FP8 experts, same run, same process:
- the FP8 op at its default config (row `default`) and at every config of the grid: block_m x num_warps x
  num_stages x down_n (the up kernel's tiles stay block_k x block_k: its epilogue quantizes one activation
  group per tile); a config that fails to compile or launch (shared memory) is a row with the error;
- the sorted-rows persistent path (`persistent_sorted=True`, rows `sorted`: the activations' FP8 codes and
  scales copied into expert order once, persistent up / down GEMMs, gate and up in one product; opt-in until
  this sweep has measured it) at every config of SORTED_GRID, so one run compares it with the gathered
  kernels (`--no-sorted` / `--no-grid` leave either out);
- the 16-bit op (`fused_moe`, its default config) on the same routing with bf16 experts of the same shape;
- floors: bytes (FP8 weights + scales of the experts routed to, activations in and out, over the copy
  bandwidth) and FLOPs (2 x 3 x pairs x H x I over the FP8 peak, `add_fp8_peak`), both measured here;
- every FP8 row's relative error against `moe_experts_fp8_emulated` (fp32): a wrong config is visible.
Device time: CUDA-graph replay medians with L2 emptied before each run (`--flush read`).

    python -m benchmarks.moe.sweep_moe_fp8 --out /tmp/moe_fp8 --commit $(git rev-parse --short HEAD)
    python -m benchmarks.moe.sweep_moe_fp8 --quick --out /tmp/moe_fp8   # V2-Lite and GLM, T 512 and 2048
    python -m benchmarks.moe.sweep_moe_fp8 --quick --no-grid --out /tmp/moe_fp8   # default vs sorted vs bf16
    TRITON_INTERPRET=1 python -m benchmarks.moe.sweep_moe_fp8 --smoke --out /tmp/moe_fp8_smoke   # CPU, tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.lib import (FP8_FAMILIES, TINY, add_fp8_peak, command, error_line, expert_shape, fused_moe,
                            fused_moe_fp8, ints, machine, measure_peaks, moe_experts_fp8_emulated, moe_fp8_config, pyplot,
                            random_block_weight, time_us)

BLOCK = 128
GRID = {"block_m": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4), "down_n": (64, 128)}
SMOKE_GRID = {"block_m": (16, 32), "num_warps": (4,), "num_stages": (1,), "down_n": (32,)}
#: the sorted-rows path (`persistent_sorted=True`): prefill-sized row blocks; 128-row blocks put a [128, 256]
#: fp32 accumulator (gate and up) in the up kernel, 256-column down tiles are the 16-bit op's prefill choice
SORTED_GRID = {"block_m": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4), "down_n": (128, 256)}
SMOKE_SORTED_GRID = {"block_m": (16,), "num_warps": (4,), "num_stages": (1,), "down_n": (32, 64)}
KEYS = tuple(GRID)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def label(c: dict[str, int]) -> str:
    return f"bm{c['block_m']} w{c['num_warps']} s{c['num_stages']} dn{c['down_n']}"


def grid(smoke: bool, sorted_rows: bool = False) -> list[dict[str, int]]:
    g = (SMOKE_SORTED_GRID if smoke else SORTED_GRID) if sorted_rows else (SMOKE_GRID if smoke else GRID)
    return [dict(zip(KEYS, vals)) for vals in itertools.product(*g.values())]


def sorted_label(c: dict[str, int]) -> str:
    return "sorted " + label(c)


Rows = list[dict[str, Any]]


def family_rows(args, dev, peaks, fam: str, cfg: dict[str, Any], done: Callable[[Rows], None]) -> None:
    """Times every variant at each T of `args.tokens`; `done(rows)` after each T."""
    ex = expert_shape(fam, cfg)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    block = BLOCK if not args.smoke else 32
    wu, su = random_block_weight((ex.experts, 2 * ex.inter, ex.hidden), block, block, dev, seed=1)
    wd, sd = random_block_weight((ex.experts, ex.hidden, ex.inter), block, block, dev, seed=2)
    g = torch.Generator(device=dev).manual_seed(0)
    wu16 = torch.randn(wu.shape, device=dev, generator=g, dtype=dtype).mul_(0.02) if args.bf16 else None
    wd16 = torch.randn(wd.shape, device=dev, generator=g, dtype=dtype).mul_(0.02) if args.bf16 else None
    for t in args.tokens:
        x = torch.randn(t, ex.hidden, device=dev, dtype=dtype, generator=g)
        ids = torch.rand(t, ex.experts, device=dev, generator=g).topk(ex.top_k, dim=-1).indices.to(torch.int32)
        wts = torch.rand(t, ex.top_k, device=dev, generator=g)
        n, used = t * ex.top_k, int(ids.unique().numel())
        per_expert = 3 * ex.hidden * ex.inter + 4 * (su[0].numel() + sd[0].numel())
        bytes_us = (used * per_expert + 2 * t * ex.hidden * x.element_size()) / (peaks["copy_gb_s"] * 1e9) * 1e6
        flop_us = 2 * 3 * n * ex.hidden * ex.inter / (peaks["fp8_tflops"] * 1e12) * 1e6
        ref = moe_experts_fp8_emulated(x, ids, wts, wu, su, wd, sd, block, block)
        d = moe_fp8_config(n, ex.experts, ex.hidden, ex.inter, block, dev.type == "cuda")
        base = {"family": fam, "experts": ex.experts, "top_k": ex.top_k, "hidden": ex.hidden, "inter": ex.inter,
                "t": t, "n_pairs": n, "experts_used": used, "bytes_floor_us": bytes_us, "flop_floor_us": flop_us}
        variants = [("bf16", "bf16 fused_moe (default)", {}, lambda: fused_moe(x, ids, wts, wu16, wd16))]
        variants = variants if args.bf16 else []
        variants.append(("default", "default", {}, lambda: fused_moe_fp8(x, ids, wts, wu, su, wd, sd, block, block)))
        variants += [("grid", label(c), c, lambda c=c: fused_moe_fp8(x, ids, wts, wu, su, wd, sd, block, block, **c))
                     for c in (grid(args.smoke) if args.grid else [])]
        variants += [("sorted", sorted_label(c), c, lambda c=c: fused_moe_fp8(x, ids, wts, wu, su, wd, sd, block, block,
                                                                                persistent_sorted=True, **c))
                     for c in (grid(args.smoke, sorted_rows=True) if args.sorted else [])]
        case, bf16_us = [], None
        for kind, name, c, fn in variants:
            row = {**base, "kind": kind, "config": name, **c, "us": None, "note": ""}
            if kind == "default":
                row["note"] = f"moe_fp8_config: bm{d.block_m} w{d.num_warps} s{d.num_stages} dn{d.down_n}"
            try:
                y = fn()
                row["rel_err"] = None if kind == "bf16" else rel_err(y, ref)
                row["us"], row["how"] = time_us(fn, graph=dev.type == "cuda", rep_ms=args.rep_ms, flush=args.flush)
                row["x_floor"] = row["us"] / max(bytes_us, flop_us)
            except Exception as e:  # noqa: BLE001 - a config that fails (shared memory, compile) is a row
                row["note"] = error_line(e)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            if kind == "bf16":
                bf16_us = row["us"]
            row["x_bf16"] = row["us"] / bf16_us if row["us"] and bf16_us else None
            case.append(row)
            print(f"{fam:16s} T={t:<5d} {name:24s} {_num(row['us'], '{:9.1f}'):>9s} us  x bf16 "
                  f"{_num(row['x_bf16'], '{:5.2f}'):>5s}  x floor {_num(row.get('x_floor'), '{:5.2f}'):>5s}  "
                  f"err {_num(row.get('rel_err'), '{:.1e}')} {row['note']}", flush=True)
        done(case)
    del wu, su, wd, sd, wu16, wd16
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _num(v: Optional[float], fmt: str) -> str:
    return "" if v is None else fmt.format(v)


def best(rows: list[dict[str, Any]], tol: float, kinds: tuple[str, ...] = ("default", "grid", "sorted")
         ) -> Optional[dict[str, Any]]:
    """The fastest FP8 row of `kinds` (default, grid, sorted) whose error is within `tol`."""
    ok = [r for r in rows if r["kind"] in kinds and r["us"] is not None and (r.get("rel_err") or 0) <= tol]
    return min(ok, key=lambda r: r["us"]) if ok else None


def cases(result: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        out.setdefault((r["family"], r["t"]), []).append(r)
    return out


def write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_fp8_sweep.json").write_text(json.dumps(result, indent=1))
    m, p, tol = result["machine"], result["peaks"], result["err_tol"]
    lines = ["# Block-FP8 MoE experts: launch configs of fused_moe_fp8", "",
             f"`{m['command']}` on {m['gpu']} (torch {m['torch']}, triton {m['triton']}), {m['date']}, commit "
             f"{result.get('commit') or '?'}.", "",
             f"Peaks measured in this run: FP8 {p['fp8_tflops']:.0f} TFLOP/s (scaled_mm per-tensor, n={p['fp8_n']}), "
             f"copy {p['copy_gb_s']:.0f} GB/s. Floor = max(bytes floor, FLOP floor); grid: block_m x warps x stages "
             f"x down_n (bm/w/s/dn), the up tiles block_k x block_k; `sorted`: the sorted-rows persistent path "
             f"(persistent_sorted=True) at those configs. Best: the fastest FP8 row with rel err <= {tol:g}; best "
             "sorted: the fastest sorted row.",
             "", "## Best config per size", "",
             "| family | T | used / E | default us | best config | best us | x default | best sorted | sorted us | "
             "sorted x default | bf16 us | best x bf16 | bytes floor us | FLOP floor us | best x floor |",
             "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    groups = cases(result)
    for (fam, t), rs in groups.items():
        b, dflt = best(rs, tol), next((r for r in rs if r["kind"] == "default"), {})
        bs = best(rs, tol, ("sorted",))
        bf = next((r for r in rs if r["kind"] == "bf16"), {})
        r0 = rs[0]
        lines.append(f"| {fam} | {t} | {r0['experts_used']} / {r0['experts']} | {_num(dflt.get('us'), '{:.1f}')} | "
                     f"{b['config'] if b else 'none'} | {_num(b and b['us'], '{:.1f}')} | "
                     f"{_num(b and dflt.get('us') and b['us'] / dflt['us'], '{:.2f}')} | "
                     f"{bs['config'] if bs else 'none'} | {_num(bs and bs['us'], '{:.1f}')} | "
                     f"{_num(bs and dflt.get('us') and bs['us'] / dflt['us'], '{:.2f}')} | "
                     f"{_num(bf.get('us'), '{:.1f}')} | {_num(b and b.get('x_bf16'), '{:.2f}')} | "
                     f"{r0['bytes_floor_us']:.1f} | {r0['flop_floor_us']:.1f} | "
                     f"{_num(b and b.get('x_floor'), '{:.2f}')} |")
    for (fam, t), rs in groups.items():
        r0 = rs[0]
        lines += ["", f"## {fam} (E {r0['experts']}, top-{r0['top_k']}, H {r0['hidden']}, I {r0['inter']}), T={t}", "",
                  "| config | us | x bf16 | x max(floor) | rel err | note |", "|---|---:|---:|---:|---:|---|"]
        order = sorted(rs, key=lambda r: (("bf16", "default", "grid", "sorted").index(r["kind"]), r["us"] is None,
                                          r["us"] or 0))
        lines += [f"| {r['config']} | {_num(r['us'], '{:.1f}')} | {_num(r['x_bf16'], '{:.2f}')} | "
                  f"{_num(r.get('x_floor'), '{:.2f}')} | {_num(r.get('rel_err'), '{:.1e}')} | {r['note']} |"
                  for r in order]
    (out / "moe_fp8_sweep.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fams = sorted({f for f, _ in groups})
    fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 4), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        ts = sorted(t for f, t in groups if f == fam)
        pick = {"default": lambda rs: next((r for r in rs if r["kind"] == "default"), None),
                "best gathered": lambda rs: best(rs, tol, ("default", "grid")),
                "best sorted": lambda rs: best(rs, tol, ("sorted",)),
                "bf16": lambda rs: next((r for r in rs if r["kind"] == "bf16"), None)}
        for j, (name, fn) in enumerate(pick.items()):
            vals = [(fn(groups[(fam, t)]) or {}).get("us") or 0 for t in ts]
            ax.bar([i + 0.2 * j for i in range(len(ts))], vals, 0.2, label=name)
        floors = [max(groups[(fam, t)][0]["bytes_floor_us"], groups[(fam, t)][0]["flop_floor_us"]) for t in ts]
        ax.scatter([i + 0.3 for i in range(len(ts))], floors, marker="_", s=400, color="k", label="floor")
        ax.set_xticks([i + 0.3 for i in range(len(ts))], [f"T={t}" for t in ts])
        ax.set_yscale("log")
        ax.set_ylabel("us")
        ax.set_title(fam)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "moe_fp8_sweep.png", dpi=130)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe_fp8_sweep"))
    ap.add_argument("--families", type=lambda s: s.split(","), default=None,
                    help="FP8_FAMILIES names (default deepseek_v2_lite,glm_4_7_flash,deepseek_v3)")
    ap.add_argument("--tokens", type=ints, default=None, help="T values (default 64,512,2048)")
    ap.add_argument("--quick", action="store_true",
                    help="V2-Lite and GLM at T 512 and 2048 only (unless --families / --tokens say otherwise)")
    ap.add_argument("--rep-ms", type=float, default=20)
    ap.add_argument("--flush", default="read", choices=("zero", "read"))
    ap.add_argument("--err-tol", type=float, default=5e-2, help="rel err above which a config cannot be the best")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the 16-bit reference rows")
    ap.add_argument("--no-grid", dest="grid", action="store_false",
                    help="skip the gathered kernels' grid (the default config row stays)")
    ap.add_argument("--no-sorted", dest="sorted", action="store_false",
                    help="skip the sorted-rows path's rows (persistent_sorted=True at SORTED_GRID's configs)")
    ap.add_argument("--commit", default="", help="recorded in the report")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 configs (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.families is None:
        args.families = ["deepseek_v2_lite", "glm_4_7_flash"] + ([] if args.quick else ["deepseek_v3"])
    if args.tokens is None:
        args.tokens = [512, 2048] if args.quick else [64, 512, 2048]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.tokens, args.rep_ms = [5, 24], 5
    fams = {"tiny": TINY} if args.smoke else {f: FP8_FAMILIES[f] for f in args.families}
    t0 = time.time()
    peaks = add_fp8_peak(measure_peaks(dev, quick=args.smoke), dev, args.smoke)
    print(f"peaks: FP8 {peaks['fp8_tflops']:.0f} TFLOP/s, copy {peaks['copy_gb_s']:.0f} GB/s", flush=True)
    result = {"machine": machine(command(argv)), "commit": args.commit, "peaks": peaks, "err_tol": args.err_tol,
              "grid": SMOKE_GRID if args.smoke else GRID,
              "sorted_grid": SMOKE_SORTED_GRID if args.smoke else SORTED_GRID, "rows": []}
    def done(case: list[dict[str, Any]]) -> None:  # written after every (family, T): a run cut short keeps them
        result["rows"] += case
        result["seconds"] = time.time() - t0
        write(args.out, result)

    for fam, cfg in fams.items():
        family_rows(args, dev, peaks, fam, cfg, done)
    print((args.out / "moe_fp8_sweep.md").read_text())
    print(f"wrote {args.out}/moe_fp8_sweep.{{md,json,png}} in {result['seconds']:.0f} s")
    return 0 if any(r["us"] is not None for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
