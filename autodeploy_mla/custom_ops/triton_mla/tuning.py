"""Tuning of the Triton MLA kernels: limits, the prefill cost rule, launch configs and split-K.

Every constant here cites the H200 sweep it came from (`benchmarks/bench_mla_kernels.py --tune`,
docs/benchmarks/mla_kernels.md, docs/triton_backend.md). Pure functions of dims, dtypes and sizes:
nothing here launches a kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..attention.registry import EMULATED_SM_COUNT
from ..attention.mla_dims import MLADims
from ..triton_helpers import pow2


# ----------------------------------------------------------------------------- limits (check())
#: Largest latent / rope width one program holds in registers (the accumulator is [rows, R] fp32).
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 256
#: Largest head dims of the expanded prefill kernel; above them prefill always takes "absorb".
MAX_EXPAND_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def validate_dims(dims: MLADims, dtype: torch.dtype) -> Optional[str]:
    """Why these dims/dtype cannot run on the Triton kernels (None = they can)."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} unsupported (expected one of float16, bfloat16, float32)"
    if not 1 <= dims.kv_lora_rank <= MAX_KV_LORA_RANK:
        return (f"kv_lora_rank R={dims.kv_lora_rank} outside [1, {MAX_KV_LORA_RANK}] "
                "(the absorbed kernel keeps a [rows, R] fp32 accumulator in registers)")
    if dims.qk_rope_head_dim > MAX_ROPE_DIM:
        return f"qk_rope_head_dim Dr={dims.qk_rope_head_dim} over {MAX_ROPE_DIM}"
    return None


def expansion_supported(dims: MLADims) -> bool:
    return max(dims.qk_nope_head_dim, dims.v_head_dim) <= MAX_EXPAND_HEAD_DIM


# ----------------------------------------------------------------------------- cost rule
#: How many times more FLOP/s the expanded path sustains than the absorbed one on H200 (bf16):
#: expansion is one cuBLAS GEMM + a FlashAttention kernel on wgmma tiles with head dims <= 256; the
#: absorbed kernel carries a [rows, R] fp32 accumulator and reaches ~100 TFLOP/s. Measured ratio
#: 3.3-4.3 (docs/benchmarks/mla_kernels.md, prefill T=128/2048); 3 is the conservative end.
ABSORB_SLOWDOWN = 3.0


def prefill_costs(dims: MLADims, new_tokens: int, prefix_tokens: int, causal_pairs: int) -> tuple[float, float]:
    """(expand, absorb) FLOPs per head / 2 of one step's prefill part (docs/triton_backend.md).

    Per (query, key) pair the expanded attention costs Dn+Dr+Dv multiply-adds, the absorbed one
    2R+Dr. Expansion also runs kv_b_proj over every history token (R·(Dn+Dv) per token: prefix P and
    new T), absorption runs q_abs and W_v over the new tokens only (the same R·(Dn+Dv) per token).
    """
    r, dn, dv, dr = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim, dims.qk_rope_head_dim
    proj = r * (dn + dv)
    expand = (prefix_tokens + new_tokens) * proj + causal_pairs * (dn + dr + dv)
    absorb = new_tokens * proj + causal_pairs * (2 * r + dr)
    return float(expand), float(absorb)


#: A step runs on static bounds (a mixed graph: its prefill part absorbed, docs/triton_backend.md)
#: only while absorbing costs at most this much more per layer than expanding, in expansion FLOPs
#: (absorbed FLOPs weighted by ABSORB_SLOWDOWN; `static_bounds_extra_flops`). H200, 27-layer V2-Lite
#: and 47-layer GLM-4.7-Flash (docs/benchmarks/mixed_graph.md): a 240-token chunk on a 4096-token
#: prefix (+80 / +78 G) ran 0.91-0.94x / 0.87x of piecewise; 120 on 1024 (+9.0 / +7.1 G) 1.18x /
#: 1.03x; fresh prefills up to 256 (<= +8.3 G) 0.96-1.00x.
STATIC_MAX_EXTRA_FLOPS = 20e9


def static_bounds_extra_flops(dims: MLADims, new_tokens: int, prefix_tokens: int, causal_pairs: int) -> float:
    """What absorbing a step's prefill part costs per layer over expanding it, in expansion FLOPs
    (the absorbed kernel's FLOPs count ABSORB_SLOWDOWN times, as in choose_prefill_path); may be < 0."""
    if not expansion_supported(dims):
        return 0.0
    expand, absorb = prefill_costs(dims, new_tokens, prefix_tokens, causal_pairs)
    return 2.0 * dims.num_heads * (ABSORB_SLOWDOWN * absorb - expand)


