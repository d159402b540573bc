#!/usr/bin/env python
"""The heads-on-N decode kernel on a bf16 and an e4m3 cache, for Nsight Compute and for a look at the
compiled code (registers, spills, shared memory, PTX instruction counts).

    ncu -k regex:heads_on_n --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis_Tables --section Occupancy \\
        python benchmarks/profile_decode_kernel.py fp8          # one variant per ncu run
    python benchmarks/profile_decode_kernel.py bf16 fp8 --asm   # compiled-code counts of both

Shape: DeepSeek-V3 TP8 (N 16, R 512, Dr 64), batch 64 x kv 4096, page 64 (docs/benchmarks/decode_kernel_profile.md).
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mla_kernels import Case, decode_core_triton  # noqa: E402

from autodeploy_mla.custom_ops import MLADims  # noqa: E402
from autodeploy_mla.custom_ops.attention.cache_format import FP8_DTYPE  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import kernels as K  # noqa: E402

SHOWN = ("cvt", "wgmma", "mma", "ld.shared", "st.shared", "ldmatrix", "stmatrix", "cp.async", "prmt", "shfl")


def main(argv: list[str]) -> int:
    dims = MLADims(16, 128, 64, 128, 512)
    for tag in [a for a in argv if a in ("bf16", "fp8")]:
        case = Case(dims, [(4095, 1)] * 64, torch.bfloat16, "cuda", seed=1)
        if tag == "fp8":
            case.cache = case.cache.to(FP8_DTYPE)
        run, *_ = decode_core_triton(case)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    if "--asm" in argv:
        entry = next(iter(K.absorbed_attn_heads_on_n_kernel.device_caches.values()))
        cache = entry[0] if isinstance(entry, tuple) else entry
        for key, kern in cache.items():
            ops = collections.Counter(re.findall(r"^\s+([a-z]+(?:\.[a-z0-9]+)*)", kern.asm["ptx"], re.M))
            shown = {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if any(s in k for s in SHOWN)}
            print(f"{str(key)[:110]}...\n  registers {kern.n_regs}, spills {kern.n_spills}, shared "
                  f"{kern.metadata.shared} B\n  PTX: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
