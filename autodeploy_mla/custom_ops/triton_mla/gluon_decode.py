"""Warp-specialised heads-on-N decode kernel for SM90, written in Gluon (issue 14, item 2).

Why: the `tl` heads-on-N kernel (kernels.absorbed_attn_heads_on_n_kernel) runs the tile loads and the
QK -> softmax -> PV chain in the same warps, so with its two KV buffers one tile's load latency is paid
per tile (N <= 32 stops at 64-75% of HBM bandwidth, docs/benchmarks/decode_pipeline.md), and Triton
3.6's automatic warp specialisation does not split that loop (docs/benchmarks/decode_ws.md). Here the
roles are explicit: one loader warp issues the TMA copies of each KV tile (page id -> cache row) into a
ring of STAGES buffers as soon as a buffer is free, and one consumer warpgroup computes, so loads of
the next tiles are always in flight while a tile is computed.

Layout per program (head block x sequence x split chunk), heads on the MMA's N side (COLS columns):
  s^T [BLOCK_N, COLS]  = KV[:, :C] q^T[:C] + KV[:, C:] q^T[C:] + KPE q_pe^T      (3 wgmmas, A = cache tile)
  o^T [C, COLS] (x2)  += KV[:, half]^T p^T                                      (2 wgmmas, A = tile^T)
with C = R / 2 (a wgmma operand is at most 256 wide; the compiler issues each half as 64-column TMA
boxes, the widest a 128-byte swizzle takes). The row sum of p is accumulated
per element and reduced once at the end; only the running max is reduced per tile.

Scope (the capability check in `supports` says so): bf16/fp16 cache and queries, one query token per
sequence (decode), R in {256, 512}, Dr == 64, pages holding whole 64-token tiles, COLS <= 32.
More heads (N > 32, R 512) run `gluon_decode_wide.py` (64 heads per program on the MMA's M side, two
consumer warpgroups): the configs, plan, arguments and launch here serve both (`GluonDecodeConfig.wide`).
Outputs are those of the `tl` kernel: the latent (one split) or normalised fp32 partials plus base-2
log-sum-exp per split, merged by kernels.split_reduce_kernel (or, for the many-heads kernel's large
batches, split_reduce_heads_kernel: op._reduce_heads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .gluon_common import _GLUON_ERROR, BLOCK_N

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_common import (
        _alloc_queries,
        _alloc_ring,
        _cta_barrier,
        _empty_split_lse,
        _loader,
        _store_queries,
        _work_item,
        _zero_rows,
    )

NUM_WARPS = 4
SMEM_LIMIT = 232448


#: Above this many heads a program takes 64 heads on the MMA's M side (gluon_decode_wide.py).
NARROW_MAX_HEADS = 32
WIDE_HEADS = 64


@dataclass(frozen=True)
class GluonDecodeConfig:
    """Launch constants: COLS head columns per program (16 or 32), STAGES KV buffers, and whether the
    epilogue changes the output's layout through shared memory before storing (whole-line stores;
    off saves that scratch, which can let two programs share an SM). `wide`: the many-heads kernel
    (gluon_decode_wide.py; cols = 64 heads, 2 stages, 12 warps)."""

    cols: int
    stages: int
    convert: bool = True
    maxnreg: int = 224  # registers per thread at launch: 8 warps x 224 leave room for one program per SM
    wide: bool = False


#: 12 warps x 168 registers at launch fill the register file; setmaxnreg gives WG0 256, WG1 200, the loader 40.
WIDE_CONFIG = GluonDecodeConfig(WIDE_HEADS, 2, convert=False, maxnreg=168, wide=True)
#: What splitting costs the many-heads kernel once (the merge launch, the partials' write latency), in
#: ~1.9 us tile times. Measured (H200, N 128): batch 32 x kv 512 takes 26.5 us in one split and 29.4 us
#: in two, where the wave model without this term picked two; batch 32 x kv 2048, 72.7 vs 52.4 us.
WIDE_SPLIT_FIXED_TILES = 2.0


def smem_bytes(r: int, dr: int, cols: int, stages: int, convert: bool = True) -> int:
    """Shared memory of one program: the KV ring, the queries and p^T (bf16), the epilogue's layout
    change of one fp32 output half, barriers."""
    tile = BLOCK_N * (r + dr) * 2
    return stages * tile + cols * (r + dr) * 2 + cols * BLOCK_N * 2 + (cols * r // 2 * 4 if convert else 0) \
        + 16 * stages + 1024


def config_smem(r: int, dr: int, cfg: GluonDecodeConfig) -> int:
    """Shared memory one program of `cfg` plans for. The wide kernel: queries [64, R + Dr] and the KV
    ring (bf16), the published maxima and row sums (fp32), barriers."""
    if not cfg.wide:
        return smem_bytes(r, dr, cfg.cols, cfg.stages, cfg.convert)
    return cfg.cols * (r + dr) * 2 + cfg.stages * BLOCK_N * (r + dr) * 2 + (cfg.stages + 1) * cfg.cols * 4 + 1024


#: Shared memory of one SM (H100 / H200); one program may use at most SMEM_LIMIT of it.
SMEM_PER_SM = 233472


def resident_programs(r: int, dr: int, cfg: "GluonDecodeConfig") -> int:
    """Programs one SM holds at once: shared memory, and the register file (65536 registers; a program
    is 8 warps, the consumer warpgroup and the loader padded to a warpgroup, or 12 for the wide kernel,
    at `maxnreg` each)."""
    threads = 384 if cfg.wide else 256
    return max(1, min(SMEM_PER_SM // config_smem(r, dr, cfg), 65536 // (threads * cfg.maxnreg)))


def dims_supported(num_heads: int, r: int, dr: int, page_size: int, dtype: torch.dtype,
                   sm: Optional[int]) -> tuple[bool, str]:
    """Whether the Gluon decode kernel serves these dims, model dtype and compute capability (SM as
    90 for 9.0; None: not a CUDA device), and why not. The cache dtype and device are `supports`'s."""
    if _GLUON_ERROR is not None:
        return False, f"gluon unavailable ({_GLUON_ERROR})"
    if sm is None or sm // 10 != 9:
        where = f"SM{sm}" if sm else "not CUDA"
        return False, f"gluon decode is written for SM90 (wgmma + TMA), device is {where}"
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"gluon decode runs bf16/fp16 queries and caches, model dtype is {dtype}"
    if r not in (256, 512) or dr != 64:
        return False, f"gluon decode needs R in (256, 512) and Dr == 64, got R={r} Dr={dr}"
    if page_size % BLOCK_N:
        return False, f"gluon decode needs pages of whole {BLOCK_N}-token tiles, page size is {page_size}"
    if num_heads > NARROW_MAX_HEADS and r != 512:
        return False, (f"gluon decode of N > {NARROW_MAX_HEADS} heads (64 per program) is built and verified "
                       f"for R = 512, got N={num_heads} R={r}")
    return True, "ok"


