"""Warp-specialised Gluon decode for many heads (N > 32: DeepSeek-V3 N 128, TP-2 N 64), SM90.

Why: at N = 128 decode is compute-bound (64 heads x 64 tokens x (576 + 512) MACs per KV tile), and
the `tl` heads-on-N kernel reaches ~218 TFLOP/s where FlashInfer's fa3 reaches ~580 (issue 14 asks
>= 450 and FlashInfer's time). This kernel: 619 TFLOP/s at batch 128 x kv 8192 on an H200, 0.87-0.97x
FlashInfer's time at batch >= 32 (docs/benchmarks/decode_gluon_wide.md, with the variants measured).

Layout per program: 64 heads on the MMA's M side, one (sequence, split chunk), 64-token KV tiles.
- A loader warp loads the latent queries [64, R] by TMA, then feeds a 2-stage TMA ring
  (`gluon_common._loader`: page id -> cache rows).
- WG0 (4 warps) loads the rope queries, computes s = q K^T for every tile (36 wgmmas m64n64k16, both
  operands in shared memory), the online softmax, and o[:, :R/2] += p V[:, :R/2] with p from
  registers (4 wgmmas m64n256k16); while those run it publishes p (bf16) in the tile's rope slot,
  dead after its QK, and the running max.
- WG1 (4 warps) computes o[:, R/2:] += p V[:, R/2:] with p read from shared memory, rescaled by the
  change of the published max. A tile is released when both warpgroups are done with it.
- Each warpgroup's output half leaves through its half of the ring (free at the end) as whole lines.
- Heads on M keep the softmax's row reductions inside a warp and let the PV use N = 256 wgmmas with
  p in registers: the first version (heads on N, 16 wgmmas m64n64 per half, both operands in shared
  memory) reached 459 TFLOP/s; a schedule where the two warpgroups took tiles in turn ran slower
  (its two-stage ring gave no tile of lookahead).
Shared memory: queries [64, 576] 72 KB + ring 2 x 72 KB + the max and sum vectors (~217 KB).
Outputs are gluon_decode's (the latent, or fp32 partials and base-2 LSE for the split merge).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

from .gluon_common import _alloc_queries, _alloc_ring, _as_fp32, _cta_barrier, _empty_split_lse, _loader, \
    _tma_load, _work_item, _zero_rows


@gluon.jit
def _query_loader(q_desc, q0_s, q1_s, qbar, head0, q_col, kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full, empty,
                  pt_row, kv_lo, n_tiles, PAGE_SIZE: gl.constexpr, BLOCK_C: gl.constexpr, R: gl.constexpr,
                  DR: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: the latent queries [HEADS, R] by TMA first (rows past N are zero-filled), then
    the KV ring (`gluon_common._loader`). Loaded by WG0's threads, the queries took ~13,000 cycles of a
    program's start (clock64 on an H200, a third of a 512-token program)."""
    mbarrier.expect(qbar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [head0, q_col], qbar, q0_s)
    _tma_load(q_desc, [head0, q_col + BLOCK_C], qbar, q1_s)
    _loader(kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full, empty, pt_row, kv_lo, n_tiles, PAGE_SIZE, BLOCK_C, R, DR,
            BN, STAGES)


@gluon.jit
def _store_rope_queries(qpe_s, Q_PE, head0, tok, stride_qp_t, stride_qp_h, N: gl.constexpr, DR: gl.constexpr,
                        ROWS: gl.constexpr):
    """The rope queries [ROWS, DR] -> shared memory (zero past N), fenced for the wgmma and visible to
    the warpgroup (8 KB: plain loads, while the latent queries arrive by TMA)."""
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    qh = head0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ql))
    qd = gl.arange(0, DR, layout=gl.SliceLayout(0, ql))
    qpe_s.store(gl.load(Q_PE + tok * stride_qp_t + qh[:, None] * stride_qp_h + qd[None, :], mask=(qh < N)[:, None],
                        other=0.0))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _safe_scale(m_old, m_new):
    """exp2(m_old - m_new), 0 where nothing was seen yet (m_old = -inf)."""
    return gl.where(m_old == float("-inf"), 0.0, gl.exp2(m_old - gl.where(m_new == float("-inf"), 0.0, m_new)))