def max_static_bounds_extra_flops(dims: MLADims, num_tokens: int, max_seq_len: int) -> float:
    """An upper bound of `static_bounds_extra_flops` over every step with at most `num_tokens` new
    prefill tokens whose sequences hold at most `max_seq_len` tokens each: what the model runner's
    warm-up asks to know whether any step of a mixed-graph bucket can be declined (and so run piecewise).

    The step's cost is a sum over its prefill sequences i of f(T_i, P_i) (T_i new tokens on P_i cached,
    causal pairs T_i·P_i + T_i(T_i+1)/2), and f is linear in P_i, so each sequence's maximum is at
    P_i = 0 or P_i = max_seq_len - T_i: g(T) = max of the two. The best split of the tokens over
    sequences, max over T_1 + ... + T_k <= num_tokens of sum g(T_i), is a knapsack solved exactly here
    (ignoring max_batch_size, which only makes the bound larger: safe)."""
    if not expansion_supported(dims) or num_tokens < 1:
        return 0.0
    n = min(num_tokens, max_seq_len)
    g = [float("-inf")] + [max(static_bounds_extra_flops(dims, t, p, t * p + t * (t + 1) // 2)
                                for p in {0, max(0, max_seq_len - t)}) for t in range(1, n + 1)]
    best = [0.0] * (n + 1)  # best[t]: the largest sum over splits of at most t tokens (0: no prefill part)
    for t in range(1, n + 1):
        best[t] = max(best[t - 1], *(best[t - a] + g[a] for a in range(1, t + 1)))
    return best[n]


def choose_prefill_path(dims: MLADims, new_tokens: int, prefix_tokens: int, causal_pairs: int) -> str:
    """'expand' or 'absorb' for the prefill part of a step: expand iff
        FLOPs_expand < ABSORB_SLOWDOWN * FLOPs_absorb        (prefill_costs).
    A fresh prefill (P = 0) always expands (2R+Dr > Dn+Dr+Dv for every MLA model). A chunk of T new
    tokens on a long prefix P (pairs ~ T·P) expands iff T > R(Dn+Dv) / (k(2R+Dr) - (Dn+Dr+Dv)) with
    k = ABSORB_SLOWDOWN: 45 tokens for DeepSeek-V3, 33 Mistral-Small-4, 83 GLM-4.7-Flash, 22 MiniCPM3
    (171 / 154 / 398 / 85 on raw FLOPs, k = 1). Decode-like chunks stay absorbed: expanding a long
    prefix for a few queries is mostly the kv_b_proj GEMM over the whole history.
    """
    if not expansion_supported(dims):
        return "absorb"
    expand, absorb = prefill_costs(dims, new_tokens, prefix_tokens, causal_pairs)
    return "expand" if expand < ABSORB_SLOWDOWN * absorb else "absorb"


# ----------------------------------------------------------------------------- launch configs
@dataclass(frozen=True)
class AbsorbedConfig:
    block_h: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int
    heads_on_n: bool = False  # absorbed_attn_heads_on_n_kernel (decode) instead of absorbed_attn_kernel
    tma: bool = False  # whole one-page KV tiles by tensor descriptor (heads_on_n; the launcher checks SM90+)
    warp_spec: bool = False  # heads_on_n: the whole-tile loop warp-specialised (Triton's SM90 autoWS)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Split-K policy of the heads-on-M kernel (heads-on-N: split_plan_waves): split a launch until it
#: has about this many programs per SM ...
SPLIT_PROGRAMS_PER_SM = 4
#: ... but never into chunks shorter than this many kv positions (per-chunk overhead + reduce).
#: H200 sweep: B=1 kv=8192 best at 64 splits, B=8 kv=2048 at 16 (docs/benchmarks/mla_kernels.md).
MIN_SPLIT_CHUNK = 128


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: a few programs, so split-K paths get exercised on CPU too
    return SPLIT_PROGRAMS_PER_SM * num_sms(device)


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heavy_first: bool = True  # a head's query blocks from the last: the longest causal blocks start first
    split_nope: bool = True  # Dn not a power of two (GLM 192): two exact chunks (128 + 64), not one padded to 256
    tma: bool = False  # K/V tiles by tensor descriptor (SM90+; the op checks alignment)


def nope_chunks(dn: int, split: bool = True) -> tuple[int, int]:
    """(BLOCK_DN, BLOCK_DN2) of the expanded prefill kernel: Dn as one power-of-two tile, or (split and
    Dn not a power of two) the largest power of two below it plus a second tile for the rest."""
    if not split or dn & (dn - 1) == 0 or dn < 32:  # tl.dot tiles are >= 16 wide
        return pow2(dn), 0
    hi = 1 << (dn.bit_length() - 1)
    return hi, pow2(dn - hi)


#: Smallest latent width of the heads-on-N kernel: its two latent chunks are tl.dot operands (>= 16).
MIN_HEADS_ON_N_RANK = 32


def heads_on_n_supported(dims: MLADims) -> bool:
    return dims.kv_lora_rank >= MIN_HEADS_ON_N_RANK


def decode_config(dims: MLADims, dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None,
                  layout: str = "auto") -> AbsorbedConfig:
    """Launch config of one decode launch (one query token per sequence).

    Heads on the MMA's N side (absorbed_attn_heads_on_n_kernel) for N <= 32 and N > 64, heads on M
    (absorbed_attn_kernel) for 32 < N <= 64: the H200 A/B of 2026-11-24 with the wave split plan
    (docs/benchmarks/mla_kernels.md, "heads on M / heads on N" columns) measured heads-on-N at
    0.75-0.97x the time of heads-on-M at N 16, 0.56-0.93x at N 20, 0.62-1.0x at N 32 (R 256) and
    0.54-0.98x at N 128 (two 64-head column blocks), but 0.91-1.54x at N 64 and 0.84-1.16x at
    N 40 (one 64-wide block: no gain from the transposed products, and its 64x64 score tile spills
    less on heads-on-M). An e4m3 cache takes heads-on-N with fp16 MMAs up to 32 heads (1.6x the
    heads-on-M speed at N 16) and heads-on-M above (N 128: 1.14x faster). The heads-on-M kernel also
    serves R < 32 and the FP8_DOT policy. 64-token tiles (by TMA on a 16-bit cache); heads-on-N
    split counts from split_plan_waves. BLOCK_H 64 lets Triton use Hopper wgmma for many heads;
    16/32 keep the wasted rows of small N low. `layout` forces "heads_on_m" / "heads_on_n"
    (TritonPolicy.decode_layout; heads_on_n only where R >= 32)."""
    n, r = dims.num_heads, dims.kv_lora_rank
    fp8 = cache_dtype is not None and cache_dtype.itemsize == 1
    if layout == "auto":
        layout = "heads_on_n" if (n <= 32 or (n > 64 and not fp8)) else "heads_on_m"
    if layout == "heads_on_n" and heads_on_n_supported(dims):
        if n > 64:
            return AbsorbedConfig(64, 1, 64, 8, 2, heads_on_n=True, tma=not fp8)
        if fp8 and r > 256:  # e4m3 tiles by pointer (TMA measured no faster); 8 warps from 32 heads
            return AbsorbedConfig(pow2(n), 1, 64, 4 if n <= 16 else 8, 2, heads_on_n=True)
        return AbsorbedConfig(min(64, pow2(n)), 1, 64, 4, 2, heads_on_n=True, tma=True)
    if r > 256:
        if n > 32:
            return AbsorbedConfig(64, 1, 32, 8, 3)
        if n <= 16:
            return AbsorbedConfig(16, 1, 64, 8, 3)
        return AbsorbedConfig(32, 1, 64, 8, 3)
    if n <= 16:
        return AbsorbedConfig(16, 1, 64, 8, 2)
    if n <= 32:
        return AbsorbedConfig(32, 1, 64, 8, 2)
    return AbsorbedConfig(64, 1, 64, 8, 2)


#: Shortest prefill (new tokens of the step's longest prefill sequence) whose expanded attention runs
#: on FlashInfer's FA3 under TritonPolicy.prefill_attention="auto". H200, one sequence, whole op's
#: device time FA3 / own kernel, K and q packed by pack_heads_kernel (docs/benchmarks/fi_ragged_prefill.md,
#: 2026-11-26 later): N 16 (qk 192 / vo 128) 1.09x at 512, 0.92x at 1024, 0.87x at 2048, 0.73x at 4096;
#: GLM-4.7-Flash (256 / 256) 0.94x, 0.92x, 0.84x, 0.79x. 1024 is the first measured length where
#: the op wins for both (with four torch copies instead of the pack kernel it was 4096).
FA3_PREFILL_MIN_TOKENS = 1024

#: Longest query run per sequence served as multi-token decode (speculative-decoding verification:
#: a few draft tokens + 1 on a cached history) by the decode kernel's query columns.
MULTI_TOKEN_MAX_Q = 16


def multi_token_config(decode: AbsorbedConfig, max_q: int, kv_lora_rank: int) -> AbsorbedConfig:
    """The heads-on-N decode config widened to BLOCK_Q query tokens per program (columns = BLOCK_Q x
    BLOCK_H <= 64, the decode kernel's widest column block): every query token of a sequence reads
    each KV tile once per program, causal among the new tokens by per-column limits. 8 warps once
    the block is 64 columns wide over a latent wider than 256 (its two fp32 [R/2, 64] accumulators):
    H200 sweep (benchmarks/bench_multi_token.py, docs/benchmarks/multi_token.md) — N 16 q 4:
    51.8 us at 8 warps vs 88.9 at 4; N 16 q 2 (32 columns): 74.7 at 4 vs 91.1 at 8; Mistral R 256 at
    64 columns: 4 warps best (44.3 vs 49.5 us). This rule picks the faster of the two on all 16 rows."""
    block_q = max(1, min(1 << (max(1, max_q) - 1).bit_length(), 64 // decode.block_h))
    warps = 8 if (block_q * decode.block_h >= 64 and kv_lora_rank > 256) else decode.num_warps
    return AbsorbedConfig(decode.block_h, block_q, decode.block_n, warps, decode.num_stages,
                          heads_on_n=decode.heads_on_n, tma=decode.tma)


def absorb_prefill_config(dims: MLADims, dtype: torch.dtype) -> AbsorbedConfig:
    """BLOCK_Q query tokens x BLOCK_H heads (64 rows) per program: every row shares each KV tile."""
    block_h = min(pow2(dims.num_heads), 64)
    return AbsorbedConfig(block_h, 64 // block_h, 32, 8, 2)


def expand_config(dims: MLADims, dtype: torch.dtype, programs_at_128: Optional[int] = None,
                  sms: int = EMULATED_SM_COUNT) -> ExpandConfig:
    """FlashAttention tiles for the expanded prefill (H200 sweep, T=2048). `programs_at_128`: the
    grid size with 128-query blocks; below one wave (short prefills of few heads, e.g. GLM T=128:
    20 programs) use 64-query blocks, which double the programs."""
    dmax = max(pow2(dims.qk_nope_head_dim), pow2(dims.v_head_dim))
    small = programs_at_128 is not None and programs_at_128 < sms
    # 2026-11-24 A/B (benchmarks/bench_expand_prefill.py, H200, T=2048, whole op): K/V by TMA descriptor
    # with these tiles 114.7 us (N 16, was 137.9 before this sweep) and 203.5 us (GLM, was 243.4)
    if dmax <= 128:
        return ExpandConfig(64, 64, 4, 2) if small else ExpandConfig(64, 64, 4, 2, tma=True)
    return ExpandConfig(64, 32, 4, 3) if small else ExpandConfig(128, 64, 8, 2, tma=True)


def split_plan(progs: int, kv_bound: int, block_n: int, forced: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, chunk) covering kv positions [0, kv_bound) in `num_splits` chunks of `chunk` (a
    multiple of block_n, so every chunk starts on a tile)."""
    kv_bound = max(1, kv_bound)
    if forced > 0:
        splits = forced
    else:
        splits = min(-(-_target_programs(device) // max(1, progs)), -(-kv_bound // min_chunk(device)))
    splits = max(1, min(splits, -(-kv_bound // block_n)))
    chunk = -(-(-(-kv_bound // splits)) // block_n) * block_n
    return -(-kv_bound // chunk), chunk


#: Shared memory per SM where the device cannot say (H100/H200: 228 KB).
DEFAULT_SMEM_PER_SM = 228 * 1024


@functools.lru_cache(maxsize=None)
def _smem_per_sm(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 0) or DEFAULT_SMEM_PER_SM)


def resident_programs(cfg: AbsorbedConfig, dims: MLADims, cache_itemsize: int, device: torch.device) -> int:
    """How many programs of a heads-on-N launch one SM runs at once: its pipelined KV tiles (stages x
    BLOCK_N x padded row, cache bytes) and query operand in shared memory, and at most 64 warps."""
    row = 2 * max(16, pow2(dims.kv_lora_rank) // 2) + (pow2(dims.qk_rope_head_dim) if dims.qk_rope_head_dim else 0)
    smem = cfg.num_stages * cfg.block_n * row * cache_itemsize + row * cfg.block_h * cfg.block_q * 2
    have = _smem_per_sm(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else DEFAULT_SMEM_PER_SM
    return max(1, min(have // smem, 64 // cfg.num_warps))


@functools.lru_cache(maxsize=4096)  # called per op call in eager steps: one search per distinct shape
def split_plan_waves(progs: int, kv_bound: int, block_n: int, forced: int, device: torch.device, slots: int,
                     partial_tiles: float, split_fixed_tiles: float = 0.0) -> tuple[int, int]:
    """split_plan for the heads-on-N decode: the split count that minimises a wave model of the launch,
        ceil(programs x splits / slots) x (tiles per chunk + partial_tiles if split) + split_fixed_tiles if split,
    where slots = SMs x resident_programs (programs finish in waves; a fifth split that adds a third
    wave costs more than it saves: H200, GLM B64 kv8192, 4 splits 230 us vs 5 splits 268 us),
    partial_tiles = the fp32 partial output a split program writes and the reduce reads, in KV-tile
    bytes (at N 128 it is more than a tile), and split_fixed_tiles = what splitting costs once (the
    merge launch), in tile times. Ties go to fewer splits. CPU: split_plan (the interpreter targets a
    few programs so split paths run in tests)."""
    if forced > 0 or device.type != "cuda":
        return split_plan(progs, kv_bound, block_n, forced, device)
    kv_bound = max(1, kv_bound)
    tiles = -(-kv_bound // block_n)
    best = None
    for want in range(1, min(tiles, -(-kv_bound // min_chunk(device)), 256) + 1):
        chunk = -(-tiles // want) * block_n
        splits = -(-kv_bound // chunk)
        waves = -(-(max(1, progs) * splits) // max(1, slots))
        cost = waves * (chunk // block_n + (partial_tiles if splits > 1 else 0.0)) + \
            (split_fixed_tiles if splits > 1 else 0.0)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, splits, chunk)
    return best[1], best[2]


def min_chunk(device: torch.device) -> int:
    return MIN_SPLIT_CHUNK if device.type == "cuda" else 4


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; the emulated count under the interpreter (CPU)."""
    if device.type != "cuda":
        return EMULATED_SM_COUNT
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------- the DSA indexer's scores
@dataclass(frozen=True)
class IndexScoresConfig:
    """Launch config of `index_scores_kernel`: heads per MMA, keys per tile, tiles per program."""

    block_h: int
    block_n: int
    kv_iters: int
    num_warps: int
    num_stages: int


def index_scores_config(heads: int, dim: int, dtype: torch.dtype, compiled: bool) -> IndexScoresConfig:
    """The config for `heads` index heads of width `dim` over a `dtype` index cache. The interpreter
    (CPU tests) gets small tiles and one tile per program, so the masks at every edge are exercised.
    16-bit caches: the H200 sweep `python -m benchmarks.kernels.sweep_index_scores` (2026-11-29, 9b71c1d;
    DeepSeek-V3.2 indexer, 64 heads x 128, bf16, batch 64 x 32k, docs/benchmarks/index_scores_sweep.md):
    16 heads per MMA, 128-key tiles, one tile per program, 4 warps, 2 stages: 233 us = 1.81x the byte
    floor (keys read once + scores written), against 304 us for 64 x 64 x 2 tiles and ~375 us for the
    16 x 32 tiles it replaced; more tiles per program or 8 warps were slower at every tile size."""
    if not compiled:
        return IndexScoresConfig(block_h=16, block_n=32, kv_iters=1, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return IndexScoresConfig(block_h=16, block_n=32, kv_iters=1, num_warps=4, num_stages=2)
    return IndexScoresConfig(block_h=16, block_n=128, kv_iters=1, num_warps=4, num_stages=2)