def supports(num_heads: int, r: int, dr: int, page_size: int, q_dtype: torch.dtype, cache_dtype: torch.dtype,
             device: torch.device) -> tuple[bool, str]:
    """Whether the Gluon decode kernel serves this decode (dims, query and cache dtypes, device), and
    why not."""
    if device.type != "cuda":
        return False, "gluon decode runs on CUDA only"
    major, minor = torch.cuda.get_device_capability(device)
    if cache_dtype != q_dtype:
        return False, f"gluon decode needs a cache in the query dtype, got {cache_dtype} / {q_dtype}"
    return dims_supported(num_heads, r, dr, page_size, q_dtype, major * 10 + minor)


def candidate_configs(num_heads: int, r: int, dr: int) -> tuple[GluonDecodeConfig, ...]:
    """The configs `config_for` may return for these dims (all are compiled before a graph capture):
    one program per SM with as many KV stages as shared memory holds (at most 4; R 512 holds 2), and,
    where two programs fit an SM (2 stages, no epilogue layout change, 128 registers at launch: R 256),
    that one too. COLS = heads rounded up to 16 or 32. N > 32: the wide kernel's one config."""
    if num_heads > NARROW_MAX_HEADS:
        return (WIDE_CONFIG,)
    cols = 16 if num_heads <= 16 else 32
    stages = 4
    while stages > 2 and smem_bytes(r, dr, cols, stages) > SMEM_LIMIT:
        stages -= 1
    one = GluonDecodeConfig(cols, stages)
    two = GluonDecodeConfig(cols, 2, convert=False, maxnreg=128)
    return (one, two) if resident_programs(r, dr, two) >= 2 else (one,)


