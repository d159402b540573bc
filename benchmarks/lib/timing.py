"""How the benchmarks time GPU work, and the H200 marks their rows are compared with.

One definition of "the time of a kernel" for every script: medians of CUDA-graph replays with L2
emptied before each run (`time_us`), replay medians of a captured sequence (`graph_time_ms`), and
host wall time with a device sync (`host_ms`, `median_ms`). On a machine without CUDA they fall
back to wall clock so the CPU dry runs of the scripts exercise the same code.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence, Union

import torch

COPY_TBS = 4.3  # measured H200 device copy bandwidth, TB/s (DESIGN §12)
BF16_TFLOPS = 790.0  # measured bf16 dense matmul, TFLOP/s


def sync(dev: torch.device) -> None:
    """Wait for the device (no-op on the CPU)."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


#: How L2 is emptied before each timed run. "zero": triton.testing.do_bench's own flush (it zeroes a
#: 256 MB buffer, which leaves L2 full of dirty lines: the timed kernel's first reads pay their write-back,
#: ~9.5 us of a streaming kernel's time on the H200, docs/benchmarks/read_floor.md). "read": a read of a
#: 256 MB buffer instead (L2 left holding clean lines of other data: cold, with nothing to write back, as
#: a decode step's attention finds it after small GEMMs).
FLUSH_MODES = ("zero", "read")


def do_bench(fn, rep_ms: float, flush: str = "zero") -> float:
    import triton.testing

    if flush == "zero":
        return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median")) * 1e3
    if flush != "read":
        raise ValueError(f"flush mode {flush!r}: expected one of {FLUSH_MODES}")
    buf = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB, as do_bench's

    def clear():
        buf.sum()

    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        clear()
        fn()
    t1.record()
    torch.cuda.synchronize()
    est = max(t0.elapsed_time(t1) / 5, 1e-3)
    for _ in range(max(1, int(max(5, rep_ms // 4) / est))):
        fn()
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        clear()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2] * 1e3


def time_us(fn, *, graph: bool, rep_ms: float = 40, flush: str = "zero") -> tuple[float, str]:
    """Median µs of fn; on CUDA with graph=True, of a CUDA-graph replay of fn. Returns (µs, how).
    `flush`: how L2 is emptied before each run (FLUSH_MODES)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "cpu-wall"
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            return do_bench(g.replay, rep_ms, flush), "graph"
        except Exception as e:  # fall back to eager, but say so
            torch.cuda.synchronize()
            return do_bench(fn, rep_ms, flush), f"eager (graph capture failed: {type(e).__name__})"
    return do_bench(fn, rep_ms, flush), "eager"


def host_ms(fn, n: int = 10) -> float:
    ts = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def graph_time_ms(fn: Union[Callable[[], Any], Sequence[Callable[[], Any]]], reps: int = 20, calls: int = 1) -> float:
    """Median device time of one call of `fn`: `calls` calls captured as one CUDA graph (several for
    calls of a few µs, where one replay's own cost would dominate), `reps` replays. `fn` may be a list
    of callables instead (say, each on its own copy of a weight, so that none finds its operands in
    L2): each is captured once, one after another, and the time is per callable."""
    warm = list(fn) if isinstance(fn, (list, tuple)) else [fn, fn]
    seq = list(fn) if isinstance(fn, (list, tuple)) else [fn] * calls
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in warm:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in seq:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / len(seq))
    ts.sort()
    return ts[len(ts) // 2]


def median_ms(fn, dev: torch.device, reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
