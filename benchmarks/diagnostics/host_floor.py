#!/usr/bin/env python
"""The host-time floor under the Triton op's eager call: what torch and Triton's launcher alone cost.

Issue 14 asks for <= 30 us of host time per eager op call. The lean path (docs/triton_backend.md,
"The lean eager path") still does, per decode call, two cuBLAS `bmm` (q_abs = q_nope . W_kn,
latent . W_v^T into the output rows), a few `torch.empty` and three kernel launches (append, decode,
split merge) through `launch.BoundKernel`'s direct path, one of them with two TMA descriptors. This
script times those pieces alone, outside the op, on the decode_b32_kv1024 shapes of
`profile_op_host.py` (DeepSeek TP-8 dims: N 16, Dn 128, Dv 128, R 512, bf16, 32 tokens), and their
sum as one sequence: no implementation that keeps the two GEMMs in cuBLAS and three launches can be
faster than that sequence on the same host. Compare with `profile_op_host.py`'s median for the op.

    python -m benchmarks.diagnostics.host_floor --calls 2000 --json $OUT/host_floor.json

Each piece is timed per call with perf_counter_ns (no synchronize inside; the GPU runs behind, so
this is the launch path), median / p10 / p90 over `--calls` after 200 warm-up calls. `--smoke`
runs a few calls on CPU (bmm on CPU tensors, the kernels through the Triton interpreter) to check
the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.lib import BoundKernel

N_SCALARS = 16  # the op's kernels take 6-10 pointers and 15-25 scalars


@triton.jit
def _noop(P0, P1, P2, P3, P4, P5, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
          BLOCK: tl.constexpr):
    # Never true (s0 >= 0): a launch with the op's argument count and nothing to run.
    if s0 < 0:
        tl.store(P0 + tl.arange(0, BLOCK), tl.load(P1 + tl.arange(0, BLOCK)))


@triton.jit
def _noop_desc(D0, D1, P0, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15, BLOCK: tl.constexpr):
    # Two host tensor descriptors, as the decode kernels take: the launcher encodes them per launch.
    if s0 < 0:
        D1.store([0, 0], D0.load([0, 0]))


def _times(fn, calls: int, warmup: int = 200) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    out.sort()
    return {"median_us": statistics.median(out), "p10_us": out[len(out) // 10], "p90_us": out[len(out) * 9 // 10]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="a few calls on CPU (interpreter) to check the script")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev.type == "cpu" and not args.smoke:
        sys.exit("host_floor.py measures the CUDA launch path: run it on a GPU (or --smoke to check it)")
    calls = 20 if args.smoke else args.calls
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n, dn, dv, r, t = 16, 128, 128, 512, args.tokens
    q_nope = torch.randn(1, t, n, dn, device=dev, dtype=dt)
    w = torch.randn(n, dn + dv, r, device=dev, dtype=dt)
    w_kn, w_v = w[:, :dn], w[:, dn:]
    out = torch.empty(1, t, n, dv, device=dev, dtype=dt)
    latent = torch.empty(n, t, r, device=dev, dtype=dt)
    bufs = [torch.empty(256, device=dev, dtype=torch.float32) for _ in range(6)]
    scalars = tuple(range(1, N_SCALARS + 1))
    noop = BoundKernel(_noop, {"BLOCK": 128})
    pieces = {
        "torch.empty (latent)": lambda: torch.empty(n, t, r, device=dev, dtype=dt),
        "bmm q_abs = q_nope . W_kn": lambda: torch.bmm(q_nope[0].transpose(0, 1), w_kn),
        "bmm latent . W_v^T into out": lambda: torch.bmm(latent, w_v.transpose(1, 2), out=out[0].transpose(0, 1)),
        "direct launch, 6 ptrs + 16 ints": lambda: noop.launch((t, 1, 1), bufs, scalars),
    }
    desc_kernel = None
    if dev.type == "cuda":
        from triton.tools.tensor_descriptor import TensorDescriptor

        cache = torch.zeros(64 * 64, 576, device=dev, dtype=dt)
        d0 = TensorDescriptor.from_tensor(cache, [64, 64])
        d1 = TensorDescriptor.from_tensor(cache, [64, 64])
        desc_kernel = BoundKernel(_noop_desc, {"BLOCK": 64})
        pieces["direct launch, 2 TMA descriptors + 16 ints"] = lambda: desc_kernel.launch((t, 1, 1), (d0, d1, bufs[0]),
                                                                                         scalars)

    def sequence():  # the lean decode call's torch and launch work, nothing else
        q_abs = torch.bmm(q_nope[0].transpose(0, 1), w_kn)
        lat = torch.empty_like(q_abs)
        noop.launch((t, 1, 1), bufs, scalars)  # append
        if desc_kernel is not None:
            desc_kernel.launch((t, 1, 1), (d0, d1, bufs[0]), scalars)  # decode (TMA)
        else:
            noop.launch((t, 1, 1), bufs, scalars)
        noop.launch((t, 1, 1), bufs, scalars)  # split merge
        torch.bmm(lat, w_v.transpose(1, 2), out=out[0].transpose(0, 1))

    pieces["sequence: 2 bmm + 1 empty + 3 launches"] = sequence
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)", "torch": torch.__version__,
           "triton": triton.__version__, "calls": calls, "tokens": t, "pieces": {}}
    with torch.inference_mode():
        for name, fn in pieces.items():
            res["pieces"][name] = _times(fn, calls, warmup=5 if args.smoke else 200)
            s = res["pieces"][name]
            print(f"{name:45s} median {s['median_us']:7.1f} us  p10 {s['p10_us']:7.1f}  p90 {s['p90_us']:7.1f}",
                  flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        res["direct_launches"] = noop.direct_launches + (desc_kernel.direct_launches if desc_kernel else 0)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
