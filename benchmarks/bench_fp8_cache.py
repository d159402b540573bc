#!/usr/bin/env python
"""FP8 (e4m3) vs bf16 paged latent cache: the decode attention core on Triton and FlashInfer (issue 15).

For each dim set x batch x kv length, one random page-shuffled cache is made in bf16 and converted to
e4m3 (scales 1), and the decode core (after q_abs = q_nope·W_kn, before ·W_v) is timed on both:
Triton's absorbed kernel (+ split-K reduce) as the op launches it, and FlashInfer's
BatchMLAPagedAttentionWrapper.run where the installed version's facts accept the cache dtype for the
dims (capabilities.CACHE_FACTS; never launched outside them). Times are medians of do_bench over a
CUDA-graph replay (bench_mla_kernels.time_us). Bandwidth = cache bytes actually read (R + Dr elements
per token, 2 or 1 bytes each) / time. Each FP8 result is checked against the same kernel family on
the dequantised cache (the FP8 read must equal a bf16 read of the rounded values) and its distance to
the bf16-cache result is reported (the format's error).

`--tune` also sweeps Triton decode launch configs on the FP8 cache (block_n, warps, stages).

    python benchmarks/bench_fp8_cache.py --out /tmp/fp8          # GPU
    python benchmarks/bench_fp8_cache.py --render docs/benchmarks/fp8_cache.json --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mla_kernels import Case, _err, decode_core_triton, time_us  # noqa: E402

from autodeploy_mla.custom_ops.triton_mla import TritonPolicy  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import launchers as top  # noqa: E402

from autodeploy_mla.custom_ops import MLADims, Target, get_backend  # noqa: E402
from autodeploy_mla.custom_ops.attention.cache_format import FP8_DTYPE  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import tuning  # noqa: E402

DIMS = {
    "deepseek_tp8_n16": MLADims(16, 128, 64, 128, 512),
    "glm_4_7_flash_n20": MLADims(20, 192, 64, 256, 512),
    "mistral_small_4_n32": MLADims(32, 64, 64, 128, 256),
    "deepseek_n128": MLADims(128, 128, 64, 128, 512),
}
BATCHES = (64, 128)
KV_LENS = (4096, 8192)
PAGE = 64
HBM_TBS = 4.3


class FlashInferCore:
    """BatchMLAPagedAttentionWrapper.run on the case's cache (bf16 or e4m3 with unit scales)."""

    def __init__(self, case: Case, q_abs: torch.Tensor):
        import flashinfer

        d, b = case.dims, len(case.seqs)
        self.fp8 = case.cache.dtype == FP8_DTYPE
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=case.device), backend="auto")
        pps = case.pages_per_seq
        self.wrapper.plan(
            qo_indptr=torch.arange(b + 1, dtype=torch.int32), kv_indptr=torch.arange(b + 1, dtype=torch.int32) * pps,
            kv_indices=case.info.get("page_table_host")[:b, :pps].reshape(-1).to(case.device),
            kv_len_arr=torch.tensor([c + n for c, n in case.seqs], dtype=torch.int32), num_heads=d.num_heads,
            head_dim_ckv=d.kv_lora_rank, head_dim_kpe=d.qk_rope_head_dim, page_size=PAGE, causal=False,
            sm_scale=case.scale, q_data_type=case.dtype, kv_data_type=case.cache.dtype)
        self.q = q_abs.transpose(0, 1).contiguous()
        self.q_pe = case.x[1][0].contiguous()
        self.out = torch.empty_like(self.q)
        r = d.kv_lora_rank
        self.ckv, self.kpe = case.cache[..., :r], case.cache[..., r:]
        self.extra = {"ckv_scale": 1.0, "kpe_scale": 1.0} if self.fp8 else {}

    def run(self):
        self.wrapper.run(self.q, self.q_pe, self.ckv, self.kpe, out=self.out, **self.extra)


