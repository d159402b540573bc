#!/usr/bin/env python
"""The heads-on-N decode kernel on a bf16 and an e4m3 cache, for Nsight Compute and for a look at the
compiled code (registers, spills, shared memory, PTX instruction counts).

    ncu -k regex:heads_on_n --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis_Tables --section Occupancy \\
        python -m benchmarks.diagnostics.profile_decode_kernel fp8          # one variant per ncu run
    python -m benchmarks.diagnostics.profile_decode_kernel bf16 fp8 --asm   # compiled-code counts of both

Shape: DeepSeek-V3 TP8 (N 16, R 512, Dr 64), batch 64 x kv 4096, page 64 (docs/benchmarks/archive/decode_kernel_profile.md).
"""

from __future__ import annotations

import argparse
import collections
import re

import torch

from benchmarks.lib import (
    Case,
    FP8_DTYPE,
    MLADims,
    decode_core_triton,
)
from benchmarks.lib import triton_kernels as K


SHOWN = ("cvt", "wgmma", "mma", "ld.shared", "st.shared", "ldmatrix", "stmatrix", "cp.async", "prmt", "shfl")


def main() -> None:
    ap = argparse.ArgumentParser(description="the heads-on-N decode kernel for Nsight Compute / compiled-code counts")
    ap.add_argument("caches", nargs="*", help="cache dtypes to launch on: bf16 and/or fp8")
    ap.add_argument("--asm", action="store_true", help="print registers, spills, shared memory and PTX counts")
    args = ap.parse_args()
    if set(args.caches) - {"bf16", "fp8"}:
        ap.error(f"caches {args.caches}: each must be bf16 or fp8")
    dims = MLADims(16, 128, 64, 128, 512)
    for tag in args.caches:
        case = Case(dims, [(4095, 1)] * 64, torch.bfloat16, "cuda", seed=1)
        if tag == "fp8":
            case.cache = case.cache.to(FP8_DTYPE)
        run, *_ = decode_core_triton(case)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    if args.asm:
        entry = next(iter(K.absorbed_attn_heads_on_n_kernel.device_caches.values()))
        cache = entry[0] if isinstance(entry, tuple) else entry
        for key, kern in cache.items():
            ops = collections.Counter(re.findall(r"^\s+([a-z]+(?:\.[a-z0-9]+)*)", kern.asm["ptx"], re.M))
            shown = {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if any(s in k for s in SHOWN)}
            print(f"{str(key)[:110]}...\n  registers {kern.n_regs}, spills {kern.n_spills}, shared "
                  f"{kern.metadata.shared} B\n  PTX: {shown}")


if __name__ == "__main__":
    main()
