"""Triton kernels of the fused MoE experts op (docs/moe.md explains the design).

Four kernels over the step's `n = T * top_k` (token, expert) pairs, pair `i` being token `i // top_k`:

- `count_kernel` + `place_kernel` (the layout, one program per CHUNK pairs each): count the pairs
  per expert per chunk; then every program sums those counts, pads each expert's count up to a
  multiple of BLOCK_M, lays the experts out one after another in that padded order and writes its
  chunk's `sorted_pairs[slot]` (the pair in each slot; `n` in padding slots) and its share of
  `block_expert[b]` (the expert of each BLOCK_M-row block, -1 past the last); program 0 also writes
  the number of blocks in use. Ranks within an expert come from one-hot prefix sums, not atomics,
  so the layout is deterministic.
- `up_kernel`: one program per (BLOCK_N columns of the intermediate, row block), columns fastest so
  that a block's gathered rows are re-read from L2, not HBM, by its column tiles: gathers its rows of
  the input by token, multiplies by the expert's gate and up rows (two accumulators over the same
  input tile) and writes act(gate) * up: the [slots, I] intermediate never exists unactivated.
- `down_kernel`: the intermediate rows times the expert's down projection, scaled by each pair's
  routing weight, written to the pair's own row of `[n, H]` (unsorted order), which the op then
  sums over top_k in fp32.

Grids are static for a given T (row blocks: the bound `cdiv(n, BLOCK_M) + min(E, n)`; programs past
the last real block return at once; the persistent prefill kernels below read the blocks in use from
the device), so the op is CUDA-graph safe. Weights are read through their
strides: `[E, out, in]` as HF stores them or any transposed view.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_helpers import dot


@triton.jit(do_not_specialize=["n_pairs"])
def count_kernel(
    IDS, PARTIAL, n_pairs,
    E_P2: tl.constexpr, CHUNK: tl.constexpr,
):
    """PARTIAL[c, e] = pairs of chunk c (CHUNK pairs) routed to expert e."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_P2)
    i = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(IDS + i, mask=i < n_pairs, other=-1).to(tl.int32)
    cnt = tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(PARTIAL + c * E_P2 + offs_e, cnt)