def triton_fp8_dot(case: Case):
    """The op's FP8_DOT decode: quantise q_abs / q_pe (amax scales on the device), then the kernel with
    e4m3 MMAs. The quantisation is inside the timed region (the op runs it every call)."""
    _, q_abs, latent, _ = decode_core_triton(case)
    d, info, b = case.dims, case.info, len(case.seqs)
    kv = max(c + n for c, n in case.seqs)
    cfg = tuning.decode_config(d, case.dtype, case.cache.dtype, "heads_on_m")  # FP8_DOT: heads-on-M kernel only
    call = top.OpCall(TritonPolicy(fp8_dot=True), warmed=set())

    def run():
        q8, qpe8, qs = top.quantize_queries(q_abs, case.x[1])
        top.launch_absorbed(
            call, q8, qpe8, case.cache, info.get("page_table"), info.get("cu_seqlen"), info.get("input_pos"),
            info.get("seq_len_with_cache"), latent, seq_base=0, n_seqs=b, tok_base=0, n_tok=b, abs_base=0,
            max_q=1, kv_bound=kv, cfg=cfg, dims=d, qk_scale=case.scale * top.LOG2E, q_scale=qs)

    return run, latent


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _fi_accepts(d: MLADims, cache_dtype: torch.dtype) -> tuple[bool, str]:
    be = get_backend("flashinfer_mla")
    t = Target.detect("cuda", PAGE)
    res = be.check(d, torch.bfloat16, t)
    if res.ok:
        res = be.check_cache(d, torch.bfloat16, cache_dtype, t)
    return res.ok, res.reason


def bench_row(name: str, d: MLADims, b: int, kv: int, rep_ms: float, tune: bool) -> dict:
    row: dict = {"dims": name, "N": d.num_heads, "R": d.kv_lora_rank, "Dr": d.qk_rope_head_dim, "batch": b,
                 "kv_len": kv}
    width = d.kv_lora_rank + d.qk_rope_head_dim
    case = Case(d, [(kv - 1, 1)] * b, torch.bfloat16, "cuda", seed=b * 7 + kv)
    deq = case.cache.to(FP8_DTYPE).to(torch.bfloat16)  # the bf16 values an e4m3 cache holds
    # the decode token every call appends: pre-rounded, so all three caches store the same value
    case.x[2], case.x[3] = (t.to(FP8_DTYPE).to(torch.bfloat16) for t in (case.x[2], case.x[3]))
    lat = {}
    for tag, cache in (("bf16", case.cache.clone()), ("fp8", case.cache.to(FP8_DTYPE)), ("deq", deq)):
        case.cache = cache
        row[f"{tag}_bytes"] = b * kv * width * cache.element_size()
        try:
            run, q_abs, latent, splits = decode_core_triton(case)
            cfg = tuning.decode_config(d, case.dtype, cache.dtype)
            row[f"triton_{tag}_layout"] = "heads_on_n" if cfg.heads_on_n else "heads_on_m"
            if tag != "deq":
                row[f"triton_{tag}_us"], _ = time_us(run, graph=True, rep_ms=rep_ms)
                row[f"triton_{tag}_splits"] = splits
            run()
            lat[f"triton_{tag}"] = latent.clone()
            if tune and tag == "fp8":
                row["tune"] = tune_triton(case, rep_ms)
            if tag == "fp8":
                run8, latent8 = triton_fp8_dot(case)
                row["triton_fp8dot_us"], _ = time_us(run8, graph=True, rep_ms=rep_ms)
                run8()
                lat["triton_fp8dot"] = latent8.clone()
        except Exception as e:
            row[f"triton_{tag}_err"] = _err(e)
            traceback.print_exc()
        ok, why = _fi_accepts(d, cache.dtype if tag != "deq" else torch.bfloat16)
        if not ok:
            row[f"fi_{tag}_skip"] = why
            continue
        try:
            fi = FlashInferCore(case, q_abs)
            if tag != "deq":
                row[f"fi_{tag}_us"], _ = time_us(fi.run, graph=True, rep_ms=rep_ms)
            fi.run()
            torch.cuda.synchronize()
            lat[f"fi_{tag}"] = fi.out.transpose(0, 1).clone()
        except Exception as e:
            row[f"fi_{tag}_err"] = _err(e)
            traceback.print_exc()
    if row.get("triton_fp8dot_us"):
        row["triton_fp8dot_tbs"] = row["fp8_bytes"] / (row["triton_fp8dot_us"] * 1e-6) / 1e12
        if row.get("triton_bf16_us"):
            row["triton_fp8dot_speedup"] = row["triton_bf16_us"] / row["triton_fp8dot_us"]
        if "triton_deq" in lat:
            row["triton_fp8dot_vs_deq"] = _rel(lat["triton_fp8dot"], lat["triton_deq"])
        if "triton_bf16" in lat:
            row["triton_fp8dot_vs_bf16"] = _rel(lat["triton_fp8dot"], lat["triton_bf16"])
    for k in ("triton", "fi"):
        for tag in ("bf16", "fp8"):
            t = row.get(f"{k}_{tag}_us")
            if t:
                row[f"{k}_{tag}_tbs"] = row[f"{tag}_bytes"] / (t * 1e-6) / 1e12
        if row.get(f"{k}_bf16_us") and row.get(f"{k}_fp8_us"):
            row[f"{k}_speedup"] = row[f"{k}_bf16_us"] / row[f"{k}_fp8_us"]
        if f"{k}_fp8" in lat and f"{k}_deq" in lat:
            row[f"{k}_fp8_vs_deq"] = _rel(lat[f"{k}_fp8"], lat[f"{k}_deq"])  # kernel check: ~bf16 rounding
        if f"{k}_fp8" in lat and f"{k}_bf16" in lat:
            row[f"{k}_fp8_vs_bf16"] = _rel(lat[f"{k}_fp8"], lat[f"{k}_bf16"])  # the format's error
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "tune"}),
          flush=True)
    return row