def config_for(num_heads: int, r: int, dr: int, programs: int, sms: int) -> GluonDecodeConfig:
    """Two programs per SM where they fit and the launch's `programs` (sequences x head blocks, before
    splits) fill at most half the `sms`; else one. H200, Mistral-Small-4 dims (N 32, R 256), decode
    core, two per SM vs one with 4 stages (docs/benchmarks/decode_gluon.md): batch 1-8 0.97-0.98x the
    time, B64 x kv4096 61.6 vs 63.6 us, but B128 x kv2048 63.0 vs 60.3 and B128 x kv8192 175.1 vs 170.3
    (two per SM needs 2 splits to fill the SMs there, one per SM none)."""
    cands = candidate_configs(num_heads, r, dr)
    if len(cands) > 1 and 2 * programs <= sms:
        return cands[1]
    return cands[0]


def plan(num_heads: int, r: int, dr: int, n_seqs: int, kv_bound: int, forced_splits: int, device: torch.device,
         cfg: Optional[GluonDecodeConfig] = None) -> tuple[GluonDecodeConfig, int]:
    """(config, split count) of one launch over `n_seqs` decode sequences of at most `kv_bound` tokens:
    `config_for` (unless `cfg` is given) and `tuning.split_plan_waves` over the programs an SM holds,
    the fp32 partials a split writes counted in KV-tile bytes. `forced_splits` > 0 fixes the count."""
    from .tuning import num_sms, split_plan_waves

    programs = n_seqs * -(-num_heads // candidate_configs(num_heads, r, dr)[0].cols)
    cfg = cfg or config_for(num_heads, r, dr, programs, num_sms(device))
    partial = cfg.cols * r * 8 / (BLOCK_N * (r + dr) * 2)
    splits, _ = split_plan_waves(programs, kv_bound, BLOCK_N, forced_splits, device,
                                 num_sms(device) * resident_programs(r, dr, cfg), partial,
                                 WIDE_SPLIT_FIXED_TILES if cfg.wide else 0.0)
    return cfg, splits


if _GLUON_ERROR is None:

    @gluon.jit
    def _consumer(q0_s, q1_s, qpe_s, p_s, kv0_s, kv1_s, kpe_s, full, empty, kv_lo, kv_hi, n_tiles, qk_scale,
                  Q_ABS, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, q_off, lat_off, pid_s,
                  stride_qa_h, stride_qp_t, stride_qp_h,
                  stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
                  N: gl.constexpr, BLOCK_C: gl.constexpr, DR: gl.constexpr, COLS: gl.constexpr,
                  BN: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, CONVERT: gl.constexpr):
        # Queries -> shared memory as [COLS, K] (the wgmma B operand, K-major), zero past N. Here, not
        # before the fork, so the loader's first copies do not wait for these loads.
        _store_queries(q0_s, q1_s, qpe_s, Q_ABS, Q_PE, head0, tok, q_off, stride_qa_h, stride_qp_t, stride_qp_h,
                       N, BLOCK_C, DR, COLS)

        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])
        col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        acc0 = gl.zeros([BLOCK_C, COLS], gl.float32, acc_l)
        acc1 = gl.zeros([BLOCK_C, COLS], gl.float32, acc_l)
        lacc = gl.zeros([BN, COLS], gl.float32, acc_l)
        m_i = gl.full([COLS], float("-inf"), gl.float32, col_l)
        offs_n = gl.arange(0, BN, layout=row_l)
        for t in range(n_tiles):
            s = t % STAGES
            ph = (t // STAGES) & 1
            mbarrier.wait(full.index(s), ph)
            start = kv_lo + t * BN
            valid = kv_hi - start
            if valid < BN:  # the chunk's last, partial tile
                _zero_rows(kv0_s.index(s), valid, BLOCK_C, BN, 64)
                _zero_rows(kv1_s.index(s), valid, BLOCK_C, BN, 64)
                _zero_rows(kpe_s.index(s), valid, DR, BN, 64)
                fence_async_shared()
                _cta_barrier()
            sT = warpgroup_mma(kv0_s.index(s), q0_s.permute((1, 0)), gl.zeros([BN, COLS], gl.float32, acc_l),
                               use_acc=False, is_async=True)
            sT = warpgroup_mma(kv1_s.index(s), q1_s.permute((1, 0)), sT, is_async=True)
            sT = warpgroup_mma(kpe_s.index(s), qpe_s.permute((1, 0)), sT, is_async=True)
            sT = warpgroup_mma_wait(num_outstanding=0, deps=[sT])
            sT = sT * qk_scale
            sT = gl.where((offs_n < valid)[:, None], sT, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sT, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(sT - m_safe[None, :])
            alpha = gl.exp2(m_i - m_safe)
            lacc = lacc * alpha[None, :] + p
            m_i = m_new
            p_s.store(gl.permute(p.to(p_s.dtype), (1, 0)))
            fence_async_shared()
            _cta_barrier()
            acc0 = warpgroup_mma(kv0_s.index(s).permute((1, 0)), p_s.permute((1, 0)), acc0 * alpha[None, :],
                                 is_async=True)
            acc1 = warpgroup_mma(kv1_s.index(s).permute((1, 0)), p_s.permute((1, 0)), acc1 * alpha[None, :],
                                 is_async=True)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=[acc0, acc1])
            mbarrier.arrive(empty.index(s), count=1)

        l_i = gl.sum(lacc, axis=0)
        has = l_i > 0.0
        inv = 1.0 / gl.where(has, l_i, 1.0)
        # The accumulator's layout gives each thread two adjacent heads, whose outputs are R elements
        # apart: stored as it is, every 4-byte element is its own 32-byte sector write. A layout with
        # R contiguous per warp (through shared memory) makes the stores whole lines.
        if CONVERT:
            out_l: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        else:
            out_l: gl.constexpr = acc_l
        out0 = gl.convert_layout(acc0 * inv[None, :], out_l)
        out1 = gl.convert_layout(acc1 * inv[None, :], out_l)
        head = head0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, out_l))
        ok = (head < N)[None, :]
        offs_r = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, out_l))[:, None]
        if SPLIT:
            pa = PART_ACC + rel * stride_pa_t + head[None, :] * stride_pa_h + pid_s * stride_pa_s + offs_r
            gl.store(pa, out0, mask=ok)
            gl.store(pa + BLOCK_C, out1, mask=ok)
            hc = head0 + gl.arange(0, COLS, layout=col_l)
            lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
            gl.store(PART_LSE + rel * stride_pl_t + hc * stride_pl_h + pid_s, lse, mask=hc < N)
        else:
            la = LATENT + head[None, :] * stride_lat_h + lat_off + offs_r
            gl.store(la, out0.to(LATENT.dtype.element_ty), mask=ok)
            gl.store(la + BLOCK_C, out1.to(LATENT.dtype.element_ty), mask=ok)

    # The bases and the chunk size change from step to step (where a step's decode rows start among
    # its tokens), and so do the LSE partials' strides (the split count): specialising on their
    # divisibility would compile new variants while serving.
    @gluon.jit(do_not_specialize=["seq_base", "tok_base", "abs_base", "chunk_size", "stride_pl_t", "stride_pl_h"])
    def gluon_decode_kernel(
        kv_desc, kpe_desc, Q_ABS, Q_PE, PAGE_TABLE, CU_SEQLEN, SEQ_LEN, LATENT, PART_ACC, PART_LSE,
        seq_base, tok_base, abs_base, chunk_size, qk_scale,
        stride_qa_h, stride_qa_t, stride_qp_t, stride_qp_h, stride_pt_b,
        stride_lat_h, stride_lat_t, stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
        N: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, PAGE_SIZE: gl.constexpr, COLS: gl.constexpr,
        STAGES: gl.constexpr, SPLIT: gl.constexpr, CONVERT: gl.constexpr = True,
    ):
        # Grid: (head blocks, decode sequences, splits); one query token per sequence.
        BN: gl.constexpr = 64
        BLOCK_C: gl.constexpr = R // 2
        hb = gl.program_id(0)
        b, pid_s, tok, kv_limit, kv_lo, kv_hi = _work_item(CU_SEQLEN, SEQ_LEN, seq_base, chunk_size, BN)
        head0 = hb * COLS
        rel = tok - tok_base  # the token's row among the partials
        if SPLIT:
            if kv_lo >= kv_limit:  # a static split count and a shorter sequence: lse = -inf only
                _empty_split_lse(PART_LSE, rel, head0, pid_s, stride_pl_t, stride_pl_h, N, COLS)
                return
        n_tiles = gl.cdiv(kv_hi - kv_lo, BN)

        dt: gl.constexpr = Q_ABS.dtype.element_ty
        q0_s, q1_s, qpe_s = _alloc_queries(dt, COLS, BLOCK_C, DR)
        p_s = gl.allocate_shared_memory(dt, [COLS, BN], gl.NVMMASharedLayout.get_default_for([COLS, BN], dt))
        kv0_s, kv1_s, kpe_s, full, empty = _alloc_ring(dt, kv_desc, kpe_desc, STAGES, BN, BLOCK_C, DR)
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        pt_row = PAGE_TABLE + b.to(gl.int64) * stride_pt_b

        gl.warp_specialize(
            [(_consumer, (q0_s, q1_s, qpe_s, p_s, kv0_s, kv1_s, kpe_s, full, empty, kv_lo, kv_hi, n_tiles, qk_scale,
                          Q_ABS, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, (tok - abs_base) * stride_qa_t,
                          (tok - abs_base) * stride_lat_t, pid_s,
                          stride_qa_h, stride_qp_t, stride_qp_h, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s,
                          stride_pl_t, stride_pl_h,
                          N, BLOCK_C, DR, COLS, BN, STAGES, SPLIT, CONVERT)),
             (_loader, (kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full, empty, pt_row, kv_lo, n_tiles,
                        PAGE_SIZE, BLOCK_C, R, DR, BN, STAGES))],
            [1], [40])  # one loader warp; its register budget (setmaxnreg)


