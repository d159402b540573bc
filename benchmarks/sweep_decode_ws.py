"""Heads-on-N decode core: launch-config variants against the default config and FlashInfer (issue 14
item 2: more KV bytes in flight at small N).

Variants replace fields of the default `decode_config` (`dataclasses.replace`): Triton's automatic
warp specialisation (`warp_spec`, 2026-11-25: docs/benchmarks/decode_ws.md). The 2026-11-26 sweep of
page ids loaded in windows with deeper pipelines (docs/benchmarks/decode_pipeline.md) ran variants of
an `AbsorbedConfig.page_window` knob that was removed after it measured slower (commit 8bc21eb).
For each dim set and (batch, kv) it runs the default and each variant, checks each variant's latent
against the default's (max |diff| / max |ref|), and times the core as a CUDA-graph replay (L2 flushed). Writes <out>/<--json> and prints a table.

    python benchmarks/sweep_decode_ws.py --out /tmp/ws --variants default,ws_w4_s2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_mla_kernels import DIMS, Case, FlashInferDecode, decode_core_triton, flashinfer_accepts, time_us  # noqa: E402

from autodeploy_mla.custom_ops.triton_mla import tuning  # noqa: E402

SHAPES = {
    "deepseek_v3_tp8_n16": [(8, 4096), (64, 1024), (64, 4096), (128, 8192)],
    "glm_4_7_flash_n20": [(64, 1024), (64, 4096), (128, 8192)],
    "mistral_small_4_n32": [(64, 4096), (128, 8192)],
    "deepseek_v3_n128": [(8, 4096), (32, 8192), (128, 8192)],
}
#: name: fields of AbsorbedConfig replaced in the default config (None = the default itself)
VARIANTS: dict[str, dict | None] = {
    "default": None,
    "ws_w4_s2": dict(warp_spec=True, num_warps=4, num_stages=2),
    "ws_w4_s3": dict(warp_spec=True, num_warps=4, num_stages=3),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dims", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rep-ms", type=float, default=20)
    ap.add_argument("--json", default="decode_ws.json", help="file name of the results under --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    for dname in args.dims.split(","):
        d = DIMS[dname]
        for b, kv in SHAPES[dname]:
            case = Case(d, [(kv - 1, 1)] * b, torch.bfloat16, dev, seed=b * 7 + kv)
            nbytes = b * kv * (d.kv_lora_rank + d.qk_rope_head_dim) * 2
            row = {"dims": dname, "batch": b, "kv": kv, "bytes": nbytes, "variants": {}}
            base = tuning.decode_config(d, torch.bfloat16, case.cache.dtype)
            ref = None
            for vname in args.variants.split(","):
                v = VARIANTS[vname]
                cfg = base if v is None else dataclasses.replace(base, **v)
                try:
                    run, q_abs, latent, splits = decode_core_triton(case, cfg)
                    run()
                    torch.cuda.synchronize()
                    out = latent.float().clone()
                    if ref is None:
                        ref = out
                    err = float((out - ref).abs().max() / ref.abs().max())
                    us, how = time_us(run, graph=True, rep_ms=args.rep_ms)
                    row["variants"][vname] = {"us": us, "how": how, "splits": splits, "rel_err_vs_default": err,
                                              "tbs": nbytes / us / 1e6, "cfg": dataclasses.asdict(cfg)}
                except Exception as e:  # noqa: BLE001 - a variant may not compile; record why
                    traceback.print_exc()
                    row["variants"][vname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            ok, _ = flashinfer_accepts(d)
            if ok:
                try:
                    fi = FlashInferDecode(case, q_abs)
                    fi.plan()
                    us, _ = time_us(fi.run, graph=True, rep_ms=args.rep_ms)
                    row["flashinfer_us"] = us
                    row["flashinfer_tbs"] = nbytes / us / 1e6
                except Exception as e:  # noqa: BLE001
                    row["flashinfer_err"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            cells = [f"{n} " + (f"{v['us']:.1f}us {v['tbs']:.2f}TB/s err {v['rel_err_vs_default']:.1e}"
                                if "us" in v else v["error"][:80]) for n, v in row["variants"].items()]
            print(f"{dname} B{b} kv{kv}: FI {row.get('flashinfer_us', float('nan')):.1f}us | " + " | ".join(cells),
                  flush=True)
            (args.out / args.json).write_text(json.dumps({"command": "python " + " ".join(sys.argv),
                                                                 "rows": rows}, indent=1))
            del case


if __name__ == "__main__":
    main()