def tune_triton(case: Case, rep_ms: float) -> list[dict]:
    base = tuning.decode_config(case.dims, case.dtype, case.cache.dtype)
    out = []
    for bn in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                cfg = tuning.AbsorbedConfig(base.block_h, 1, bn, warps, stages, heads_on_n=base.heads_on_n)
                try:
                    run, *_ = decode_core_triton(case, cfg)
                    us, _ = time_us(run, graph=True, rep_ms=rep_ms / 2)
                    out.append({"block_n": bn, "warps": warps, "stages": stages, "us": us})
                except Exception as e:
                    out.append({"block_n": bn, "warps": warps, "stages": stages, "err": _err(e)})
    return sorted(out, key=lambda r: r.get("us", 1e30))


# ----------------------------------------------------------------------------- report
def render(data: dict, out: Path) -> None:
    rows = data["rows"]
    lines = [
        "# FP8 (e4m3) vs bf16 latent cache: decode attention core", "",
        f"Machine: {data['device']}, torch {data['torch']}, triton {data['triton']}, flashinfer {data['flashinfer']}. "
        f"{data['date']}.", "",
        f"Command: `{data['command']}`", "",
        "Median of a CUDA-graph replay per call (L2 flushed). TB/s = cache bytes read / time (e4m3: half the bytes "
        f"of bf16); HBM {HBM_TBS} TB/s. Speed-up = bf16 time / fp8 time. `fp8 vs deq` = the FP8 kernel against the "
        "same kernel on a bf16 cache holding the rounded values (checks the kernel); `fp8 vs bf16` = the format's "
        "error on the attended latent.", "",
        "Target (issue 15): N <= 32, batch x kv >= 64 x 4096: FP8 >= 1.7x faster than bf16 on Triton and on FlashInfer.",
        "",
        "Triton bf16 / fp8 = the op's default decode kernel for that cache (`tuning.decode_config`, named per row "
        "below): on e4m3 up to 32 heads the heads-on-N kernel with fp16 MMAs (e4m3 -> fp16 is one hardware "
        "conversion), above 32 heads the heads-on-M kernel with tiles converted to bf16; exact queries either way. "
        "Triton fp8-dot = "
        "TritonPolicy(fp8_dot=True): queries (per-call amax scale) and probabilities in e4m3 too, e4m3 MMAs, "
        "quantisation included in the time.",
        "",
        "| dims | B | kv | Triton bf16 us (TB/s) | Triton fp8 us (TB/s) | speed-up | Triton fp8-dot us (TB/s) | speed-up | "
        "FlashInfer bf16 us (TB/s) | FlashInfer fp8 us (TB/s) | speed-up | fp8 vs deq (tri/dot/fi) | "
        "fp8 vs bf16 (tri/dot/fi) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]

    def cell(r, k, tag):
        us = r.get(f"{k}_{tag}_us")
        if us is None:
            return "n/a" if f"{k}_{tag}_skip" in r else ("err" if f"{k}_{tag}_err" in r else "-")
        return f"{us:.1f} ({r.get(f'{k}_{tag}_tbs', 0):.2f})"

    def num(r, k, fmt):
        v = r.get(k)
        return "-" if v is None else format(v, fmt)

    for r in rows:
        lines.append(
            f"| {r['dims']} | {r['batch']} | {r['kv_len']} | {cell(r, 'triton', 'bf16')} | {cell(r, 'triton', 'fp8')} | "
            f"**{num(r, 'triton_speedup', '.2f')}** | {cell(r, 'triton', 'fp8dot')} | "
            f"**{num(r, 'triton_fp8dot_speedup', '.2f')}** | {cell(r, 'fi', 'bf16')} | {cell(r, 'fi', 'fp8')} | "
            f"**{num(r, 'fi_speedup', '.2f')}** | {num(r, 'triton_fp8_vs_deq', '.1e')} / "
            f"{num(r, 'triton_fp8dot_vs_deq', '.1e')} / {num(r, 'fi_fp8_vs_deq', '.1e')} | "
            f"{num(r, 'triton_fp8_vs_bf16', '.3f')} / {num(r, 'triton_fp8dot_vs_bf16', '.3f')} / "
            f"{num(r, 'fi_fp8_vs_bf16', '.3f')} |")
    layouts = sorted({f"{r['dims']}: bf16 {r.get('triton_bf16_layout', '?')}, fp8 {r.get('triton_fp8_layout', '?')}"
                      for r in rows})
    lines += ["", "Triton decode kernel per dims: " + "; ".join(layouts)]
    skips = sorted({r[k] for r in rows for k in r if k.startswith("fi_fp8_skip")})
    if skips:
        lines += ["", "FlashInfer FP8 not launched: " + "; ".join(skips)]
    tuned = [r for r in rows if r.get("tune")]
    if tuned:
        lines += ["", "## Triton decode configs on the FP8 cache (best three per case)", "",
                  "| dims | B | kv | block_n/warps/stages: us |", "|---|---:|---:|---|"]
        for r in tuned:
            best = ", ".join(f"{t['block_n']}/{t['warps']}/{t['stages']}: {t['us']:.1f}" for t in r["tune"][:3]
                             if "us" in t)
            lines.append(f"| {r['dims']} | {r['batch']} | {r['kv_len']} | {best} |")
    if data.get("notes"):
        lines += ["", data["notes"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_cache.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{r['dims'].split('_')[0]} N{r['N']}\nB{r['batch']} kv{r['kv_len'] // 1024}k" for r in rows]
        xs = range(len(rows))
        series = (("triton_speedup", "Triton (convert tiles)"), ("triton_fp8dot_speedup", "Triton (e4m3 MMAs)"),
                  ("fi_speedup", "FlashInfer"))
        for i, (k, name) in enumerate(series):
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r.get(k) or 0 for r in rows], 0.27, label=name)
        ax.axhline(1.7, color="k", ls="--", lw=1, label="target 1.7x")
        ax.axhline(2.0, color="gray", ls=":", lw=1, label="bytes ratio 2x")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("bf16 time / fp8 time")
        ax.set_title("Decode core: e4m3 vs bf16 latent cache (H200)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "fp8_cache.png", dpi=110)
    except ImportError:
        pass
    (out / "fp8_cache.json").write_text(json.dumps(data, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--render", type=Path, help="re-render an existing fp8_cache.json into --out")
    ap.add_argument("--dims", default=",".join(DIMS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--kv", default=",".join(map(str, KV_LENS)))
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--notes", default="")
    args = ap.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        if args.notes:
            data["notes"] = args.notes
        render(data, args.out)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_cache.py times GPU kernels: no CUDA device")
    from autodeploy_mla.custom_ops.attention.registry import library_versions

    v = library_versions()
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": v.get("triton"),
            "flashinfer": v.get("flashinfer"), "date": datetime.date.today().isoformat(), "host": platform.node(),
            "command": "python benchmarks/bench_fp8_cache.py " + " ".join(sys.argv[1:]), "notes": args.notes,
            "rows": []}
    for name in args.dims.split(","):
        for b in map(int, args.batches.split(",")):
            for kv in map(int, args.kv.split(",")):
                data["rows"].append(bench_row(name, DIMS[name], b, kv, args.rep_ms, args.tune))
                torch.cuda.empty_cache()
    render(data, args.out)


if __name__ == "__main__":
    main()
