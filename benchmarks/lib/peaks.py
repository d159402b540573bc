"""The device's measured peaks (copy bandwidth, bf16 matmul), the denominators of every floor.

Measured in the process that uses them, so a floor compares with what this device delivers today
rather than with a datasheet.
"""

from __future__ import annotations

import torch

from benchmarks.lib.timing import median_ms


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