@gluon.jit
def _qk(ME: gl.constexpr, q0_s, q1_s, qpe_s, kv0_s, kv1_s, kpe_s, full, ph, valid, s_l: gl.constexpr,
        BLOCK_C: gl.constexpr, HEADS: gl.constexpr, BN: gl.constexpr):
    """Issues s = q K^T [HEADS, BN] of the tile in ring stage ME once it has landed (the caller waits)."""
    mbarrier.wait(full.index(ME), ph)
    if valid < BN:  # the chunk's last, partial tile: zero V rows past the history (p = 0 keeps NaN)
        _zero_rows(kv0_s.index(ME), valid, BLOCK_C, BN, 64)
        _zero_rows(kv1_s.index(ME), valid, BLOCK_C, BN, 64)
        fence_async_shared()
        _cta_barrier()
    s = warpgroup_mma(q0_s, kv0_s.index(ME).permute((1, 0)), gl.zeros([HEADS, BN], gl.float32, s_l),
                      use_acc=False, is_async=True)
    s = warpgroup_mma(q1_s, kv1_s.index(ME).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(qpe_s, kpe_s.index(ME).permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, m_prev, l_i, valid, qk_scale, s_l: gl.constexpr, BN: gl.constexpr, dt: gl.constexpr):
    """The online softmax of one tile after the running max `m_prev` (base 2, scaled units): p in `dt`,
    the new max, the rescale of what came before and the new row sums. The scale is applied once, in
    the exponent's FMA, and the mask only on a chunk's partial last tile: WG0's per-tile chain is the
    kernel's critical path (H200 N 128, batch 128 x kv 2048: 139.1 -> 136.6 us)."""
    if valid < BN:
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        s = gl.where((offs_n < valid)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1) * qk_scale)  # qk_scale > 0: max commutes with it
    p = gl.exp2(s * qk_scale - gl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
    alpha = _safe_scale(m_prev, m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p.to(dt), m_new, alpha, l_i


@gluon.jit
def _publish(ME: gl.constexpr, pb, m_new, kpe_s, m_s, ready, HEADS: gl.constexpr):
    """p (bf16) into the tile's rope slot and the new max, for WG1."""
    kpe_s.index(ME).store(pb)
    m_s.slice(ME * HEADS, HEADS).store(m_new)
    fence_async_shared()
    _cta_barrier()
    mbarrier.arrive(ready.index(ME), count=1)


@gluon.jit
def _tile(ME: gl.constexpr, ST: gl.constexpr, ph, valid, acc, m_run, l_i, q0_s, q1_s, qpe_s, kv0_s, kv1_s, kpe_s,
          m_s, full, empty, ready, qk_scale, s_l: gl.constexpr, o_l: gl.constexpr, p_l: gl.constexpr,
          BLOCK_C: gl.constexpr, HEADS: gl.constexpr, BN: gl.constexpr):
    """One tile in ring stage ST: WG0 computes s, the softmax and o[:, :R/2] (p from registers) and
    publishes p and the max; WG1 computes o[:, R/2:] from the published p."""
    orow: gl.constexpr = gl.SliceLayout(1, o_l)
    srow: gl.constexpr = gl.SliceLayout(1, s_l)
    if ME == 0:
        s = _qk(ST, q0_s, q1_s, qpe_s, kv0_s, kv1_s, kpe_s, full, ph, valid, s_l, BLOCK_C, HEADS, BN)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        pb, m_new, alpha, l_i = _softmax(s, m_run, l_i, valid, qk_scale, s_l, BN, kpe_s.dtype)
        acc = warpgroup_mma(gl.convert_layout(pb, p_l), kv0_s.index(ST), acc * gl.convert_layout(alpha, orow)[:, None],
                            is_async=True)
        # Published while this PV runs: before it, the store, fence and barrier sat on WG0's chain
        # (H200 N 128: 149 -> 139 us at batch 128 x kv 2048).
        _publish(ST, pb, m_new, kpe_s, m_s, ready, HEADS)
    else:
        mbarrier.wait(ready.index(ST), ph)
        m_new = m_s.slice(ST * HEADS, HEADS).load(srow)
        alpha = _safe_scale(m_run, m_new)
        acc = warpgroup_mma(kpe_s.index(ST), kv1_s.index(ST), acc * gl.convert_layout(alpha, orow)[:, None],
                            is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(empty.index(ST), count=1)
    return acc, m_new, l_i


@gluon.jit
def _wg(ME: gl.constexpr, q0_s, q1_s, qpe_s, kv0_s, kv1_s, kpe_s, m_s, l_s, full, empty, ready, fin, qbar,
        kv_lo, kv_hi, n_tiles, qk_scale, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, lat_off,
        pid_s, stride_qp_t, stride_qp_h, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s,
        stride_pl_t, stride_pl_h, N: gl.constexpr, BLOCK_C: gl.constexpr, DR: gl.constexpr, HEADS: gl.constexpr,
        BN: gl.constexpr, SPLIT: gl.constexpr):
    if ME == 0:  # queries -> shared memory [HEADS, K] (the QK's A operand): rope part here, the rest by TMA
        _store_rope_queries(qpe_s, Q_PE, head0, tok, stride_qp_t, stride_qp_h, N, DR, HEADS)
        mbarrier.wait(qbar, 0)

    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_C, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    srow: gl.constexpr = gl.SliceLayout(1, s_l)
    orow: gl.constexpr = gl.SliceLayout(1, o_l)
    acc = gl.zeros([HEADS, BLOCK_C], gl.float32, o_l)
    l_i = gl.zeros([HEADS], gl.float32, srow)
    m_run = gl.full([HEADS], float("-inf"), gl.float32, srow)
    n_pairs = n_tiles // 2
    for i in range(n_pairs):  # unrolled by two: ring stages are compile-time indices
        for st in gl.static_range(2):
            acc, m_run, l_i = _tile(ME, st, i & 1, kv_hi - (kv_lo + (2 * i + st) * BN), acc, m_run, l_i, q0_s, q1_s,
                                    qpe_s, kv0_s, kv1_s, kpe_s, m_s, full, empty, ready, qk_scale, s_l, o_l, p_l,
                                    BLOCK_C, HEADS, BN)
    if n_tiles % 2 == 1:
        acc, m_run, l_i = _tile(ME, 0, n_pairs & 1, kv_hi - (kv_lo + 2 * n_pairs * BN), acc, m_run, l_i, q0_s, q1_s,
                                qpe_s, kv0_s, kv1_s, kpe_s, m_s, full, empty, ready, qk_scale, s_l, o_l, p_l,
                                BLOCK_C, HEADS, BN)

    if ME == 0:  # the row sums, for WG1's half
        l_s.store(l_i)
        _cta_barrier()
        mbarrier.arrive(fin, count=1)
        l_tot = l_i
    else:
        mbarrier.wait(fin, 0)
        l_tot = l_s.load(srow)
    has = l_tot > 0.0
    inv = gl.convert_layout(1.0 / gl.where(has, l_tot, 1.0), orow)
    out = acc * inv[:, None]
    # The output goes through this warpgroup's half of the ring (free now: every tile is consumed and
    # nothing reads it) to leave as whole lines. Stored from the accumulator's layout, each warp
    # instruction writes 8 rows x 16 B: 4,096 partial-line writes per program, 6,000-10,000 cycles
    # (clock64, H200) against ~2,000 now.
    if ME == 0:
        ring = kv0_s
    else:
        ring = kv1_s
    if SPLIT:  # fp32 [HEADS, R/2]: the half's two stages
        st_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        stage = _as_fp32(ring, HEADS, BLOCK_C)
        stage.store(out)
    else:  # LATENT's dtype [HEADS, R/2]: one stage
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        stage = ring.index(0)
        stage.store(out.to(LATENT.dtype.element_ty))
    _cta_barrier()
    res = stage.load(st_l)
    head = head0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, st_l))
    ok = (head < N)[:, None]
    offs_r = ME * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, st_l))[None, :]
    if SPLIT:
        pa = PART_ACC + rel * stride_pa_t + head[:, None] * stride_pa_h + pid_s * stride_pa_s + offs_r
        gl.store(pa, res, mask=ok)
        if ME == 0:
            hs = head0 + gl.arange(0, HEADS, layout=srow)
            lse = gl.where(has, m_run + gl.log2(gl.where(has, l_tot, 1.0)), float("-inf"))
            gl.store(PART_LSE + rel * stride_pl_t + hs * stride_pl_h + pid_s, lse, mask=hs < N)
    else:
        la = LATENT + head[:, None] * stride_lat_h + lat_off + offs_r
        gl.store(la, res, mask=ok)


