"""Warp-specialised Gluon decode for many heads (N > 32: DeepSeek-V3 N 128, TP-2 N 64), SM90. WIP.

STATUS: written and compile-checked on CPU (triton 3.6 and 3.9: 12 warps, 230976 B of shared memory,
68 wgmmas, 9 TMA copies per tile, <= 8 B of spills at WG1_REGS 200); NOT YET RUN ON A GPU. Not wired
into the op: `tests/test_gluon_decode.py::test_gpu_gluon_wide_matches_oracle` and the
`sweep_decode_ws.py` variant `gluon_wide` are the first things to run.

Why: N = 128 decode is compute-bound and the `tl` heads-on-N kernel reaches 219 TFLOP/s (issue 14
asks >= 450; FlashInfer's fa3 does ~584). Layout per program: 64 heads on the MMA's N side.
- WG0 (default partition, 4 warps) loads the queries, computes s^T = KV q^T over the whole 576-wide
  row (36 k-steps), the softmax, writes p^T and the tile's rescale factor to shared memory (signals
  p_ready), then its half of o^T: acc0 += KV[:, :R/2]^T p^T.
- WG1 (worker, 4 warps) waits for p_ready, acc1 += KV[:, R/2:]^T p^T with the same rescale, signals
  p_free (WG0 may overwrite p^T and the factor).
- A loader warp feeds a 2-stage TMA ring (`gluon_decode._loader`); a tile is released when both
  warpgroups arrive on its `empty` barrier (count 2).
- At the end WG0 hands the row sums to WG1 through the same shared vector (one more p_ready round).
Each o^T half is [R/2, 64] fp32 = 128 registers per thread; shared memory: ring 147 KB + queries
[64, 576] 74 KB + p^T 8 KB + two [64] fp32 vectors (no room for the epilogue layout change).
Per 64-token tile a program runs 4.46 M MACs (QK 2.36 M on WG0, PV 2 x 1.05 M); reading both operands
from shared memory, the tile needs ~272 KB of shared-memory reads + 74 KB of TMA writes, ~2.7 k cycles
at 128 B/cycle: an upper bound near 80% of the bf16 peak.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from .gluon_decode import _cta_barrier, _loader, _zero_rows


@gluon.jit
def _wg0(q0_s, q1_s, qpe_s, p_s, ex_s, mx_s, kv0_s, kv1_s, kpe_s, full, empty, p_ready, p_free, kv_lo, kv_hi, n_tiles,
         qk_scale, Q_ABS, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, q_off, lat_off, pid_s,
         stride_qa_h, stride_qp_t, stride_qp_h, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t,
         stride_pl_h, N: gl.constexpr, BLOCK_C: gl.constexpr, DR: gl.constexpr, COLS: gl.constexpr,
         BN: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = head0 + gl.arange(0, COLS, layout=gl.SliceLayout(1, ql))
    qr = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, ql))
    qd = gl.arange(0, DR, layout=gl.SliceLayout(0, ql))
    qm = (qh < N)[:, None]
    qa = Q_ABS + qh[:, None] * stride_qa_h + q_off + qr[None, :]
    q0_s.store(gl.load(qa, mask=qm, other=0.0))
    q1_s.store(gl.load(qa + BLOCK_C, mask=qm, other=0.0))
    qpe_s.store(gl.load(Q_PE + tok * stride_qp_t + qh[:, None] * stride_qp_h + qd[None, :], mask=qm, other=0.0))
    fence_async_shared()
    _cta_barrier()

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    acc0 = gl.zeros([BLOCK_C, COLS], gl.float32, acc_l)
    lacc = gl.zeros([BN, COLS], gl.float32, acc_l)
    m_i = gl.full([COLS], float("-inf"), gl.float32, col_l)
    offs_n = gl.arange(0, BN, layout=row_l)
    for t in range(n_tiles):
        s = t % STAGES
        ph = (t // STAGES) & 1
        mbarrier.wait(full.index(s), ph)
        start = kv_lo + t * BN
        valid = kv_hi - start
        if valid < BN:
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
        mbarrier.wait(p_free, (t & 1) ^ 1)  # WG1 has read the previous tile's p and alpha
        p_s.store(gl.permute(p.to(p_s.dtype), (1, 0)))
        ex_s.store(alpha)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_ready, count=1)
        acc0 = warpgroup_mma(kv0_s.index(s).permute((1, 0)), p_s.permute((1, 0)), acc0 * alpha[None, :],
                             is_async=True)
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=[acc0])
        mbarrier.arrive(empty.index(s), count=1)

    l_i = gl.sum(lacc, axis=0)
    mbarrier.wait(p_free, (n_tiles & 1) ^ 1)
    ex_s.store(l_i)
    mx_s.store(m_i)
    _cta_barrier()
    mbarrier.arrive(p_ready, count=1)  # the final round: WG1 reads l (and m) for its half
    has = l_i > 0.0
    inv = 1.0 / gl.where(has, l_i, 1.0)
    out0 = acc0 * inv[None, :]
    head = head0 + gl.arange(0, COLS, layout=col_l)
    ok = (head < N)[None, :]
    offs_r = gl.arange(0, BLOCK_C, layout=row_l)[:, None]
    if SPLIT:
        pa = PART_ACC + rel * stride_pa_t + head[None, :] * stride_pa_h + pid_s * stride_pa_s + offs_r
        gl.store(pa, out0, mask=ok)
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        gl.store(PART_LSE + rel * stride_pl_t + head * stride_pl_h + pid_s, lse, mask=head < N)
    else:
        la = LATENT + head[None, :] * stride_lat_h + lat_off + offs_r
        gl.store(la, out0.to(LATENT.dtype.element_ty), mask=ok)


@gluon.jit
def _wg1(p_s, ex_s, kv1_s, full, empty, p_ready, p_free, n_tiles, LATENT, PART_ACC, head0, rel, lat_off, pid_s,
         stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s, N: gl.constexpr, BLOCK_C: gl.constexpr,
         COLS: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    acc1 = gl.zeros([BLOCK_C, COLS], gl.float32, acc_l)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(full.index(s), (t // STAGES) & 1)
        mbarrier.wait(p_ready, t & 1)
        alpha = ex_s.load(col_l)
        acc1 = warpgroup_mma(kv1_s.index(s).permute((1, 0)), p_s.permute((1, 0)), acc1 * alpha[None, :],
                             is_async=True)
        acc1 = warpgroup_mma_wait(num_outstanding=0, deps=[acc1])
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(empty.index(s), count=1)
    mbarrier.wait(p_ready, n_tiles & 1)
    l_i = ex_s.load(col_l)
    inv = 1.0 / gl.where(l_i > 0.0, l_i, 1.0)
    out1 = acc1 * inv[None, :]
    head = head0 + gl.arange(0, COLS, layout=col_l)
    ok = (head < N)[None, :]
    offs_r = BLOCK_C + gl.arange(0, BLOCK_C, layout=row_l)[:, None]
    if SPLIT:
        pa = PART_ACC + rel * stride_pa_t + head[None, :] * stride_pa_h + pid_s * stride_pa_s + offs_r
        gl.store(pa, out1, mask=ok)
    else:
        la = LATENT + head[None, :] * stride_lat_h + lat_off + offs_r
        gl.store(la, out1.to(LATENT.dtype.element_ty), mask=ok)


@gluon.jit
def gluon_decode_wide_kernel(
    kv_desc, kpe_desc, Q_ABS, Q_PE, PAGE_TABLE, CU_SEQLEN, SEQ_LEN, LATENT, PART_ACC, PART_LSE,
    seq_base, tok_base, abs_base, chunk_size, qk_scale,
    stride_qa_h, stride_qa_t, stride_qp_t, stride_qp_h, stride_pt_b,
    stride_lat_h, stride_lat_t, stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
    N: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, PAGE_SIZE: gl.constexpr, COLS: gl.constexpr,
    STAGES: gl.constexpr, SPLIT: gl.constexpr, WG1_REGS: gl.constexpr = 160,
):
    BN: gl.constexpr = 64
    BLOCK_C: gl.constexpr = R // 2
    hb = gl.program_id(0)
    b = seq_base + gl.program_id(1)
    pid_s = gl.program_id(2)
    tok = gl.load(CU_SEQLEN + b).to(gl.int64)
    kv_limit = gl.load(SEQ_LEN + b)
    per = gl.maximum(gl.cdiv(kv_limit, gl.num_programs(2)), chunk_size)
    chunk = gl.cdiv(per, BN) * BN
    kv_lo = pid_s * chunk
    kv_hi = gl.minimum(kv_lo + chunk, kv_limit)
    head0 = hb * COLS
    rel = tok - tok_base
    if SPLIT:
        if kv_lo >= kv_limit:
            lay1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            hh = head0 + gl.arange(0, COLS, layout=lay1)
            gl.store(PART_LSE + rel * stride_pl_t + hh * stride_pl_h + pid_s,
                     gl.full([COLS], float("-inf"), gl.float32, lay1), mask=hh < N)
            return
    n_tiles = gl.cdiv(kv_hi - kv_lo, BN)

    dt: gl.constexpr = Q_ABS.dtype.element_ty
    q0_s = gl.allocate_shared_memory(dt, [COLS, BLOCK_C], gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_C], dt))
    q1_s = gl.allocate_shared_memory(dt, [COLS, BLOCK_C], gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_C], dt))
    qpe_s = gl.allocate_shared_memory(dt, [COLS, DR], gl.NVMMASharedLayout.get_default_for([COLS, DR], dt))
    p_s = gl.allocate_shared_memory(dt, [COLS, BN], gl.NVMMASharedLayout.get_default_for([COLS, BN], dt))
    ex_s = gl.allocate_shared_memory(gl.float32, [COLS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    mx_s = gl.allocate_shared_memory(gl.float32, [COLS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv0_s = gl.allocate_shared_memory(dt, [STAGES, BN, BLOCK_C], kv_desc.layout)
    kv1_s = gl.allocate_shared_memory(dt, [STAGES, BN, BLOCK_C], kv_desc.layout)
    kpe_s = gl.allocate_shared_memory(dt, [STAGES, BN, DR], kpe_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a tile
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    fence_async_shared()
    pt_row = PAGE_TABLE + b.to(gl.int64) * stride_pt_b
    q_off = (tok - abs_base) * stride_qa_t
    lat_off = (tok - abs_base) * stride_lat_t

    gl.warp_specialize(
        [(_wg0, (q0_s, q1_s, qpe_s, p_s, ex_s, mx_s, kv0_s, kv1_s, kpe_s, full, empty, p_ready, p_free, kv_lo, kv_hi,
                 n_tiles, qk_scale, Q_ABS, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, q_off, lat_off, pid_s,
                 stride_qa_h, stride_qp_t, stride_qp_h, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s,
                 stride_pl_t, stride_pl_h, N, BLOCK_C, DR, COLS, BN, STAGES, SPLIT)),
         (_wg1, (p_s, ex_s, kv1_s, full, empty, p_ready, p_free, n_tiles, LATENT, PART_ACC, head0, rel, lat_off,
                 pid_s, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s, N, BLOCK_C, COLS, STAGES, SPLIT)),
         (_loader, (kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full, empty, pt_row, kv_lo, n_tiles,
                    PAGE_SIZE, BLOCK_C, R, DR, BN, STAGES))],
        [4, 1], [WG1_REGS, 40])


COLS = 64
STAGES = 2
MAXNREG = 168  # 12 warps x 168 registers at launch fill the register file; setmaxnreg redistributes
WG1_REGS = 200


def wide_meta(num_heads: int, r: int, dr: int, page_size: int, split: bool) -> dict:
    """Constexprs and launch options of one variant of gluon_decode_wide_kernel."""
    return dict(N=num_heads, R=r, DR=dr, PAGE_SIZE=page_size, COLS=COLS, STAGES=STAGES, SPLIT=split,
                WG1_REGS=WG1_REGS, num_warps=4, maxnreg=MAXNREG)


def launch_wide(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse, *, n_seqs: int,
                seq_base: int, tok_base: int, abs_base: int, splits: int, chunk: int, qk_scale: float,
                num_heads: int, r: int, dr: int, page_size: int) -> None:
    """One launch over (head blocks of 64, n_seqs, splits) through Triton's JIT launcher (arguments as
    gluon_decode.launch; the same descriptors, partial layout and split merge)."""
    from .gluon_decode import kernel_args

    split = splits > 1
    ptrs, scalars = kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse,
                                seq_base=seq_base, tok_base=tok_base, abs_base=abs_base, chunk=chunk,
                                qk_scale=qk_scale, split=split)
    gluon_decode_wide_kernel[(-(-num_heads // COLS), n_seqs, splits)](
        *ptrs, *scalars, **wide_meta(num_heads, r, dr, page_size, split))
