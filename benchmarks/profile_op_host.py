"""Where the host time of one eager Triton op call goes (diagnostic for issue 14's lean eager path).

Builds one step exactly like bench_op_host_cost.py (DeepSeek TP-8 dims, bf16, page 64), runs the
Triton op through a prepared session (the backend's `direct_call`, as the piecewise runner calls
it), prints the session's launch counters, the device time of the call (captured once in a CUDA
graph, replays timed), (JIT vs direct launches, and why a kernel is not launched
directly), a per-call median, and a cProfile of `--calls` calls sorted by own time.

    python benchmarks/profile_op_host.py --shape decode_b32_kv1024 --calls 300
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_op_host_cost import SHAPES, NewApi, build_step_data  # noqa: E402

from autodeploy_mla.custom_ops import get_backend  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="decode_b32_kv1024", choices=list(SHAPES))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--via", default="direct", choices=("op", "direct"))
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--layout", default="auto", choices=("auto", "heads_on_m", "heads_on_n"),
                    help="TritonPolicy.decode_layout (decode and multi-token decode kernels)")
    ap.add_argument("--decode-kernel", default="auto", choices=("auto", "triton", "gluon"),
                    help="TritonPolicy.decode_kernel (Gluon warp-specialised or tl decode kernels)")
    ap.add_argument("--json", default=None, help="write the host median and device time here")
    args = ap.parse_args()
    be = get_backend("triton")
    api = NewApi()
    api.via = args.via
    with torch.inference_mode():
        dims, info, op_args = build_step_data(be, SHAPES[args.shape], torch.bfloat16, "cuda")
        from autodeploy_mla.custom_ops.triton_mla import TritonPolicy

        step = api.step(be, dims, torch.bfloat16, info, op_args, TritonPolicy(decode_layout=args.layout,
                                                                         decode_kernel=args.decode_kernel))
        step.prepare()
        with step.context():
            for _ in range(20):
                step.op(*step.args)
            torch.cuda.synchronize()
            sess = None
            from autodeploy_mla.custom_ops.attention.step_context import active_session

            sess = active_session("triton")
            print("session stats:", sess.stats())
            for (fn, _), bk in sess.launches._bound.items():
                print(f"  {getattr(fn, '__name__', fn)}: direct={bk.direct} compiled={len(bk._compiled)} "
                      f"jit={bk.jit_launches} direct_launches={bk.direct_launches} why_jit={bk.why_jit!r} "
                      f"keys={list(bk._compiled)[:2]}")
            params = getattr(bk.fn, "params", [])
            print("  KernelParam attrs:", [a for a in dir(params[0]) if not a.startswith("__")] if params else None)
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter_ns()
                step.op(*step.args)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            print(f"{args.shape} via {args.via}: median {statistics.median(times):.1f} us/call "
                  f"(p10 {sorted(times)[len(times) // 10]:.1f})")
            # device time of the same call: one call captured in a CUDA graph, replays timed
            import triton.testing

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step.op(*step.args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step.op(*step.args)
            dev_us = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
            print(f"{args.shape} [{args.layout}, {args.decode_kernel}]: device {dev_us:.1f} us per call (CUDA-graph replay of one call)")
            if args.json:
                import json

                Path(args.json).write_text(json.dumps({
                    "shape": args.shape, "via": args.via, "layout": args.layout,
                    "decode_kernel": args.decode_kernel, "host_us_median": statistics.median(times),
                    "host_us_p10": sorted(times)[len(times) // 10], "device_us": dev_us,
                    "gpu": torch.cuda.get_device_name(), "session": sess.stats()}))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                step.op(*step.args)
            prof.disable()
            torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
