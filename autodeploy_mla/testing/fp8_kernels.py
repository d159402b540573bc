"""Block-FP8 operands for kernel tests and benchmarks: a 16-bit/fp32 weight quantized per block
(amax / 448 per block, as DeepSeek's checkpoints are made), and random ones made directly on a device.

(Both use the checkpoint writer's quantizer, models/fp8_format.quantize_weight, so a kernel test's
operands are exactly what a loaded checkpoint holds.)
"""

from __future__ import annotations

import torch

from ..models.fp8_format import quantize_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [..., N, K], fp32 scale [..., ceil(N/bn), ceil(K/bk)]) with w ~= fp8 * scale per block:
    the checkpoint writer's quantizer (format.quantize_weight). Leading dims (stacked experts) are kept."""
    return quantize_weight(w, (block_n, block_k))


def random_block_weight(shape: tuple[int, ...], block_n: int, block_k: int, device: torch.device | str,
                        std: float = 0.02, seed: int = 0, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """A random block-FP8 weight of `shape` ([..., N, K]) made on `device` a slab of rows at a time, so
    a full-size expert stack never exists in 16-bit (N(0, std) values, quantized per block)."""
    g = torch.Generator(device=device).manual_seed(seed)
    *lead, n, k = shape
    flat = int(torch.tensor(lead).prod()) if lead else 1
    q = torch.empty(flat, n, k, dtype=FP8, device=device)
    s = torch.empty(flat, -(-n // block_n), -(-k // block_k), dtype=torch.float32, device=device)
    rows = max(block_n, chunk_rows // block_n * block_n)
    for e in range(flat):
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            w = torch.randn(r1 - r0, k, generator=g, device=device, dtype=torch.float32) * std
            qq, ss = quantize_blocks(w, block_n, block_k)
            q[e, r0:r1] = qq
            s[e, r0 // block_n:r0 // block_n + ss.shape[0]] = ss
    return q.reshape(*lead, n, k), s.reshape(*lead, *s.shape[1:])


__all__ = ["quantize_blocks", "random_block_weight"]