# Not specialised on the per-step bases (see gluon_decode_kernel): a new divisibility of one of them
# (or of the split count in the LSE strides) compiled new variants in the first minute of serving
# (4 variants, seconds each, on the H200).
@gluon.jit(do_not_specialize=["seq_base", "tok_base", "abs_base", "chunk_size", "stride_pl_t", "stride_pl_h"])
def gluon_decode_wide_kernel(
    kv_desc, kpe_desc, q_desc, Q_ABS, Q_PE, PAGE_TABLE, CU_SEQLEN, SEQ_LEN, LATENT, PART_ACC, PART_LSE,
    seq_base, tok_base, abs_base, chunk_size, qk_scale,
    stride_qa_h, stride_qa_t, stride_qp_t, stride_qp_h, stride_pt_b,
    stride_lat_h, stride_lat_t, stride_pa_t, stride_pa_h, stride_pa_s, stride_pl_t, stride_pl_h,
    N: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, PAGE_SIZE: gl.constexpr, HEADS: gl.constexpr,
    SPLIT: gl.constexpr, WG1_REGS: gl.constexpr,
):
    BN: gl.constexpr = 64
    STAGES: gl.constexpr = 2  # what shared memory holds; the tile loop is unrolled by it
    BLOCK_C: gl.constexpr = R // 2
    hb = gl.program_id(0)
    b, pid_s, tok, kv_limit, kv_lo, kv_hi = _work_item(CU_SEQLEN, SEQ_LEN, seq_base, chunk_size, BN)
    head0 = hb * HEADS
    rel = tok - tok_base  # the token's row among the partials
    if SPLIT:
        if kv_lo >= kv_limit:
            _empty_split_lse(PART_LSE, rel, head0, pid_s, stride_pl_t, stride_pl_h, N, HEADS)
            return
    n_tiles = gl.cdiv(kv_hi - kv_lo, BN)

    dt: gl.constexpr = Q_ABS.dtype.element_ty
    q0_s, q1_s, qpe_s = _alloc_queries(dt, HEADS, BLOCK_C, DR)
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m_s = gl.allocate_shared_memory(gl.float32, [STAGES * HEADS], vec_l)  # [stage, head], flat: WG0's max
    l_s = gl.allocate_shared_memory(gl.float32, [HEADS], vec_l)
    kv0_s, kv1_s, kpe_s, full, empty = _alloc_ring(dt, kv_desc, kpe_desc, STAGES, BN, BLOCK_C, DR)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a tile
        # WG0 -> WG1: this stage's p and max are published
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(fin, count=1)
    mbarrier.init(qbar, count=1)
    fence_async_shared()
    pt_row = PAGE_TABLE + b.to(gl.int64) * stride_pt_b
    q_col = ((tok - abs_base) * stride_qa_t).to(gl.int32)  # the token's latent queries in q_desc's [N, T * R]
    lat_off = (tok - abs_base) * stride_lat_t

    gl.warp_specialize(
        [(_wg, (0, q0_s, q1_s, qpe_s, kv0_s, kv1_s, kpe_s, m_s, l_s, full, empty, ready, fin, qbar, kv_lo, kv_hi,
                n_tiles, qk_scale, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, lat_off, pid_s,
                stride_qp_t, stride_qp_h, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s,
                stride_pl_t, stride_pl_h, N, BLOCK_C, DR, HEADS, BN, SPLIT)),
         (_wg, (1, q0_s, q1_s, qpe_s, kv0_s, kv1_s, kpe_s, m_s, l_s, full, empty, ready, fin, qbar, kv_lo, kv_hi,
                n_tiles, qk_scale, Q_PE, tok, LATENT, PART_ACC, PART_LSE, head0, rel, lat_off, pid_s,
                stride_qp_t, stride_qp_h, stride_lat_h, stride_pa_t, stride_pa_h, stride_pa_s,
                stride_pl_t, stride_pl_h, N, BLOCK_C, DR, HEADS, BN, SPLIT)),
         (_query_loader, (q_desc, q0_s, q1_s, qbar, head0, q_col, kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full,
                          empty, pt_row, kv_lo, n_tiles, PAGE_SIZE, BLOCK_C, R, DR, BN, STAGES))],
        [4, 1], [WG1_REGS, 40])


WG1_REGS = 200  # WG1 holds o[:, R/2:] (128 fp32 registers) and little else; WG0 takes the rest (256)


def wide_meta(num_heads: int, r: int, dr: int, page_size: int, split: bool, heads: int, maxnreg: int) -> dict:
    """Constexprs and launch options of one variant of gluon_decode_wide_kernel (`heads` per program
    and registers at launch from gluon_decode.WIDE_CONFIG)."""
    return dict(N=num_heads, R=r, DR=dr, PAGE_SIZE=page_size, HEADS=heads, SPLIT=split, WG1_REGS=WG1_REGS,
                num_warps=4, maxnreg=maxnreg)
