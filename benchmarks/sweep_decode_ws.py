"""Heads-on-N decode core: launch-config variants against the default config and FlashInfer (issue 14
item 2: more KV bytes in flight at small N).

Variants replace fields of the default `decode_config` (`dataclasses.replace`): Triton's automatic
warp specialisation (`warp_spec`, 2026-11-25: docs/benchmarks/decode_ws.md); `gluon*` variants run the
warp-specialised Gluon kernel (`triton_mla/gluon_decode.py`: as the op plans it, with forced split
counts, or two programs per SM; at N > 32 `gluon` is the many-heads kernel, gluon_decode_wide.py),
results in docs/benchmarks/decode_gluon.md and decode_gluon_wide.md. The 2026-11-26 sweep of
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

from autodeploy_mla.custom_ops.triton_mla import launchers as top  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import tuning  # noqa: E402

SMALL = [(1, 512), (1, 8192), (8, 512), (8, 2048), (32, 1024)]
SHAPES = {
    "deepseek_v3_tp8_n16": SMALL + [(8, 4096), (64, 1024), (64, 4096), (128, 8192)],
    "glm_4_7_flash_n20": SMALL + [(64, 1024), (64, 4096), (128, 8192)],
    "mistral_small_4_n32": SMALL + [(64, 4096), (128, 8192)],
    "deepseek_v3_n128": [(8, 4096), (32, 8192), (128, 8192)],
}
#: name: fields of AbsorbedConfig replaced in the default config (None = the default itself)
VARIANTS: dict[str, dict | None] = {
    "default": None,
    "ws_w4_s2": dict(warp_spec=True, num_warps=4, num_stages=2),
    "ws_w4_s3": dict(warp_spec=True, num_warps=4, num_stages=3),
    "gluon": "gluon",  # custom_ops/triton_mla/gluon_decode.py: loader warp + consumer warpgroup, same split merge
    "gluon_s3": "gluon",  # ... with 3 / 4 / 8 forced splits
    "gluon_s4": "gluon",
    "gluon_s8": "gluon",
    "gluon_2cta": "gluon",  # 2 KV stages and no epilogue layout change: two programs per SM where they fit
}


def decode_core_gluon(case: Case, q_abs: torch.Tensor, latent: torch.Tensor, forced_splits: int = 0,
                      two_per_sm: bool = False):
    """The warp-specialised Gluon decode kernel on the default variant's queries: returns (run, splits).
    Config and splits as the op plans them (`_plan_gluon_decode`), or forced: `forced_splits` > 0,
    `two_per_sm` (2 KV stages, no epilogue layout change, 128 registers at launch)."""
    from autodeploy_mla.custom_ops.triton_mla import gluon_decode as GD
    from autodeploy_mla.custom_ops.triton_mla import kernels as K
    from autodeploy_mla.custom_ops.triton_mla.launchers import _reduce_meta

    d = case.dims
    n, r, dr = d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim
    b = len(case.seqs)
    kv = max(c + m for c, m in case.seqs)
    dev = case.device
    ok, why = GD.supports(n, r, dr, case.cache.shape[1], q_abs.dtype, case.cache.dtype, dev)
    if not ok:
        raise RuntimeError(why)
    if two_per_sm and n > GD.NARROW_MAX_HEADS:
        raise RuntimeError(f"two programs per SM is a variant of the N <= {GD.NARROW_MAX_HEADS} kernel, N={n}")
    two = GD.GluonDecodeConfig(16 if n <= 16 else 32, 2, convert=False, maxnreg=128) if two_per_sm else None
    cfg, splits = GD.plan(n, r, dr, b, kv, forced_splits, torch.device(dev), cfg=two)
    chunk = tuning.MIN_SPLIT_CHUNK
    descs = GD.cache_descriptors(case.cache, r, dr)
    info = case.info
    cu, sl, pt = info.get("cu_seqlen"), info.get("seq_len_with_cache"), info.get("page_table")
    part_acc = torch.empty(b, n, splits, r, dtype=torch.float32, device=dev)
    part_lse = torch.empty(b, n, splits, dtype=torch.float32, device=dev)
    q_pe = case.x[1]

    def run():
        GD.launch(descs, q_abs, q_pe, pt, cu, sl, latent, part_acc, part_lse, n_seqs=b, seq_base=0, tok_base=0,
                  abs_base=0, splits=splits, chunk=chunk, qk_scale=case.scale * top.LOG2E, num_heads=n, r=r, dr=dr,
                  page_size=case.cache.shape[1], cfg=cfg)
        if splits > 1:
            K.split_reduce_kernel[(b, n)](part_acc, part_lse, latent, cu, 0, 0, splits,
                                          *part_acc.stride()[:3], *part_lse.stride()[:2],
                                          latent.stride(0), latent.stride(1), **_reduce_meta(r))

    return run, splits


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
            q_abs = None
            for vname in args.variants.split(","):
                v = VARIANTS[vname]
                try:
                    if v == "gluon":
                        if ref is None:
                            raise RuntimeError("the gluon variant runs after the default (its queries and oracle)")
                        latent = torch.full_like(q_abs, float("nan"))
                        forced = int(vname.split("_s")[1]) if vname.startswith("gluon_s") else 0
                        run, splits = decode_core_gluon(case, q_abs, latent, forced, vname == "gluon_2cta")
                        cfg = None
                    else:
                        cfg = base if v is None else dataclasses.replace(base, **v)
                        run, q_abs, latent, splits = decode_core_triton(case, cfg)
                    run()
                    torch.cuda.synchronize()
                    out = latent.float().clone()
                    if ref is None:
                        ref = out
                    err = float((out - ref).abs().max() / ref.abs().max())
                    us, how = time_us(run, graph=True, rep_ms=args.rep_ms)
                    row["variants"][vname] = {"us": us, "how": how, "splits": splits, "rel_err_vs_default": err,
                                              "tbs": nbytes / us / 1e6, "cfg": dataclasses.asdict(cfg) if cfg else v}
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
