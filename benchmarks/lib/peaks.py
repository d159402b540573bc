"""The device's measured peaks (copy bandwidth, bf16 matmul, FP8 matmul), the denominators of every floor.

Measured in the process that uses them, so a floor compares with what this device delivers today
rather than with a datasheet.
"""

from __future__ import annotations

import torch

from benchmarks.lib.records import error_line
from benchmarks.lib.timing import median_ms, time_us


def measure_peaks(dev: torch.device, quick: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul TFLOP/s on this device."""
    nbytes = (64 if quick else 4096) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), dev)
    bw = 2 * nbytes / (ms / 1e3) / 1e9
    n = 512 if quick else 8192
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dt, device=dev)
    b = torch.randn(n, n, dtype=dt, device=dev)
    ms = median_ms(lambda: a @ b, dev)
    return {"copy_gb_s": bw, "matmul_tflops": 2 * n**3 / (ms / 1e3) / 1e12, "matmul_n": n}


def fp8_peak_tflops(dev: torch.device, n: int) -> float:
    """Dense e4m3 x e4m3 -> bf16 rate of `torch._scaled_mm` with per-tensor scales (no block scaling)."""
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    us, _ = time_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), graph=True, rep_ms=50)
    return 2 * n**3 / (us * 1e-6) / 1e12


def add_fp8_peak(peaks: dict[str, float], dev: torch.device, quick: bool) -> dict[str, float]:
    """`peaks` (measure_peaks) with `fp8_tflops` (fp8_peak_tflops on an fp8_n^3 product) and `fp8_n`; where
    the device has no FP8 matmul (the CPU, pre-Hopper GPUs), the bf16 rate instead, and a line saying so."""
    peaks["fp8_n"] = 512 if quick or dev.type != "cuda" else 8192
    try:
        peaks["fp8_tflops"] = fp8_peak_tflops(dev, peaks["fp8_n"]) if dev.type == "cuda" else peaks["matmul_tflops"]
    except Exception as e:  # noqa: BLE001 - no FP8 matmul on this device: FLOP floors against bf16
        print(f"FP8 peak not measured ({error_line(e)}); FLOP floors against the bf16 peak")
        peaks["fp8_tflops"] = peaks["matmul_tflops"]
    return peaks
