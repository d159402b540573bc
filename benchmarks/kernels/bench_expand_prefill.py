"""Expanded prefill kernel A/B: launch tiles x grid order (heavy_first) x nope chunks (split_nope).

The Triton backend's expanded prefill (`expanded_prefill_kernel`, FlashAttention-style over K/V
expanded by kv_b_proj) on one fresh T-token prefill (default 2048) for DeepSeek-V2-Lite's per-layer
dims (N 16, Dn 128, Dr 64, Dv 128, R 512) and GLM-4.7-Flash's (N 20, Dn 192, Dr 64, Dv 256): device
time of the whole op (latent gather, K/V expansion GEMM, attention) as a CUDA-graph replay, for
each candidate `tuning.ExpandConfig` (and each tile with K/V loaded by TMA descriptor, `tma`). `heavy_first`: a head's query blocks are scheduled from the
last (the causal blocks that see the most keys first); `split_nope`: a Dn that is not a power of
two (192) is two exact tiles (128 + 64) instead of one padded to 256. Outputs are compared with the
first variant of each shape (max |diff| / max |out|).

    python -m benchmarks.kernels.bench_expand_prefill --out /tmp/xp          # H200
    python -m benchmarks.kernels.bench_expand_prefill --render docs/benchmarks/expand_prefill.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib import (
    Case,
    DIMS,
    TritonPolicy,
    time_us,
    triton_launch_config,
)

#: dims name -> (candidate (BLOCK_M, BLOCK_N, warps, stages), nope-chunk settings to try)
CANDIDATES = {
    "deepseek_v3_tp8_n16": ([(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
                            [True]),
    "glm_4_7_flash_n20": ([(128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2)],
                          [True, False]),
}


def run(tokens: int) -> list[dict[str, Any]]:
    from benchmarks.lib import triton_tuning as tuning

    dev = torch.device("cuda")
    rows = []
    for name, (tiles, splits) in CANDIDATES.items():
        d = DIMS[name]
        case = Case(d, [(0, tokens)], torch.bfloat16, dev, seed=3)
        flops = 2.0 * tokens * (tokens + 1) / 2 * d.num_heads * (d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim)
        default = tuning.expand_config(d, torch.bfloat16, -(-tokens // 128) * d.num_heads, tuning.num_sms(dev))
        ref = None
        variants = [(t, hf, sp, False) for t, hf, sp in itertools.product(tiles, [False, True], splits)]
        variants += [(t, True, True, True) for t in tiles]  # K/V tiles by TMA descriptor
        for (bm, bn, w, st), hf, sp, tma in variants:
            cfg = tuning.ExpandConfig(bm, bn, w, st, heavy_first=hf, split_nope=sp, tma=tma)
            row: dict[str, Any] = {"dims": name, "T": tokens, "cfg": [bm, bn, w, st], "heavy_first": hf,
                                   "split_nope": sp, "tma": tma, "default": cfg == default}
            try:
                with triton_launch_config("expand_config", cfg), \
                        case.op("triton", TritonPolicy(prefill_mode="expand")) as op:
                    out = op().float().clone()
                    row["us"], row["how"] = time_us(op, graph=True, rep_ms=60)
                ref = out if ref is None else ref
                row["diff"] = ((out - ref).abs().max() / ref.abs().max()).item()
                row["attn_tflops"] = flops / (row["us"] * 1e-6) / 1e12
            except Exception as exc:  # noqa: BLE001 - a config may not compile; record it
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    lines = [f"# Expanded prefill kernel A/B ({data['gpu']}, triton {data['triton']})", "",
             f"Command: `{data['command']}`", "",
             "Whole op (latent gather + K/V expansion GEMM + attention), CUDA-graph replay, median us; "
             "TFLOP/s counts the causal attention FLOPs only. * = the default after this sweep.", "",
             "| dims | T | BLOCK_M, BLOCK_N, warps, stages | heavy_first | split_nope | tma | us | attention TFLOP/s | diff |",
             "|---|---:|---|---|---|---|---:|---:|---:|"]
    for r in data["rows"]:
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "-")[:40]
        tf = f"{r['attn_tflops']:.0f}" if "attn_tflops" in r else "-"
        lines.append(f"| {r['dims']} | {r['T']} | {r['cfg']}{' *' if r.get('default') else ''} | {r['heavy_first']} | "
                     f"{r['split_nope']} | {r.get('tma', False)} | {us} | {tf} | {r.get('diff', float('nan')):.1e} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in data["rows"] if "us" in r]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['dims'][:4]} {r['cfg']}{' HF' if r['heavy_first'] else ''}{' S' if r['split_nope'] else ''}"
              f"{' TMA' if r.get('tma') else ''}" for r in ok]
    ax.barh(range(len(ok)), [r["us"] for r in ok], color=["C1" if r.get("default") else "C0" for r in ok])
    ax.set_yticks(range(len(ok)), labels, fontsize=6)
    ax.set_xlabel("whole expanded-prefill op, us (CUDA graph)")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    if args.render:
        render(args.render)
        return
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    data = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
            "torch": torch.__version__, "rows": run(args.tokens)}
    path = args.out / "expand_prefill.json"
    path.write_text(json.dumps(data, indent=1))
    render(path)


if __name__ == "__main__":
    main()
