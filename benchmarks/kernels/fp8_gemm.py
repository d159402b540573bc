"""Block-FP8 (W8A8, 128 x 128 weight blocks) dense GEMMs and MoE experts, every backend at the seven
FP8 families' shapes, against the peaks measured in the same run (issue 44).

Same run, same process:
- peaks: FP8 dense peak = `torch._scaled_mm` with per-tensor scales on an 8192^3 e4m3 product (the
  tensor cores' FP8 rate with no block scaling), bf16 matmul and device copy bandwidth (benchmarks.lib
  measure_peaks);
- dense linears (benchmarks.lib.fp8_shapes: every FP8 linear of a decoder layer as the graph runs it)
  at prefill T in {2048, 8192}, decode T in {1, 16, 64} and the T in between {128, 256, 512} (`mid`:
  where `cublas_triton` switches from Triton to cuBLAS): each FP8 linear backend (its op, as the
  graph calls it: activation quantization included) and cuBLAS bf16 (`F.linear` on a bf16 weight of
  the same shape) for reference. Prefill rows report TFLOP/s and % of the FP8 peak (target >= 70%),
  decode rows GB/s over weight + activation + output bytes and % of the copy bandwidth (target >= 80%);
- MoE decode (T in {1, 16, 64}): triton_moe_experts_fp8 over random top-k routing vs its byte floor
  (the FP8 weights and scales of the experts the step actually routes to, over the copy bandwidth;
  target within 1.3x);
- every row's relative error against the fp32 emulation of the same quantization (a wrong kernel is
  visible next to its speed). A backend that refuses a shape (its check()) is a row with the reason;
  one that raises is a row with the error: the run always completes.
- DeepGEMM's published H800 numbers (README, Feb 2025) are printed alongside as the reference mark.

Device time: CUDA-graph replay medians with L2 emptied before each run (`--flush read` by default:
a cold L2 without dirty lines, as a decode step's GEMM finds it, docs/benchmarks/read_floor.md).

    python -m benchmarks.kernels.fp8_gemm --out docs/benchmarks            # -> fp8_weights_kernels.{md,json,png}
    python -m benchmarks.kernels.fp8_gemm --families deepseek_v3 --no-moe --out /tmp/fp8
    python -m benchmarks.kernels.fp8_gemm --tune --families deepseek_v3 --out /tmp/fp8tune   # Triton configs
    python -m benchmarks.kernels.fp8_gemm --smoke --out /tmp/fp8smoke      # CPU (Triton interpreter): the script itself
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.lib import (FP8_FAMILIES, FP8_LINEAR_BACKENDS, TINY, FP8LinearNode, GemmConfig, Target, add_fp8_peak,
                            command, error_line, expert_shape, fp8_linear_backend, ints, fp8_linear_op, fused_moe_fp8,
                            linear_shapes, machine, measure_peaks, moe_experts_fp8_emulated, pyplot,
                            random_block_weight, time_us, triton_block_linear, w8a8_block_linear_emulated)

BLOCK = 128
#: DeepGEMM README (Feb 2025), H800 SXM, FP8 W8A8 1x128 / 128x128 scaling: (M, N, K) -> (TFLOP/s, GB/s)
DEEPGEMM_H800 = {(64, 2112, 7168): (206, 1688), (128, 2112, 7168): (352, 1509), (128, 4096, 7168): (533, 2221),
                 (128, 7168, 2048): (510, 2277)}
#: `--tune`: split_k 0 = gemm_config's rule (enough programs for 2 per SM), 1 = one launch (no split-K
#: sum kernel: at decode sizes the op is three launches, act_quant + GEMM + sum, and V2-Lite's linears
#: took 11-24 us whatever their bytes; narrow N tiles give a single launch enough programs)
TUNE_CONFIGS = [GemmConfig(bm, bn, 128, sk, 8, w, s) for bm, bn, w, s, sk in (
    (16, 64, 4, 4, 0), (16, 128, 4, 4, 0), (32, 64, 4, 4, 0), (64, 64, 4, 4, 0),
    (16, 32, 4, 4, 1), (64, 32, 4, 4, 1), (16, 64, 4, 4, 1), (64, 64, 4, 4, 1),
    (64, 128, 4, 4, 1), (128, 128, 8, 3, 1), (128, 128, 8, 4, 1), (128, 256, 8, 3, 1), (64, 256, 8, 4, 1))]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def linear_rows(args, dev, target, peaks) -> list[dict[str, Any]]:
    rows = []
    fams = {f: FP8_FAMILIES[f] for f in args.families} if not args.smoke else {"tiny": TINY}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ts = ([(t, "prefill") for t in args.prefill_t] + [(t, "mid") for t in args.mid_t]
          + [(t, "decode") for t in args.decode_t])
    seen = set()
    for fam, cfg in fams.items():
        for shape in linear_shapes(fam, cfg):
            if (shape.n, shape.k) in seen and not args.all_repeats:
                continue  # the same (N, K) in another family: measured once
            seen.add((shape.n, shape.k))
            w, s = random_block_weight((shape.n, shape.k), BLOCK, BLOCK, dev, seed=shape.n + shape.k)
            w16 = torch.randn(shape.n, shape.k, device=dev, dtype=dtype) * 0.02 if args.bf16 else None
            for t, phase in ts:
                x = torch.randn(t, shape.k, device=dev, dtype=dtype)
                ref = w8a8_block_linear_emulated(x, w, s, None, BLOCK, BLOCK, torch.float32)
                node = FP8LinearNode(shape.n, shape.k, BLOCK, BLOCK, dtype)
                flops, wbytes = 2 * t * shape.n * shape.k, w.numel() + s.numel() * 4
                nbytes = wbytes + (t * shape.k + t * shape.n) * x.element_size()
                variants: list[tuple[str, Optional[Callable[[], torch.Tensor]], str]] = []
                for name in args.backends:
                    chk = fp8_linear_backend(name).check(node, target)
                    op = fp8_linear_op(name)
                    variants.append((name, (lambda op=op: op(x, w, s, None, BLOCK, BLOCK)) if chk.ok else None,
                                     "" if chk.ok else f"refused: {chk.reason}"))
                if args.tune and "triton" in args.backends:
                    for cfg_t in TUNE_CONFIGS:
                        k_tiles = shape.k // BLOCK
                        sk = cfg_t.split_k or max(1, min(k_tiles // 2, math.ceil(264 / (
                            math.ceil(t / cfg_t.block_m) * math.ceil(shape.n / cfg_t.block_n)))))
                        c = GemmConfig(cfg_t.block_m, cfg_t.block_n, 128, sk, 8, cfg_t.num_warps, cfg_t.num_stages)
                        variants.append((f"triton[{c.block_m}x{c.block_n} sk{sk} w{c.num_warps} s{c.num_stages}]",
                                         lambda c=c: triton_block_linear(x, w, s, None, BLOCK, BLOCK, c), ""))
                if w16 is not None:
                    variants.append(("cublas_bf16", lambda: torch.nn.functional.linear(x, w16), ""))
                for name, fn, note in variants:
                    row = {"family": fam, "linear": shape.name, "n": shape.n, "k": shape.k, "t": t, "phase": phase,
                           "backend": name, "us": None, "note": note}
                    if fn is not None:
                        try:
                            y = fn()
                            row["rel_err"] = None if name == "cublas_bf16" else rel_err(y, ref)
                            row["us"], row["how"] = time_us(fn, graph=dev.type == "cuda", rep_ms=args.rep_ms,
                                                            flush=args.flush) if dev.type == "cuda" else time_us(fn, graph=False)
                            row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
                            b = nbytes if name != "cublas_bf16" else nbytes - wbytes + 2 * w.numel()  # a bf16 weight
                            row["gb_s"] = b / (row["us"] * 1e-6) / 1e9
                            row["pct_peak"] = (100 * row["tflops"] / peaks["fp8_tflops"] if phase != "decode"
                                               else 100 * row["gb_s"] / peaks["copy_gb_s"])
                        except Exception as e:  # noqa: BLE001 - a failing backend is a row, not a crash
                            row["note"] = error_line(e)
                            if dev.type == "cuda":
                                torch.cuda.synchronize()
                    rows.append(row)
                    print(_fmt(row), flush=True)
            del w, s, w16
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def moe_rows(args, dev, peaks) -> list[dict[str, Any]]:
    rows = []
    fams = {f: FP8_FAMILIES[f] for f in args.families} if not args.smoke else {"tiny": TINY}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    block = BLOCK if not args.smoke else 32
    for fam, cfg in fams.items():
        ex = expert_shape(fam, cfg)
        if ex.experts == 0 or (fam, ex.hidden, ex.inter) in {(r["family"], r["hidden"], r["inter"]) for r in rows}:
            continue
        wu, su = random_block_weight((ex.experts, 2 * ex.inter, ex.hidden), block, block, dev, seed=1)
        wd, sd = random_block_weight((ex.experts, ex.hidden, ex.inter), block, block, dev, seed=2)
        g = torch.Generator(device=dev).manual_seed(0)
        for t in args.decode_t:
            x = torch.randn(t, ex.hidden, device=dev, dtype=dtype, generator=g)
            ids = torch.rand(t, ex.experts, device=dev, generator=g).topk(ex.top_k, dim=-1).indices.to(torch.int32)
            wts = torch.rand(t, ex.top_k, device=dev, generator=g)
            used = int(ids.unique().numel())
            per_expert = 3 * ex.hidden * ex.inter + 4 * (su[0].numel() + sd[0].numel())
            floor_bytes = used * per_expert + t * ex.hidden * 2 * x.element_size()
            floor_us = floor_bytes / (peaks["copy_gb_s"] * 1e9) * 1e6
            row = {"family": fam, "experts": ex.experts, "top_k": ex.top_k, "hidden": ex.hidden, "inter": ex.inter,
                   "t": t, "experts_used": used, "floor_us": floor_us, "backend": "triton", "us": None, "note": ""}
            fn = lambda: fused_moe_fp8(x, ids, wts, wu, su, wd, sd, block, block)  # noqa: E731
            try:
                y = fn()
                row["rel_err"] = rel_err(y, moe_experts_fp8_emulated(x, ids, wts, wu, su, wd, sd, block, block))
                row["us"], row["how"] = (time_us(fn, graph=True, rep_ms=args.rep_ms, flush=args.flush)
                                         if dev.type == "cuda" else time_us(fn, graph=False))
                row["x_floor"] = row["us"] / floor_us
            except Exception as e:  # noqa: BLE001
                row["note"] = error_line(e)
            rows.append(row)
            print(f"moe {fam:16s} T={t:<5d} used {used:3d}/{ex.experts} {row['us'] or 0:9.1f} us  floor "
                  f"{floor_us:8.1f} us  x{row.get('x_floor') or 0:.2f}  err {row.get('rel_err') or 0:.1e} {row['note']}",
                  flush=True)
        del wu, su, wd, sd
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(r: dict[str, Any]) -> str:
    if r["us"] is None:
        return f"{r['family']:16s} {r['linear']:15s} T={r['t']:<5d} {r['backend']:12s} -- {r['note']}"
    unit = f"{r['tflops']:7.1f} TF/s" if r["phase"] != "decode" else f"{r['gb_s']:7.0f} GB/s"
    err = "" if r.get("rel_err") is None else f" err {r['rel_err']:.1e}"
    return (f"{r['family']:16s} {r['linear']:15s} T={r['t']:<5d} {r['backend']:12s} {r['us']:9.1f} us {unit} "
            f"{r['pct_peak']:5.1f}%{err}")


def write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_weights_kernels.json").write_text(json.dumps(result, indent=1))
    p = result["peaks"]
    lines = ["# Block-FP8 GEMMs and MoE experts (W8A8, 128 x 128 weight blocks)", "",
             f"`{result['machine']['command']}` on {result['machine']['gpu']} (torch {result['machine']['torch']}, "
             f"triton {result['machine']['triton']}, flashinfer {result['machine']['flashinfer']}), "
             f"{result['machine']['date']}, commit {result.get('commit', '?')}.", "",
             f"Peaks measured in this run: FP8 {p['fp8_tflops']:.0f} TFLOP/s (scaled_mm per-tensor, n={p['fp8_n']}), "
             f"bf16 {p['matmul_tflops']:.0f} TFLOP/s, copy {p['copy_gb_s']:.0f} GB/s. Prefill rows: % of the FP8 peak "
             "(target >= 70%), as are the `mid` rows (T between decode and prefill: where cublas_triton switches, "
             "no target); decode rows: % of the copy bandwidth over weight + activation + output bytes "
             "(target >= 80%).", "",
             "| family | linear | N | K | T | backend | us | TFLOP/s | GB/s | % peak | rel err | note |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in result["linears"]:
        num = (lambda k, f: "" if r.get(k) is None else f.format(r[k]))
        lines.append(f"| {r['family']} | {r['linear']} | {r['n']} | {r['k']} | {r['t']} | {r['backend']} | "
                     f"{num('us', '{:.1f}')} | {num('tflops', '{:.1f}')} | {num('gb_s', '{:.0f}')} | "
                     f"{num('pct_peak', '{:.1f}')} | {num('rel_err', '{:.1e}')} | {r['note']} |")
    if result["moe"]:
        lines += ["", "MoE decode (triton_moe_experts_fp8), floor = FP8 bytes of the experts routed to / copy bandwidth "
                  "(target <= 1.3x):", "",
                  "| family | E x top-k | H | I | T | experts used | us | floor us | x floor | rel err | note |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["moe"]:
            us = "" if r["us"] is None else f"{r['us']:.1f}"
            xf = "" if r.get("x_floor") is None else f"{r['x_floor']:.2f}"
            err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
            lines.append(f"| {r['family']} | {r['experts']} x {r['top_k']} | {r['hidden']} | {r['inter']} | {r['t']} | "
                         f"{r['experts_used']} | {us} | {r['floor_us']:.1f} | {xf} | {err} | {r['note']} |")
    lines += ["", "DeepGEMM's published numbers (README, Feb 2025; H800, not this GPU), for reference:", "",
              "| M | N | K | TFLOP/s | GB/s |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {m} | {n} | {k} | {tf} | {gb} |" for (m, n, k), (tf, gb) in DEEPGEMM_H800.items()]
    (out / "fp8_weights_kernels.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, phase in zip(axes, ("prefill", "decode")):
        rs = [r for r in result["linears"] if r["phase"] == phase and r["us"] is not None]
        labels = sorted({f"{r['linear']} {r['n']}x{r['k']} T{r['t']}" for r in rs})
        backends = sorted({r["backend"] for r in rs if "[" not in r["backend"]})
        width = 0.8 / max(1, len(backends))
        for j, b in enumerate(backends):
            vals = {f"{r['linear']} {r['n']}x{r['k']} T{r['t']}": r["pct_peak"] for r in rs if r["backend"] == b}
            ax.bar([i + j * width for i in range(len(labels))], [vals.get(lb, 0) for lb in labels], width, label=b)
        ax.axhline(70 if phase == "prefill" else 80, color="k", lw=0.8, ls="--")
        ax.set_xticks([i + 0.4 for i in range(len(labels))], labels, rotation=90, fontsize=5)
        ax.set_ylabel("% of FP8 peak" if phase == "prefill" else "% of copy bandwidth")
        ax.set_title(phase)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fp8_weights_kernels.png", dpi=130)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--families", type=lambda s: s.split(","), default=list(FP8_FAMILIES))
    ap.add_argument("--backends", type=lambda s: s.split(","), default=[b for b in FP8_LINEAR_BACKENDS if b != "torch"])
    ap.add_argument("--prefill-t", type=ints, default=[2048, 8192])
    ap.add_argument("--decode-t", type=ints, default=[1, 16, 64])
    ap.add_argument("--mid-t", type=ints, default=[128, 256, 512],
                    help="T between decode and prefill: where cublas_triton's switch to cuBLAS belongs (%% of FP8 peak)")
    ap.add_argument("--rep-ms", type=float, default=25)
    ap.add_argument("--flush", default="read", choices=("zero", "read"))
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the cuBLAS bf16 reference rows")
    ap.add_argument("--no-moe", dest="moe", action="store_false")
    ap.add_argument("--all-repeats", action="store_true", help="measure an (N, K) again in every family that has it")
    ap.add_argument("--tune", action="store_true", help="also time the Triton GEMM at each TUNE_CONFIGS entry")
    ap.add_argument("--commit", default="", help="recorded in the report")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: Triton interpreter)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.prefill_t, args.mid_t, args.decode_t, args.rep_ms = [64], [], [1, 3], 5  # backends that cannot run here: refused rows
    t0 = time.time()
    target = Target.detect(dev, 64)
    peaks = add_fp8_peak(measure_peaks(dev, quick=args.smoke), dev, args.smoke)  # no FP8 matmul: % of the bf16 peak
    print(f"peaks: FP8 {peaks['fp8_tflops']:.0f} TFLOP/s, bf16 {peaks['matmul_tflops']:.0f} TFLOP/s, copy "
          f"{peaks['copy_gb_s']:.0f} GB/s", flush=True)
    result = {"machine": machine(command(argv)), "commit": args.commit, "peaks": peaks,
              "linears": linear_rows(args, dev, target, peaks), "moe": moe_rows(args, dev, peaks) if args.moe else []}
    result["seconds"] = time.time() - t0
    write(args.out, result)
    print(f"wrote {args.out}/fp8_weights_kernels.{{md,json,png}} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
