"""What both Gluon decode kernels share (gluon_decode.py, N <= 32; gluon_decode_wide.py, N > 32): the
Gluon imports (absent or broken, `_GLUON_ERROR` says why and nothing launches), the names Gluon renamed
after triton 3.6, the tile size, a program's work item and shared buffers, the query load, the TMA loader
partition and the partial-tile zeroing."""

from __future__ import annotations

from typing import Optional

BLOCK_N = 64  # tokens per KV tile

try:  # Gluon ships with triton >= 3.5; absent or broken, `supports` says so and nothing launches
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 - what the kernels import
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    # Names that changed after triton 3.6 (the GPU image): the CTA barrier (`thread_barrier` ->
    # `barrier`) and the TMA load (`async_copy_global_to_shared` -> `async_load`).
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _GLUON_ERROR: Optional[str] = None
except Exception as e:  # noqa: BLE001 - any import failure means "not available"
    _GLUON_ERROR = f"{type(e).__name__}: {e}"


if _GLUON_ERROR is None:

    @gluon.jit
    def _loader(kv_desc, kpe_desc, kv0_s, kv1_s, kpe_s, full, empty, pt_row, kv_lo, n_tiles,
                PAGE_SIZE: gl.constexpr, BLOCK_C: gl.constexpr, R: gl.constexpr, DR: gl.constexpr,
                BN: gl.constexpr, STAGES: gl.constexpr):
        nbytes: gl.constexpr = BN * (2 * BLOCK_C + DR) * 2
        # The next tile's page id is loaded before waiting for its buffer, so its latency is not added
        # to each refill (a chunk's tiles start on BN, so each lies inside one page).
        page = gl.load(pt_row + kv_lo // PAGE_SIZE, mask=n_tiles > 0, other=0)
        for t in range(n_tiles):
            s = t % STAGES
            ph = (t // STAGES) & 1
            start = kv_lo + t * BN
            row0 = page * PAGE_SIZE + start % PAGE_SIZE
            page = gl.load(pt_row + (start + BN) // PAGE_SIZE, mask=t + 1 < n_tiles, other=0)
            mbarrier.wait(empty.index(s), ph ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(full.index(s), nbytes)
            _tma_load(kv_desc, [row0, 0], full.index(s), kv0_s.index(s))
            _tma_load(kv_desc, [row0, BLOCK_C], full.index(s), kv1_s.index(s))
            _tma_load(kpe_desc, [row0, R], full.index(s), kpe_s.index(s))

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # after triton 3.6 (`_reinterpret` there)

        @gluon.jit
        def _as_fp32(buf, ROWS: gl.constexpr, COLS: gl.constexpr):
            """A 16-bit [2, ROWS, COLS] buffer's bytes as fp32 [ROWS, COLS] (an epilogue's staging)."""
            return buf.reinterpret(gl.float32, [ROWS, COLS],
                                   gl.NVMMASharedLayout.get_default_for([ROWS, COLS], gl.float32))
    else:

        @gluon.jit
        def _as_fp32(buf, ROWS: gl.constexpr, COLS: gl.constexpr):
            """A 16-bit [2, ROWS, COLS] buffer's bytes as fp32 [ROWS, COLS] (an epilogue's staging)."""
            return buf._reinterpret(gl.float32, [ROWS, COLS],
                                    gl.NVMMASharedLayout.get_default_for([ROWS, COLS], gl.float32))

    @gluon.jit
    def _zero_rows(buf, valid, W: gl.constexpr, BN: gl.constexpr, CHUNK: gl.constexpr):
        """Rows >= valid of a landed tile buffer [BN, W] set to zero: slots past a sequence's history
        may hold anything (NaN included), and p = 0 does not cancel NaN in the PV product."""
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, lay))
        for c in gl.static_range(W // CHUNK):
            part = buf.slice(c * CHUNK, CHUNK, dim=1)
            x = part.load(lay)
            part.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))

    @gluon.jit
    def _store_queries(q0_s, q1_s, qpe_s, Q_ABS, Q_PE, head0, tok, q_off, stride_qa_h, stride_qp_t, stride_qp_h,
                       N: gl.constexpr, BLOCK_C: gl.constexpr, DR: gl.constexpr, ROWS: gl.constexpr):
        """One token's queries of heads [head0, head0 + ROWS) -> shared memory as [ROWS, K] (K-major, the
        QK's wgmma operand): both latent halves and the rope part, zero past N; fenced for the async
        proxy and visible to the whole (4-warp) partition."""
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        qh = head0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ql))
        qr = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, ql))
        qd = gl.arange(0, DR, layout=gl.SliceLayout(0, ql))
        qm = (qh < N)[:, None]
        qa = Q_ABS + qh[:, None] * stride_qa_h + q_off + qr[None, :]
        # Every load issued before the first store, so the three parts' loads overlap (interleaved in
        # program order, each part's load waited behind the previous part's store).
        q0 = gl.load(qa, mask=qm, other=0.0)
        q1 = gl.load(qa + BLOCK_C, mask=qm, other=0.0)
        qpe = gl.load(Q_PE + tok * stride_qp_t + qh[:, None] * stride_qp_h + qd[None, :], mask=qm, other=0.0)
        q0_s.store(q0)
        q1_s.store(q1)
        qpe_s.store(qpe)
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _work_item(CU_SEQLEN, SEQ_LEN, seq_base, chunk_size, BN: gl.constexpr):
        """This program's decode sequence b (grid axis 1), split pid_s (axis 2), its token, history length
        and KV chunk [kv_lo, kv_hi) (at least `chunk_size`, whole tiles)."""
        b = seq_base + gl.program_id(1)
        pid_s = gl.program_id(2)
        tok = gl.load(CU_SEQLEN + b).to(gl.int64)
        kv_limit = gl.load(SEQ_LEN + b)
        per = gl.maximum(gl.cdiv(kv_limit, gl.num_programs(2)), chunk_size)
        chunk = gl.cdiv(per, BN) * BN
        kv_lo = pid_s * chunk
        kv_hi = gl.minimum(kv_lo + chunk, kv_limit)
        return b, pid_s, tok, kv_limit, kv_lo, kv_hi

    @gluon.jit
    def _empty_split_lse(PART_LSE, rel, head0, pid_s, stride_pl_t, stride_pl_h, N: gl.constexpr,
                         ROWS: gl.constexpr):
        """lse = -inf for a split whose chunk starts past its sequence (a static split count, a shorter
        sequence): the merge then ignores its partial, which is never written."""
        lay1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        hh = head0 + gl.arange(0, ROWS, layout=lay1)
        gl.store(PART_LSE + rel * stride_pl_t + hh * stride_pl_h + pid_s,
                 gl.full([ROWS], float("-inf"), gl.float32, lay1), mask=hh < N)

    @gluon.jit
    def _alloc_queries(dt: gl.constexpr, ROWS: gl.constexpr, BLOCK_C: gl.constexpr, DR: gl.constexpr):
        """Shared buffers of one token's queries, [ROWS, K] per latent half and rope part (K-major)."""
        q0_s = gl.allocate_shared_memory(dt, [ROWS, BLOCK_C], gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_C], dt))
        q1_s = gl.allocate_shared_memory(dt, [ROWS, BLOCK_C], gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_C], dt))
        qpe_s = gl.allocate_shared_memory(dt, [ROWS, DR], gl.NVMMASharedLayout.get_default_for([ROWS, DR], dt))
        return q0_s, q1_s, qpe_s

    @gluon.jit
    def _alloc_ring(dt: gl.constexpr, kv_desc, kpe_desc, STAGES: gl.constexpr, BN: gl.constexpr,
                    BLOCK_C: gl.constexpr, DR: gl.constexpr):
        """The KV ring `_loader` fills: latent halves and rope part per stage, and its full / empty
        barriers (not initialised: the kernel knows how many consumers release a stage)."""
        kv0_s = gl.allocate_shared_memory(dt, [STAGES, BN, BLOCK_C], kv_desc.layout)
        kv1_s = gl.allocate_shared_memory(dt, [STAGES, BN, BLOCK_C], kv_desc.layout)
        kpe_s = gl.allocate_shared_memory(dt, [STAGES, BN, DR], kpe_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        return kv0_s, kv1_s, kpe_s, full, empty