@triton.jit(do_not_specialize=["n_pairs", "num_chunks", "max_blocks"])
def place_kernel(
    IDS, PARTIAL, SORTED, BLOCK_EXPERT, NUM_BLOCKS,
    n_pairs, num_chunks, max_blocks,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
):
    """Program c < num_chunks places chunk c's pairs; every program writes its share of the padding
    slots and the block table (blocks c, c + programs, ...). Launched with about one program per block:
    one program walking all blocks was the kernel's time (13 us for 80 blocks at 64 tokens x top-4)."""
    c = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    before = tl.zeros([E_P2], dtype=tl.int32)  # pairs of chunks < c per expert
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        part = tl.load(PARTIAL + r[:, None] * E_P2 + offs_e[None, :], mask=(r < num_chunks)[:, None], other=0)
        counts += tl.sum(part, axis=0)
        before += tl.sum(tl.where((r < c)[:, None], part, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if c == 0:
        tl.store(NUM_BLOCKS, total // BLOCK_M)  # blocks that hold an expert: 0 .. NUM_BLOCKS - 1

    # this chunk's pairs: slot = expert start + pairs of that expert in earlier chunks + rank here
    # (programs past the last chunk find no pairs: every load is masked off)
    i = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(IDS + i, mask=i < n_pairs, other=-1).to(tl.int32)
    onehot = (e[:, None] == offs_e[None, :]).to(tl.int32)
    rank = tl.cumsum(onehot, axis=0)
    slot = tl.sum(onehot * (starts[None, :] + before[None, :] + rank - 1), axis=1)
    ok = (i < n_pairs) & (tl.sum(onehot, axis=1) > 0)
    tl.store(SORTED + slot, i, mask=ok)

    # padding slots (past each expert's pairs, and past the last block) get the sentinel n_pairs;
    # program c covers blocks c, c + n_prog, ... (disjoint from every pair's slot)
    fill_end = starts + counts
    for b in range(c, max_blocks, n_prog):
        s = b * BLOCK_M + tl.arange(0, BLOCK_M)
        inside = (s[:, None] >= starts[None, :]) & (s[:, None] < ends[None, :])
        pad = tl.sum((inside & (s[:, None] >= fill_end[None, :])).to(tl.int32), axis=1) > 0
        tl.store(SORTED + s, n_pairs, mask=pad | (s >= total))
        s0 = b * BLOCK_M
        first = (s0 >= starts) & (s0 < ends)
        expert = tl.sum(tl.where(first, offs_e, 0), axis=0)
        hit = tl.sum(first.to(tl.int32), axis=0) > 0
        tl.store(BLOCK_EXPERT + b, tl.where(hit, expert, -1))


@triton.jit
def _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr = False):
    """(slots, pairs, rmask) of row block pid_m: its slots in expert order, the (token, k) pair each
    holds (n_pairs or more in padding slots), and which slots hold one. PAIR_BLOCKS: no layout, block
    pid_m holds pair pid_m alone (in its first slot)."""
    rows = tl.arange(0, BLOCK_M)
    slots = pid_m * BLOCK_M + rows
    if PAIR_BLOCKS:
        pairs = tl.where(rows == 0, pid_m, n_pairs)
    else:
        pairs = tl.load(SORTED + slots)
    return slots, pairs, pairs < n_pairs


@triton.jit
def _store_weighted(acc, TOPK_W, OUT, pairs, rmask, offs_n, nmask, stride_ot):
    """OUT[pair, n] = routing weight of the pair * acc: each slot's row back in pair order."""
    wt = tl.load(TOPK_W + pairs, mask=rmask, other=0.0).to(tl.float32)
    o_ptr = OUT + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(o_ptr, (acc * wt[:, None]).to(OUT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["n_pairs"])
def up_kernel(
    X, W, SORTED, BLOCK_EXPERT, OUT,
    n_pairs, K, N,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr = False,
):
    """OUT[slot, n] = act(x[tok] . W[e, n]) * (x[tok] . W[e, N + n]) for the block's slots.
    PAIR_BLOCKS: BLOCK_EXPERT is the flat top-k ids and block b holds pair b alone (no layout)."""
    pid_n = tl.program_id(0)  # fastest: a row block's column tiles run together, its rows stay in L2
    pid_m = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M, PAIR_BLOCKS)
    tok = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk
    w_base = W + e.to(tl.int64) * stride_we
    g_ptr = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    u_ptr = g_ptr + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(g_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        wu = tl.load(u_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc_g += dot(a, wg, DOT_PREC)
        acc_u += dot(a, wu, DOT_PREC)
        a_ptr += BLOCK_K * stride_xk
        g_ptr += BLOCK_K * stride_wk
        u_ptr += BLOCK_K * stride_wk
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up
    o_ptr = OUT + slots.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(o_ptr, h.to(OUT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["n_pairs"])
def down_kernel(
    A, W, SORTED, BLOCK_EXPERT, TOPK_W, OUT,
    n_pairs, K, N,
    stride_at, stride_we, stride_wn, stride_wk, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr = False,
):
    """OUT[pair, n] = weight[pair] * (A[slot] . W[e, n]) for the block's slots (PAIR_BLOCKS: as up_kernel)."""
    pid_n = tl.program_id(0)  # fastest: a row block's column tiles run together, its rows stay in L2
    pid_m = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M, PAIR_BLOCKS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + slots.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptr = W + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc += dot(a, w, DOT_PREC)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K * stride_wk
    _store_weighted(acc, TOPK_W, OUT, pairs, rmask, offs_n, nmask, stride_ot)


# ----------------------------------------------------------------------------- sorted rows + TMA (prefill)
# At hundreds of rows per expert the GEMMs are compute-bound and the gathered row loads above keep
# them from TMA: `gather_kernel` first copies each slot's token row into a sorted [slots, H] buffer
# (zeros in padding slots), so every operand of both GEMMs is a plain 2-d tile that a tensor
# descriptor (TMA on SM90) loads. The down weights are read as a 2-d [E * H, I] view (expert e's
# tile starts at row e * H), the up weights as [E * 2, I, H] (gate and up halves side by side).
# Both GEMMs are persistent (one program per SM walking the tiles, the loop flattened so the next
# tile's loads overlap this tile's epilogue): H200, T = 2048, V2-Lite up 351 -> 320 us, down 186
# -> 176 us (docs/benchmarks/moe_prefill_gemms.md).
@triton.jit(do_not_specialize=["n_pairs"])
def gather_kernel(
    X, SORTED, BLOCK_EXPERT, XS,
    n_pairs, H, stride_xt,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """XS[slot] = x[token of slot's pair] (0 in padding slots) for the row blocks that hold an expert."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    slots, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M)
    tok = (pairs // TOP_K).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    v = tl.load(X + tok[:, None] * stride_xt + offs_h[None, :], mask=rmask[:, None] & hmask[None, :], other=0.0)
    tl.store(XS + slots.to(tl.int64)[:, None] * H + offs_h[None, :], v, mask=hmask[None, :])


@triton.jit
def _tile_of(tile, n_tiles_n, BLOCK_EXPERT, BLOCK_M: tl.constexpr):
    """(row block, column tile, expert, first slot) of a persistent GEMM's tile number: tiles run row
    block by row block, so a block's rows stay in L2 across its column tiles."""
    pid_m = tile // n_tiles_n
    return pid_m, tile % n_tiles_n, tl.load(BLOCK_EXPERT + pid_m), pid_m * BLOCK_M


@triton.jit
def up_sorted_kernel(
    XS_DESC, W_DESC, BLOCK_EXPERT, NUM_BLOCKS, O_DESC,
    K, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """OUT[slot, n] = act(xs[slot] . W[e, n]) * (xs[slot] . W[e, N + n]), all operands by descriptor.

    Persistent: NUM_PROGRAMS programs walk the used row blocks' tiles (row block by row block, so a
    block's rows stay in L2 across its column tiles). W_DESC views w_up as [E * 2, I, H] with a
    [2, BLOCK_N, BLOCK_K] box: one load brings the gate rows and the matching up rows, which one
    [BLOCK_M, 2 * BLOCK_N] product multiplies (the input tile is read once per k-step, not twice);
    the two halves of the accumulator are then split in registers."""
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n, e, m0 = _tile_of(tile, n_tiles_n, BLOCK_EXPERT, BLOCK_M)
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = XS_DESC.load([m0, ki * BLOCK_K])
            w = W_DESC.load([e * 2, pid_n * BLOCK_N, ki * BLOCK_K]).reshape([2 * BLOCK_N, BLOCK_K])
            acc += dot(a, tl.trans(w), DOT_PREC)
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
        O_DESC.store([m0, pid_n * BLOCK_N], h.to(O_DESC.dtype))


@triton.jit(do_not_specialize=["n_pairs"])
def down_sorted_kernel(
    A_DESC, W_DESC, SORTED, BLOCK_EXPERT, NUM_BLOCKS, TOPK_W, OUT,
    n_pairs, K, N, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """OUT[pair, n] = weight[pair] * (A[slot] . W[e, n]), operands by descriptor; persistent as above."""
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n, e, m0 = _tile_of(tile, n_tiles_n, BLOCK_EXPERT, BLOCK_M)
        row_w = e * N + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = A_DESC.load([m0, ki * BLOCK_K])
            w = W_DESC.load([row_w, ki * BLOCK_K])
            acc += dot(a, tl.trans(w), DOT_PREC)
        _, pairs, rmask = _block_pairs(SORTED, pid_m, n_pairs, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_weighted(acc, TOPK_W, OUT, pairs, rmask, offs_n, offs_n < N, stride_ot)


@triton.jit
def topk_sum_kernel(
    PAIR_OUT, IDS, OUT, T, H,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """OUT[t] = sum over j of PAIR_OUT[t * TOP_K + j], accumulated in fp32 (one pass over [T, k, H]).
    A pair whose expert id is negative is no pair (expert parallelism: another rank's expert, or a
    padding row): nothing wrote its row, so it is skipped, not added."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = offs_t < T
    mask = tmask[:, None] & (offs_h < H)[None, :]
    rows = offs_t.to(tl.int64) * TOP_K
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in range(TOP_K):
        live = tl.load(IDS + rows + j, mask=tmask, other=-1) >= 0
        acc += tl.load(PAIR_OUT + (rows + j)[:, None] * H + offs_h[None, :], mask=mask & live[:, None],
                       other=0.0).to(tl.float32)
    tl.store(OUT + offs_t.to(tl.int64)[:, None] * H + offs_h[None, :], acc.to(OUT.dtype.element_ty), mask=mask)