def cache_descriptors(mla_cache: torch.Tensor, r: int, dr: int):
    """TMA descriptors of one layer's cache viewed as [pages * page_size, R + Dr] rows: the latent in
    two [64, R/2] halves and the rope part as one [64, Dr] box (16-bit elements). None where the rows
    are not 16-byte aligned (TMA needs aligned bases and strides)."""
    flat = mla_cache.view(-1, mla_cache.shape[-1])
    if (flat.stride(0) * flat.element_size()) % 16 or flat.data_ptr() % 16:
        return None
    gdt = gl.bfloat16 if flat.dtype == torch.bfloat16 else gl.float16
    kv_box, kpe_box = [BLOCK_N, r // 2], [BLOCK_N, dr]
    kv = TensorDescriptor.from_tensor(flat, kv_box, gl.NVMMASharedLayout.get_default_for(kv_box, gdt))
    kpe = TensorDescriptor.from_tensor(flat, kpe_box, gl.NVMMASharedLayout.get_default_for(kpe_box, gdt))
    return kv, kpe


def query_descriptor(q_abs: torch.Tensor, heads: int):
    """TMA descriptor of the latent queries for the many-heads kernel: q_abs [N, T, R] viewed as
    [N, T * R] rows, [heads, R/2] boxes (rows past N read as zero). None where the token rows are not
    contiguous or not 16-byte aligned (the kernel is then not launched)."""
    n, t, r = q_abs.shape
    if (q_abs.stride(2) != 1 or q_abs.stride(1) != r or (q_abs.stride(0) * q_abs.element_size()) % 16
            or q_abs.data_ptr() % 16 or t * r >= 2**31):
        return None
    box = [heads, r // 2]
    return TensorDescriptor(q_abs, [n, t * r], [q_abs.stride(0), 1], box, _box_layout(heads, r // 2, q_abs.dtype))


@functools.lru_cache(maxsize=16)
def _box_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared layout of a [rows, cols] 16-bit TMA box (constant per shape: computing it costs
    ~5 us of host time per call)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def kernel_for(cfg: GluonDecodeConfig):
    """The @gluon.jit kernel a config launches."""
    if cfg.wide:
        from .gluon_decode_wide import gluon_decode_wide_kernel

        return gluon_decode_wide_kernel
    return gluon_decode_kernel


def kernel_meta(num_heads: int, r: int, dr: int, page_size: int, cfg: GluonDecodeConfig, split: bool) -> dict:
    """Constexprs and launch options of one variant (SPLIT writes partials, else the latent)."""
    if cfg.wide:
        from .gluon_decode_wide import wide_meta

        return wide_meta(num_heads, r, dr, page_size, split, cfg.cols, cfg.maxnreg)
    return dict(N=num_heads, R=r, DR=dr, PAGE_SIZE=page_size, COLS=cfg.cols, STAGES=cfg.stages, SPLIT=split,
                CONVERT=cfg.convert,
                num_warps=NUM_WARPS, maxnreg=cfg.maxnreg)


def kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse, *, seq_base: int,
                tok_base: int, abs_base: int, chunk: int, qk_scale: float, split: bool, q_desc=None):
    """(pointer-like arguments, scalar arguments) of gluon_decode_kernel, in signature order, or of
    gluon_decode_wide_kernel with `q_desc` (`query_descriptor(q_abs)`), its third argument.
    q_abs / latent are [N, T, R] views (head stride first), q_pe is [1, T, N, Dr]; part_acc
    [T', N, S, R] / part_lse [T', N, S] are indexed by token - tok_base (unused unless split)."""
    pa = part_acc.stride()[:3] if split else (0, 0, 0)
    pl = part_lse.stride()[:2] if split else (0, 0)
    ptrs = (descs[0], descs[1], *(() if q_desc is None else (q_desc,)), q_abs, q_pe, page_table, cu_seqlen, seq_len,
            latent, part_acc, part_lse)
    scalars = (seq_base, tok_base, abs_base, chunk, qk_scale, q_abs.stride(0), q_abs.stride(1), q_pe.stride(1),
               q_pe.stride(2), page_table.stride(0), latent.stride(0), latent.stride(1), *pa, *pl)
    return ptrs, scalars


def grid(num_heads: int, n_seqs: int, splits: int, cfg: GluonDecodeConfig) -> tuple[int, int, int]:
    return (-(-num_heads // cfg.cols), n_seqs, splits)


def launch(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse, *, n_seqs: int,
           seq_base: int, tok_base: int, abs_base: int, splits: int, chunk: int, qk_scale: float, num_heads: int,
           r: int, dr: int, page_size: int, cfg: GluonDecodeConfig) -> None:
    """One launch through Triton's JIT launcher (tests, benchmarks; the op launches a BoundKernel).
    `splits` > 1 writes part_acc / part_lse (merged by split_reduce_kernel); 1 writes the latent."""
    split = splits > 1
    q_desc = None
    if cfg.wide:
        q_desc = query_descriptor(q_abs, cfg.cols)
        if q_desc is None:
            raise ValueError(f"q_abs {tuple(q_abs.shape)} strides {q_abs.stride()}: the many-heads kernel needs "
                             "contiguous, 16-byte aligned token rows (a torch.bmm output)")
    ptrs, scalars = kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse,
                                seq_base=seq_base, tok_base=tok_base, abs_base=abs_base, chunk=chunk,
                                qk_scale=qk_scale, split=split, q_desc=q_desc)
    kernel_for(cfg)[grid(num_heads, n_seqs, splits, cfg)](
        *ptrs, *scalars, **kernel_meta(num_heads, r, dr, page_size, cfg, split))
