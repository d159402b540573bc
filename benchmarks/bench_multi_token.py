"""Multi-token decode (speculative-decoding verification) on the Triton kernels: which kernel layout.

A verification step gives every sequence q new tokens (draft tokens + 1) on its cached history,
causal among them. The op serves them on its absorbed path; this benchmark times the attention core
of that path (q_abs given, latent out: the absorbed kernel + split merge) for each candidate config:

- rows: `absorb_prefill_config` (absorbed_attn_kernel, 64 rows of query tokens x heads; the default);
- cols: `multi_token_config(decode_config(..., "heads_on_n"), q)` (the heads-on-N decode kernel with
  BLOCK_Q query columns, TMA tiles), with its decode warps and with 8 warps.

Each variant's output is compared with the rows variant (which the CPU and GPU suites check against
the float64 oracle). Times: median µs of CUDA-graph replays (triton.testing.do_bench), bf16, page 64,
random page-shuffled cache. Bytes = the histories read once, B·kv·(R+Dr)·2.

    python benchmarks/bench_multi_token.py --out $OUT/multi_token

Writes multi_token.{json,md,png} into --out and prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mla_kernels import Case, time_us  # noqa: E402

from autodeploy_mla.custom_ops.attention.mla_dims import MLADims  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import TritonPolicy  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import launchers as top  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import tuning  # noqa: E402

DIMS = {
    "deepseek_v3_tp8_n16": MLADims(16, 128, 64, 128, 512),
    "glm_4_7_flash_n20": MLADims(20, 192, 64, 256, 512),
    "mistral_small_4_n32": MLADims(32, 64, 64, 128, 256),
    "deepseek_v3_n128": MLADims(128, 128, 64, 128, 512),
}
SHAPES = ((32, 4, 1024), (8, 8, 4096), (64, 2, 2048), (128, 4, 2048))  # (sequences, new tokens, history)


def variants(d: MLADims, q: int) -> dict[str, tuning.AbsorbedConfig]:
    out = {"rows": tuning.absorb_prefill_config(d, torch.bfloat16)}
    dec = tuning.decode_config(d, torch.bfloat16, torch.bfloat16, "heads_on_n")
    if dec.heads_on_n:
        cols = tuning.multi_token_config(dec, q)
        out[f"cols w{cols.num_warps}"] = cols
        if cols.num_warps != 8:
            out["cols w8"] = dataclasses.replace(cols, num_warps=8)
    return out


def core(case: Case, cfg: tuning.AbsorbedConfig, q: int):
    d = case.dims
    n, dn, r = d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
    w = case.w.view(n, dn + d.v_head_dim, r)
    q_abs = torch.bmm(case.x[0][0].transpose(0, 1), w[:, :dn])
    latent = torch.empty_like(q_abs)
    info, b = case.info, len(case.seqs)
    kv = max(c + k for c, k in case.seqs)
    call = top.OpCall(TritonPolicy(), warmed=set())

    def run():
        top.launch_absorbed(call, q_abs, case.x[1], case.cache, info.get("page_table"), info.get("cu_seqlen"),
                             info.get("input_pos"), info.get("seq_len_with_cache"), latent, seq_base=0, n_seqs=b,
                             tok_base=0, n_tok=case.num_tokens, abs_base=0, max_q=q, kv_bound=kv, cfg=cfg, dims=d,
                             qk_scale=case.scale * top.LOG2E)

    return run, latent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rep-ms", type=float, default=20)
    ap.add_argument("--dims", nargs="*", default=list(DIMS))
    args = ap.parse_args()
    rows = []
    for name in args.dims:
        d = DIMS[name]
        for b, q, kv in SHAPES:
            case = Case(d, [(kv - q, q)] * b, torch.bfloat16, "cuda", seed=b + q)
            row = {"dims": name, "B": b, "q": q, "kv": kv, "us": {}, "cfg": {}, "rel_vs_rows": {}}
            ref = None
            for label, cfg in variants(d, q).items():
                run, latent = core(case, cfg, q)
                us, how = time_us(run, graph=True, rep_ms=args.rep_ms)
                run()
                torch.cuda.synchronize()
                out = latent.float().clone()
                if ref is None:
                    ref = out
                row["us"][label] = us
                row["cfg"][label] = dataclasses.asdict(cfg) | {"timed": how}
                row["rel_vs_rows"][label] = float((out - ref).norm() / ref.norm())
            bytes_kv = b * kv * (d.kv_lora_rank + d.qk_rope_head_dim) * 2
            best = min(row["us"], key=row["us"].get)
            row["best"] = best
            row["tb_s_best"] = bytes_kv / (row["us"][best] * 1e-6) / 1e12
            rows.append(row)
            print(name, b, q, kv, {k: round(v, 1) for k, v in row["us"].items()}, "best", best, file=sys.stderr)
            del case
    labels = sorted({lb for r in rows for lb in r["us"]})
    lines = ["| dims | B | new tokens | history | " + " | ".join(f"{lb} µs" for lb in labels)
             + " | best | best TB/s | max rel. diff vs rows |", "|---|---|---|---|" + "---|" * (len(labels) + 3)]
    for r in rows:
        lines.append(f"| {r['dims']} | {r['B']} | {r['q']} | {r['kv']} | "
                     + " | ".join(f"{r['us'][lb]:.1f}" if lb in r["us"] else "—" for lb in labels)
                     + f" | {r['best']} | {r['tb_s_best']:.2f} | {max(r['rel_vs_rows'].values()):.1e} |")
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "multi_token.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        (out / "multi_token.md").write_text(
            f"# Multi-token decode: attention core per kernel layout\n\n{meta['gpu']}, torch {meta['torch']}, "
            f"{meta['date']}. Command: `{meta['command']}`.\n\n" + (__doc__.split("\n\n")[1]) + "\n\n"
            + "\n".join(lines) + "\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
            xs = range(len(rows))
            for i, lb in enumerate(labels):
                ax.bar([x + (i - (len(labels) - 1) / 2) * 0.25 for x in xs],
                       [r["us"].get(lb, 0) for r in rows], 0.25, label=lb)
            ax.set_xticks(list(xs), [f"{r['dims'].split('_')[-1]} {r['B']}x{r['q']}@{r['kv']}" for r in rows],
                          rotation=60, fontsize=7)
            ax.set_ylabel("µs (CUDA-graph replay)")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "multi_token.png", dpi=120)
        except ImportError:
            pass
    print("\n".join(lines))


if __name__ == "__main__":
    main()
