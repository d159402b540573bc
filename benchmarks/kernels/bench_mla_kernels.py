#!/usr/bin/env python
"""MLA kernel benchmark: the Triton backend vs FlashInfer's MLA wrapper vs the torch reference.

Decode (batch {1, 8, 32, 128} x kv_len {512, 2048, 8192}) for five dim sets, timed two ways:
  - attention core: the kernels after q_abs = q_nope·W_kn and before ·W_v (triton: absorbed kernel
    [+ split-K reduce]; FlashInfer: BatchMLAPagedAttentionWrapper.run(), plan timed separately);
  - full cached op: append + q_abs GEMM + attention + W_v GEMM (triton: the registered op;
    FlashInfer: the same GEMMs around run(); torch: the reference op, eager, skipped when huge).
GPU times are medians of triton.testing.do_bench (L2 flushed before each run) over a CUDA-graph
replay of the region (so host launch overhead is excluded, as in a captured decode step); the
full triton op is also timed eagerly. Prefill: one sequence of T {128, 512, 2048} new tokens with
and without a cached prefix, triton auto / forced expand / forced absorb vs the torch reference.

Writes <out>/mla_kernels.{md,json,png}. `--tune` instead sweeps launch configs and split policy and
writes <out>/mla_tune.json. `--smoke` runs a tiny case on whatever device exists (CPU: Triton
interpreter) to check the script itself. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

if __name__ == "__main__" and "--smoke" in sys.argv and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.lib import (  # noqa: E402
    BF16_TFLOPS,
    COPY_TBS,
    Case,
    DIMS,
    FLUSH_MODES,
    MLADims,
    PAGE,
    TritonPolicy,
    bench_decode,
    command,
    decode_core_triton,
    error_line,
    machine,
    time_us,
    triton_launch_config,
)
from benchmarks.lib import triton_tuning as tuning  # noqa: E402


BATCHES = (1, 8, 32, 128)
KV_LENS = (512, 2048, 8192)
PREFILL_T = (128, 512, 2048)
PREFILL_PREFIX = (0, 4096)
TORCH_PREFILL_MAX_SCORE_BYTES = 2 << 30  # reference materialises [N, T, kv] fp32 scores


def bench_prefill(dims_name: str, d: MLADims, T: int, prefix: int, dtype, dev, rep_ms: float) -> dict:
    row: dict = {"kind": "prefill", "dims": dims_name, "N": d.num_heads, "R": d.kv_lora_rank,
                 "Dr": d.qk_rope_head_dim, "Dn": d.qk_nope_head_dim, "Dv": d.v_head_dim, "T": T, "prefix": prefix}
    case = Case(d, [(prefix, T)], dtype, dev, seed=T + prefix, page=PAGE)
    pairs = T * prefix + T * (T + 1) // 2
    N, r, dn, dv, dr = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.v_head_dim, d.qk_rope_head_dim
    row["flops_expand"] = 2.0 * pairs * N * (dn + dr + dv) + 2.0 * (prefix + T) * N * r * (dn + dv)
    row["flops_absorb"] = 2.0 * pairs * N * (2 * r + dr) + 2.0 * T * N * r * (dn + dv)
    row["rule"] = tuning.choose_prefill_path(d, T, prefix, pairs)
    for mode in ("auto", "expand", "absorb"):
        try:
            with case.op("triton", TritonPolicy(prefill_mode=mode)) as op:
                row[f"triton_{mode}_us"], _ = time_us(op, graph=False, rep_ms=rep_ms)
        except Exception as e:
            row[f"triton_{mode}_err"] = error_line(e)
            traceback.print_exc()
    if N * T * (T + prefix) * 4 <= TORCH_PREFILL_MAX_SCORE_BYTES:
        try:
            with case.op("torch") as op:
                row["torch_op_us"], _ = time_us(op, graph=False, rep_ms=rep_ms)
        except Exception as e:
            row["torch_err"] = error_line(e)
    else:
        row["torch_skip"] = "fp32 score matrix over 2 GiB"
    t = row.get("triton_auto_us")
    if t:
        fl = row["flops_" + row["rule"]]
        row["triton_auto_tflops"] = fl / (t * 1e-6) / 1e12
    e, a = row.get("triton_expand_us"), row.get("triton_absorb_us")
    if e and a:
        row["rule_picked_faster"] = (row["rule"] == "expand") == (e <= a)
    del case
    return row


# ----------------------------------------------------------------------------- tuning
# (BLOCK_H, BLOCK_N, warps, stages): all compile for sm_90 without spills (ptxas, checked offline).
DECODE_CANDIDATES_R512 = [(16, 32, 4, 2), (16, 32, 8, 2), (16, 64, 8, 3), (32, 32, 8, 2), (32, 64, 8, 3),
                          (64, 16, 8, 2), (64, 32, 8, 3)]
DECODE_CANDIDATES_R256 = [(16, 32, 4, 2), (16, 64, 8, 2), (32, 32, 4, 2), (32, 64, 8, 2), (32, 32, 8, 3),
                          (64, 32, 8, 2), (64, 64, 8, 2)]
# (BLOCK_M, BLOCK_N, warps, stages)
EXPAND_CANDIDATES = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)]
TUNE_DECODE_SHAPES = ((8, 2048), (128, 4096))
TUNE_SPLIT_SHAPES = ((1, 8192), (8, 2048))
TUNE_PREFILL = (2048, (4096, 128))  # T of the expand sweep; (prefix, T) of the absorb sweep


def tune(dtype, dev, rep_ms: float, dims_names) -> dict:
    out: dict = {"decode": [], "splits": [], "expand": [], "absorb_prefill": []}
    for name in dims_names:
        d = DIMS[name]
        cands = DECODE_CANDIDATES_R512 if d.kv_lora_rank > 256 else DECODE_CANDIDATES_R256
        cands = [c for c in cands if c[0] <= max(16, 1 << (d.num_heads - 1).bit_length())]
        for B, kv in TUNE_DECODE_SHAPES:
            case = Case(d, [(kv - 1, 1)] * B, dtype, dev, seed=1, page=PAGE)
            for bh, bn, w, st in cands:
                cfg = tuning.AbsorbedConfig(bh, 1, bn, w, st)
                try:
                    run, *_ = decode_core_triton(case, cfg)
                    t, _ = time_us(run, graph=True, rep_ms=rep_ms)
                except Exception as e:
                    t = None
                    print("tune decode", name, cfg, error_line(e))
                out["decode"].append({"dims": name, "batch": B, "kv_len": kv, "cfg": [bh, bn, w, st], "us": t})
                print(f"tune decode {name:22s} B={B:3d} kv={kv:5d} cfg={cfg} -> {t}", flush=True)
            del case
        if name in ("deepseek_v3_tp8_n16", "mistral_small_4_n32", "smoke_n5"):
            for B, kv in TUNE_SPLIT_SHAPES:
                case = Case(d, [(kv - 1, 1)] * B, dtype, dev, seed=2, page=PAGE)
                for s in (1, 2, 4, 8, 16, 32, 64):
                    try:
                        run, *_ = decode_core_triton(case, None, s)
                        t, _ = time_us(run, graph=True, rep_ms=rep_ms)
                    except Exception as e:
                        t = None
                        print("tune splits", error_line(e))
                    auto = decode_core_triton(case)[3]
                    out["splits"].append({"dims": name, "batch": B, "kv_len": kv, "splits": s, "us": t, "auto": auto})
                    print(f"tune splits {name:22s} B={B:3d} kv={kv:5d} splits={s:3d} (auto {auto}) -> {t}", flush=True)
                del case
        case = Case(d, [(0, TUNE_PREFILL[0])], dtype, dev, seed=3, page=PAGE)
        for bm, bn, w, st in EXPAND_CANDIDATES:
            try:
                with (triton_launch_config("expand_config", tuning.ExpandConfig(bm, bn, w, st)),
                      case.op("triton", TritonPolicy(prefill_mode="expand")) as op):
                    t, _ = time_us(op, graph=False, rep_ms=rep_ms)
            except Exception as e:
                t = None
                print("tune expand", error_line(e))
            out["expand"].append({"dims": name, "T": TUNE_PREFILL[0], "cfg": [bm, bn, w, st], "us": t})
            print(f"tune expand {name:22s} cfg={(bm, bn, w, st)} -> {t}", flush=True)
        del case
        case = Case(d, [TUNE_PREFILL[1]], dtype, dev, seed=4, page=PAGE)
        bh = min(64, max(16, 1 << (d.num_heads - 1).bit_length()))
        for rows, bn in ((32, 32), (64, 16), (64, 32)):
            if rows < bh:
                continue
            cfg = tuning.AbsorbedConfig(bh, rows // bh, bn, 8, 2)
            try:
                with (triton_launch_config("absorb_prefill_config", cfg),
                      case.op("triton", TritonPolicy(prefill_mode="absorb")) as op):
                    t, _ = time_us(op, graph=False, rep_ms=rep_ms)
            except Exception as e:
                t = None
                print("tune absorb", error_line(e))
            out["absorb_prefill"].append({"dims": name, "prefix_T": list(TUNE_PREFILL[1]), "cfg": [bh, rows // bh, bn],
                                          "us": t})
            print(f"tune absorb-prefill {name:22s} cfg={cfg} -> {t}", flush=True)
        del case
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


# ----------------------------------------------------------------------------- report
def _f(x, nd=1):
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_report(res: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mla_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    m = res["machine"]
    L = [
        "# MLA kernel benchmark (Triton backend vs FlashInfer vs torch reference)",
        "",
        f"Machine: {m['gpu']}, torch {m['torch']}, triton {m['triton']}, flashinfer {m['flashinfer']}, "
        f"{m['date']}. Command: `{m['command']}`.",
        "",
        f"bf16, page size {PAGE}, random data over shuffled pages. Times are medians (µs) of "
        + ("`triton.testing.do_bench` (L2 flushed before each run by zeroing 256 MB: dirty lines the timed "
           "kernel's first reads write back) " if res.get("flush", "zero") == "zero" else
           "a `do_bench`-like loop whose L2 flush reads 256 MB (`--flush read`: cold, clean L2) ")
        + "over a CUDA-graph replay of the region, "
        "except *eager* columns and prefill (one eager call, as prefill runs between graph pieces). "
        f"Ceilings: {COPY_TBS} TB/s copy, {BF16_TFLOPS:.0f} TFLOP/s bf16 (measured, DESIGN §12). "
        "Bytes = cached latent+rope read once (B·kv·(R+Dr)·2); FLOPs = 2·B·N·kv·(2R+Dr).",
        "",
        "## Decode",
        "",
        "core = attention kernels only (q_abs given, latent out); op = whole cached op "
        "(append + q_abs GEMM + attention + W_v GEMM). FlashInfer: `BatchMLAPagedAttentionWrapper` "
        "run() (plan excluded, shown as plan ms); its op column wraps run() in the same GEMMs/append.",
        "",
        "heads on M / heads on N = the decode core on each kernel (absorbed_attn_kernel / "
        "absorbed_attn_heads_on_n_kernel, `tl` kernels); *layout* = what the op runs (its time is the core "
        "column): `decode_config`'s pick, or *gluon* = the warp-specialised Gluon kernels "
        "(`triton_mla/gluon_decode.py`, heads on N, N <= 32; `gluon_decode_wide.py`, 64 heads per program on M, "
        "N > 32), which `TritonPolicy.decode_kernel=\"auto\"` runs on SM90 for R 256/512 (N > 32: R 512), Dr 64.",
        "",
        "| dims | B | kv | layout | splits | triton core µs | TB/s | %4.3 | TFLOP/s | heads on M µs | heads on N µs "
        "| FI core µs | triton/FI | FI plan ms | triton op µs | triton op eager µs | FI op µs | torch op µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["decode"]:
        tc, fc = r.get("triton_core_us"), r.get("fi_core_us")
        ratio = tc / fc if tc and fc else None
        tbs = r.get("triton_core_tbs")
        L.append(
            f"| {r['dims']} | {r['batch']} | {r['kv_len']} | {r.get('triton_layout', 'heads_on_m')} | "
            f"{_f(r.get('triton_splits'))} | {_f(tc)} | {_f(tbs, 2)} | "
            f"{_f(tbs / COPY_TBS * 100 if tbs else None, 0)} | {_f(r.get('triton_core_tflops'), 0)} | "
            f"{_f(r.get('triton_m_core_us'))} | {_f(r.get('triton_n_core_us'))} | "
            f"{_f(fc) if fc else ('n/a' if 'fi_skip' in r else ('err' if 'fi_err' in r else '—'))} | {_f(ratio, 2)} | "
            f"{_f(r.get('fi_plan_ms'), 2)} | {_f(r.get('triton_op_us'))} | {_f(r.get('triton_op_eager_us'))} | "
            f"{_f(r.get('fi_op_us'))} | {_f(r.get('torch_op_us')) if 'torch_skip' not in r else 'skipped'} |"
        )
    skips = sorted({f"{r['dims']}: {r['fi_skip']}" for r in res["decode"] if r.get("fi_skip")})
    L += ["", "n/a: FlashInfer not launched where the installed version's capability facts refuse the dims"
          + (" (" + "; ".join(skips) + ")" if skips else "") + ". skipped: torch reference over B·kv > 262144 "
          "tokens (several GB of fp32 gathers).", ""]
    L += ["## Prefill (one sequence, T new tokens on a cached prefix)", "",
          "| dims | T | prefix | rule | triton auto µs | expand µs | absorb µs | rule picked faster | TFLOP/s (auto) "
          "| torch op µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["prefill"]:
        L.append(
            f"| {r['dims']} | {r['T']} | {r['prefix']} | {r['rule']} | {_f(r.get('triton_auto_us'))} | "
            f"{_f(r.get('triton_expand_us'))} | {_f(r.get('triton_absorb_us'))} | {_f(r.get('rule_picked_faster'))} | "
            f"{_f(r.get('triton_auto_tflops'), 0)} | "
            f"{_f(r.get('torch_op_us')) if 'torch_skip' not in r else 'skipped'} |"
        )
    if res.get("prefill_note"):
        L += ["", res["prefill_note"]]
    if res.get("tune"):
        L += tune_section(res)
    errs = [(r["dims"], k, v) for r in res["decode"] + res["prefill"] for k, v in r.items() if k.endswith("_err")]
    if errs:
        L += ["", "## Errors", ""] + [f"- {a} {k}: {v}" for a, k, v in errs]
    if res.get("targets"):
        L += ["", "## Targets", ""] + [f"- {t}" for t in res["targets"]]
    with open(os.path.join(out_dir, "mla_kernels.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    try:
        plot(res, os.path.join(out_dir, "mla_kernels.png"))
    except Exception as e:
        print("plot failed:", error_line(e))


def tune_section(res: dict) -> list[str]:
    """The launch-config / split sweep (`--tune`): per dim set, every candidate's decode-core time."""
    t = res["tune"]
    L = ["", "## Launch-config and split-K sweep (`--tune`)", ""]
    if res.get("tune_note"):
        L += [res["tune_note"], ""]
    L += ["Decode core µs (CUDA graph, median) per (BLOCK_H, BLOCK_N, warps, stages); **bold** = the op's "
          "current default (`decode_config`).", ""]
    shapes = sorted({(r["batch"], r["kv_len"]) for r in t["decode"]})
    L += ["| dims | config | " + " | ".join(f"B={b} kv={k} µs (TB/s)" for b, k in shapes) + " |",
          "|---|---|" + "---|" * len(shapes)]
    for name in dict.fromkeys(r["dims"] for r in t["decode"]):
        d = DIMS.get(name)
        cur = tuning.decode_config(d, torch.bfloat16) if d else None
        cfgs = list(dict.fromkeys(tuple(r["cfg"]) for r in t["decode"] if r["dims"] == name))
        for c in cfgs:
            cells = []
            for b, k in shapes:
                r = next((r for r in t["decode"] if r["dims"] == name and tuple(r["cfg"]) == c
                          and (r["batch"], r["kv_len"]) == (b, k)), None)
                us = r and r["us"]
                tbs = us and b * k * (d.kv_lora_rank + d.qk_rope_head_dim) * 2 / (us * 1e-6) / 1e12 if d else None
                cells.append(f"{_f(us)} ({_f(tbs, 2)})" if us else "—")
            is_cur = cur is not None and (cur.block_h, cur.block_n, cur.num_warps, cur.num_stages) == c
            lab = f"**{c}**" if is_cur else str(c)
            L.append(f"| {name} | {lab} | " + " | ".join(cells) + " |")
    if t.get("splits"):
        L += ["", "Split-K count (decode core µs; forced splits, chunk = kv/splits rounded to BLOCK_N):", "",
              "| dims | B | kv | " + " | ".join(str(s) for s in sorted({r["splits"] for r in t["splits"]})) + " |",
              "|---|---|---|" + "---|" * len({r["splits"] for r in t["splits"]})]
        for key in dict.fromkeys((r["dims"], r["batch"], r["kv_len"]) for r in t["splits"]):
            rows = sorted((r for r in t["splits"] if (r["dims"], r["batch"], r["kv_len"]) == key),
                          key=lambda r: r["splits"])
            L.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(_f(r["us"]) for r in rows) + " |")
    if t.get("expand"):
        L += ["", "Expanded prefill kernel, T=2048 fresh prefill, whole op µs per (BLOCK_M, BLOCK_N, warps, "
              "stages):", "", "| dims | " + " | ".join(str(tuple(r["cfg"])) for r in t["expand"][:4]) + " |",
              "|---|" + "---|" * 4]
        for name in dict.fromkeys(r["dims"] for r in t["expand"]):
            L.append(f"| {name} | " + " | ".join(_f(r["us"]) for r in t["expand"] if r["dims"] == name) + " |")
    if t.get("absorb_prefill"):
        L += ["", "Absorbed prefill (T=128 on a 4096 prefix), whole op µs per (BLOCK_H, BLOCK_Q, BLOCK_N):", ""]
        for name in dict.fromkeys(r["dims"] for r in t["absorb_prefill"]):
            L.append(f"- {name}: " + ", ".join(f"{tuple(r['cfg'])}: {_f(r['us'])}" for r in t["absorb_prefill"]
                                                if r["dims"] == name))
    return L


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["dims"] for r in res["decode"]))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    ax = axes[0]
    for i, name in enumerate(names):
        rows = sorted((r for r in res["decode"] if r["dims"] == name and r.get("triton_core_tbs")),
                      key=lambda r: (r["batch"] * r["kv_len"], r["batch"]))
        xs = [r["batch"] * r["kv_len"] for r in rows]
        ax.plot(xs, [r["triton_core_tbs"] for r in rows], "o-", color=f"C{i}", label=f"triton {name}")
        fr = [r for r in rows if r.get("fi_core_tbs")]
        if fr:
            ax.plot([r["batch"] * r["kv_len"] for r in fr], [r["fi_core_tbs"] for r in fr], "x--", color=f"C{i}",
                    label=f"FlashInfer {name}")
    ax.axhline(COPY_TBS, color="k", lw=0.8, ls=":", label="4.3 TB/s copy")
    ax.axhline(0.75 * COPY_TBS, color="gray", lw=0.8, ls=":", label="75%")
    ax.set_xscale("log")
    ax.set_xlabel("batch × kv_len (cached tokens read)")
    ax.set_ylabel("achieved TB/s (decode core)")
    ax.set_title("Decode attention core: bandwidth")
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, name in enumerate(names):
        rows = sorted((r for r in res["decode"] if r["dims"] == name and r.get("triton_op_us")),
                      key=lambda r: (r["batch"] * r["kv_len"], r["batch"]))
        ax.plot([r["batch"] * r["kv_len"] for r in rows], [r["triton_op_us"] for r in rows], "o-", color=f"C{i}",
                label=f"triton op {name}")
        tr = [r for r in rows if r.get("torch_op_us")]
        ax.plot([r["batch"] * r["kv_len"] for r in tr], [r["torch_op_us"] for r in tr], "s:", color=f"C{i}", alpha=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch × kv_len")
    ax.set_ylabel("µs (full decode op; dotted squares: torch reference)")
    ax.set_title("Full cached decode op (CUDA graph)")
    ax.legend(fontsize=7)
    ax = axes[2]
    pre = res["prefill"]
    labels = [f"{r['dims'].split('_n')[0][:10]}\nT{r['T']} P{r['prefix']}" for r in pre]
    xs = range(len(pre))
    ax.bar([x - 0.2 for x in xs], [r.get("triton_expand_us") or 0 for r in pre], 0.4, label="expand")
    ax.bar([x + 0.2 for x in xs], [r.get("triton_absorb_us") or 0 for r in pre], 0.4, label="absorb")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("µs")
    ax.set_title("Prefill: expansion vs absorption (forced)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def targets(res: dict) -> list[str]:
    """Issue 14's decode targets, from this run's rows (FlashInfer from the same run)."""
    out = []
    dec = [r for r in res["decode"] if r.get("triton_core_us")]
    n128 = [r for r in dec if r["N"] == 128 and r.get("fi_core_us")]
    for lo, hi, lim in ((32, 1 << 30, 1.0), (1, 8, 1.2)):
        rows = [r for r in n128 if lo <= r["batch"] <= hi]
        if rows:
            met = sum(r["triton_core_us"] <= lim * r["fi_core_us"] for r in rows)
            worst = max(rows, key=lambda r: r["triton_core_us"] / r["fi_core_us"])
            out.append(f"N=128, batch {lo}-{hi if hi < 1 << 30 else 'up'}: core <= {lim}x FlashInfer in {met}/{len(rows)}; "
                       f"worst B={worst['batch']} kv={worst['kv_len']}: {worst['triton_core_us'] / worst['fi_core_us']:.2f}x")
    big = next((r for r in n128 if r["batch"] == 128 and r["kv_len"] == 8192), None)
    if big:
        out.append(f"N=128 B=128 kv=8192: {big['triton_core_tflops']:.0f} TFLOP/s (target >= 450)")
    mb = [r for r in dec if r["N"] <= 32 and r["batch"] * r["kv_len"] >= 64 * 4096 and r.get("triton_core_tbs")]
    if mb:
        met = sum(r["triton_core_tbs"] >= 0.85 * COPY_TBS for r in mb)
        lo = min(mb, key=lambda r: r["triton_core_tbs"])
        out.append(f">= 85% of {COPY_TBS} TB/s where memory-bound (N<=32, B*kv>=64*4096): {met}/{len(mb)}; lowest "
                   f"{lo['dims']} B={lo['batch']} kv={lo['kv_len']}: {lo['triton_core_tbs']:.2f} TB/s")
        fi = [r for r in mb if r.get("fi_core_us")]
        if fi:
            met = sum(r["triton_core_us"] <= r["fi_core_us"] for r in fi)
            worst = max(fi, key=lambda r: r["triton_core_us"] / r["fi_core_us"])
            out.append(f"memory-bound rows <= 1.0x FlashInfer: {met}/{len(fi)}; worst {worst['dims']} B={worst['batch']} "
                       f"kv={worst['kv_len']}: {worst['triton_core_us'] / worst['fi_core_us']:.2f}x")
    return out


def main(argv=None) -> int:
    global DIMS, PAGE, TUNE_DECODE_SHAPES, TUNE_SPLIT_SHAPES, TUNE_PREFILL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--dims", nargs="*", default=list(DIMS))
    ap.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    ap.add_argument("--kv", nargs="*", type=int, default=list(KV_LENS))
    ap.add_argument("--prefill-t", nargs="*", type=int, default=list(PREFILL_T))
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--tune", action="store_true", help="sweep launch configs / split policy instead")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (CPU: Triton interpreter)")
    ap.add_argument("--report-from", metavar="JSON", help="rewrite md/png from a results JSON (no GPU needed)")
    ap.add_argument("--tune-json", metavar="JSON", help="with --report-from: add this --tune output")
    ap.add_argument("--note", default="", help="with --report-from: a note for the sweep section")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="zero",
                    help="how L2 is emptied before each timed decode run (FLUSH_MODES; prefill: always zero)")
    a = ap.parse_args(argv)
    if a.report_from:
        with open(a.report_from) as f:
            res = json.load(f)
        if a.tune_json:
            with open(a.tune_json) as f:
                tj = json.load(f)
            res["tune"], res["tune_machine"] = tj["tune"], tj["machine"]
        if a.note:
            res["tune_note"] = a.note
        res["targets"] = targets(res)
        write_report(res, a.out)
        print("\n".join(res["targets"]))
        return 0
    cmd = command(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    if a.smoke:
        TUNE_DECODE_SHAPES, TUNE_SPLIT_SHAPES, TUNE_PREFILL = ((2, 40),), ((1, 40),), (24, (16, 8))
        DIMS = {"smoke_n5": MLADims(5, 16, 8, 24, 32), "smoke_n20_r64": MLADims(20, 16, 16, 16, 64)}
        a.dims, a.batches, a.kv, a.prefill_t, a.rep_ms = list(DIMS), [1, 3], [40], [24], 5
        PAGE = 16
        if dev == "cpu":
            dtype = torch.float32
    if a.tune:
        t0 = time.time()
        res = {"machine": machine(cmd), "tune": tune(dtype, dev, min(a.rep_ms, 20), a.dims)}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "mla_tune.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(f"tuning done in {time.time() - t0:.0f}s")
        return 0
    with_fi = not a.no_flashinfer and dev == "cuda"
    if with_fi:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            print("FlashInfer unavailable:", error_line(e))
            with_fi = False
    res: dict = {"machine": machine(cmd), "decode": [], "prefill": [], "flush": a.flush}
    t0 = time.time()
    for name in a.dims:
        d = DIMS[name]
        for B in a.batches:
            for kv in a.kv:
                r = bench_decode(name, d, B, kv, dtype, dev, a.rep_ms, with_fi, a.flush, PAGE)
                res["decode"].append(r)
                print(f"[{time.time() - t0:5.0f}s] decode {name:22s} B={B:3d} kv={kv:5d} "
                      f"triton core {_f(r.get('triton_core_us'))} µs ({_f(r.get('triton_core_tbs'), 2)} TB/s, "
                      f"splits {r.get('triton_splits')}) FI {_f(r.get('fi_core_us'))} | op graph "
                      f"{_f(r.get('triton_op_us'))} eager {_f(r.get('triton_op_eager_us'))} FI op {_f(r.get('fi_op_us'))} "
                      f"torch {_f(r.get('torch_op_us'))}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not a.no_prefill:
        for name in a.dims:
            for T in a.prefill_t:
                for prefix in (PREFILL_PREFIX if not a.smoke else (0, 16)):
                    r = bench_prefill(name, DIMS[name], T, prefix, dtype, dev, a.rep_ms)
                    res["prefill"].append(r)
                    print(f"[{time.time() - t0:5.0f}s] prefill {name:22s} T={T:5d} P={prefix:5d} rule={r['rule']:6s} "
                          f"auto {_f(r.get('triton_auto_us'))} expand {_f(r.get('triton_expand_us'))} absorb "
                          f"{_f(r.get('triton_absorb_us'))} torch {_f(r.get('torch_op_us'))}", flush=True)
    res["targets"] = targets(res)
    res["seconds"] = time.time() - t0
    write_report(res, a.out)
    print("\n".join(res["targets"]))
    print(f"done in {res['seconds']:.0f}s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
