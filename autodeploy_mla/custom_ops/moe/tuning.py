"""Launch configs of the fused MoE kernels: pure functions of the pair count and the dims.

The row block follows the average rows per expert (decode: a handful, so 16-row blocks waste
little of each weight tile read; prefill: hundreds, so larger blocks reuse each weight tile over
more rows). Tile sizes are from the H200 sweep in `benchmarks/bench_moe.py`
(docs/benchmarks/moe.md); the interpreter (CPU tests) gets small tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    up_n: int  # intermediate columns per tile (the sorted-rows up GEMM multiplies gate and up: 2 x up_n)
    up_k: int
    down_n: int
    down_k: int
    num_warps: int = 4
    num_stages: int = 3
    sorted_tma: bool = False  # prefill: rows copied into expert order first, GEMM operands by TMA descriptor
    # FP8 op only (fused_moe_fp8): activation codes + scales copied into expert order, persistent up / down
    # GEMMs by pointer loads (fp8_kernels.up_fp8_sorted_kernel / down_fp8_sorted_kernel); the 16-bit op ignores it
    persistent_sorted: bool = False

    def align_chunk(self, e_p2: int) -> int:
        """Pairs per layout program: a [CHUNK, E] one-hot tile of ~8K elements."""
        return max(16, min(1024, 8192 // e_p2))

    def align_rows(self, e_p2: int) -> int:
        """Chunk rows of per-expert counts summed per step of the place kernel."""
        return max(1, min(64, 4096 // e_p2))


def moe_config(n_pairs: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
               compiled: bool) -> MoEConfig:
    """The config for `n_pairs` (token, expert) pairs over `num_experts` experts."""
    if not compiled:  # TRITON_INTERPRET=1 (CPU tests): small tiles keep the interpreter quick
        return MoEConfig(block_m=16, up_n=16, up_k=16, down_n=16, down_k=16, num_warps=1, num_stages=1)
    avg = n_pairs / max(1, num_experts)
    if dtype == torch.float32:
        return MoEConfig(block_m=16 if avg <= 16 else 32, up_n=32, up_k=32, down_n=64, down_k=32)
    # H200 sweep (docs/benchmarks/moe.md): a block per expert should hold all its rows (else the
    # expert's weights are read once per block), so the block grows with the rows per expert.
    if avg <= 8:  # decode: T=64 of V2-Lite/GLM (avg 6/4), V3 (avg 2): 1.10x the byte floor
        return MoEConfig(block_m=16, up_n=64, up_k=128, down_n=64, down_k=128, num_warps=4, num_stages=4)
    if avg <= 48:  # T=512: 0.314 vs 0.405 ms (V2-Lite), 5.90 vs 6.28 ms (V3) against 16/32-row blocks
        return MoEConfig(block_m=64, up_n=64, up_k=64, down_n=128, down_k=64, num_warps=4, num_stages=3)
    # T=2048: rows copied into expert order, operands by TMA: 0.554 vs 0.598 ms (V2-Lite), 0.482 vs
    # 0.498 ms (GLM) against the gathered loads (2026-11-24 sweep). Persistent GEMMs with the gate and
    # up halves in one [128, 2 x 128] product and 128 x 256 down tiles (2026-11-26 variants,
    # docs/benchmarks/moe_prefill_gemms.md): up 351 -> 320 us, down 186 -> 176 us (V2-Lite T=2048);
    # then 4 stages instead of 3 (whole op, same day): V2-Lite 547 -> 519 us, GLM 466 -> 447 us at
    # T=2048, equal at 1024; 64-row blocks (less padding) slower at every size, the best of them by
    # 2-16% (docs/moe.md)
    return MoEConfig(block_m=128, up_n=128, up_k=64, down_n=256, down_k=64, num_warps=8, num_stages=4, sorted_tma=True)


def moe_fp8_config(n_pairs: int, num_experts: int, hidden: int, inter: int, block_k: int,
                   compiled: bool) -> MoEConfig:
    """The block-FP8 kernels' config (up_fp8_kernel / down_fp8_kernel): their up tile is always
    block_k x block_k (its epilogue quantizes one activation group per tile) with two fp32 accumulators
    (gate and up), so the 16-bit configs do not carry over. H200 sweep (benchmarks/moe/sweep_moe_fp8.py,
    docs/benchmarks/moe_fp8_sweep.md, 2026-11-29): decode (T=64 of V2-Lite / GLM-4.7-Flash) 16-row
    blocks, 4 warps, 4 stages beat every 32-128-row config (169 vs 196 us, 1.29x the byte floor);
    prefill (T=2048) 64-row blocks, 8 warps, 3 stages, 128-column down tiles: 585 vs 1058 us (V2-Lite)
    and 465 vs 867 us (GLM) against the 128-row 16-bit config it used before.

    From 32 pairs per expert on (T=512 of GLM-4.7-Flash and V2-Lite: 32 and 48; T=2048: 128 and 192) the
    sorted-rows path (`persistent_sorted`: rows copied into expert order, persistent GEMMs, gate and up in
    one product, fp8_kernels.up_fp8_sorted_kernel) with 64-row blocks, 8 warps, 4 stages and 256-column
    down tiles beat the gathered kernels at all four sizes (H200, 2026-11-29, commit 0a9a712, `sweep_moe_fp8
    --tokens 2048,512 --no-grid`): T=512 250 vs 296 us (V2-Lite), 246 vs 291 us (GLM); T=2048 574 vs 589
    (V2-Lite), 458 vs 466 (GLM). The range 8 < pairs per expert < 32 is not swept: it keeps the gathered
    64-row, 4-warp config of the 16-bit op."""
    if not compiled:
        return MoEConfig(block_m=16, up_n=block_k, up_k=block_k, down_n=32, down_k=block_k, num_warps=4, num_stages=1)
    avg = n_pairs / max(1, num_experts)
    if avg <= 8:
        return MoEConfig(block_m=16, up_n=block_k, up_k=block_k, down_n=128, down_k=block_k, num_warps=4, num_stages=4)
    if avg < 32:
        return MoEConfig(block_m=64, up_n=block_k, up_k=block_k, down_n=128, down_k=block_k, num_warps=4, num_stages=3)
    return MoEConfig(block_m=64, up_n=block_k, up_k=block_k, down_n=256, down_k=block_k, num_warps=8, num_stages=4,
                     persistent_sorted=True)
