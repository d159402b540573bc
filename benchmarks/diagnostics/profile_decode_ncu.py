#!/usr/bin/env python
"""One launch of the Triton decode core (as the op plans it: the Gluon kernels on SM90) and one of
FlashInfer's MLA decode, inside cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off --metrics dram__bytes_read.sum,gpu__time_duration.sum,\
lts__t_sector_hit_rate.pct,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__cycles_active.avg \
        python -m benchmarks.diagnostics.profile_decode_ncu --dims deepseek_v3_n128 --batch 128 --kv 8192

Without ncu (`--time`) it prints the CUDA-graph replay times of both instead, the Triton core at each
`--splits` count given (0: the op's own; e.g. `--kv 512 --splits 0,1,2,4` separates a launch's fixed
cost from its per-tile cost). The numbers of
docs/benchmarks/decode_gluon_wide.md's ncu table came from a development copy of this script run on
the first many-heads kernel (commit 004cadc).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.lib import (
    Case,
    DIMS,
    FlashInferDecode,
    decode_core_triton,
    time_us,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="deepseek_v3_n128", choices=list(DIMS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--kv", type=int, default=8192)
    ap.add_argument("--time", action="store_true", help="time both as CUDA-graph replays instead of profiling")
    ap.add_argument("--splits", default="0",
                    help="comma list of KV split counts to force on the Triton core (0: the count the op plans)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode_ncu.py needs a CUDA GPU")
    d, b, kv = DIMS[args.dims], args.batch, args.kv
    case = Case(d, [(kv - 1, 1)] * b, torch.bfloat16, torch.device("cuda"), seed=b * 7 + kv)
    forced = [int(s) for s in args.splits.split(",")]
    if any(s < 0 for s in forced) or (not args.time and len(forced) > 1):
        sys.exit(f"--splits {args.splits!r}: expected counts >= 0, and a single count unless --time")
    # cfg None: the kernel the op picks
    runs = [decode_core_triton(case, forced_splits=s) for s in forced]
    run, q_abs, _, splits = runs[0]
    fi = FlashInferDecode(case, q_abs)
    fi.plan()
    for _ in range(3):  # compile, JIT-build and warm both outside the profiled range
        run()
        fi.run()
    torch.cuda.synchronize()
    flops = 2 * b * kv * d.num_heads * (2 * d.kv_lora_rank + d.qk_rope_head_dim)
    if args.time:
        named = [(f"triton ({r.kernel}, {n} splits)", r) for r, _, _, n in runs] + [("flashinfer", fi.run)]
        for name, fn in named:
            us, _ = time_us(fn, graph=True, rep_ms=10)
            print(f"{args.dims} B{b} kv{kv} {name}: {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s")
        return
    torch.cuda.cudart().cudaProfilerStart()
    run()
    fi.run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
