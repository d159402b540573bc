"""The two expert GEMMs of the MoE prefill path, alone, against their earlier form and cuBLAS (issue 13).

At prefill sizes `triton_moe_experts` copies each (token, expert) pair's row into expert order, padded
to 128-row blocks (kernels.gather_kernel), and multiplies with every operand loaded by TMA
descriptor. This script times those two GEMMs one by one (CUDA-graph replays,
triton.testing.do_bench_cudagraph), each variant checked against the shipped kernel's output:

- `current`: kernels.up_sorted_kernel / down_sorted_kernel at tuning.moe_config's config (persistent,
  one program per SM, loop flattened; up: gate and up halves in one [128, 2 x up_n] product);
- `current, not flattened`: the same kernels with the tile loop's flatten off (inline copies);
- `two accumulators (before)`: the kernels before 2026-11-26 (one program per tile; up: gate and up
  in two [128, 64] accumulators, two products per k-step over the same input tile; down 128 x 128);
- `row-interleaved weights`: gate and up rows interleaved once in memory (row 2j gate j, 2j + 1 up j),
  one product, one program per tile (the first form of the single product that was tried);
- `current, 3 stages`: the shipped kernels one pipeline stage shallower;
- `current, weights in L2 (diagnostic)`: the shipped kernel with every block on expert 0, so the weights
  it streams (one expert's) stay in L2: its time when weight traffic from HBM is free (no error check);
- `TMA store in slot order (no weights)` (down): the epilogue as an asynchronous TMA store of the
  unweighted rows in slot order instead of a weighted scatter to pair order (which would move into the
  top-k sum); checked after applying the weights here;
- `each block its own expert` / `adjacent block pairs share an expert` / `one full block per expert`
  (diagnostics): the shipped kernel with the block table remapped so that no two blocks share an
  expert's weights, every two adjacent blocks do, or only one block per expert runs (a perfectly
  balanced routing): does the second block of an expert find its weight tiles in L2?
- `weights pre-tiled (contiguous boxes)`: the weights re-laid once so that every TMA box (the
  shipped kernel's reads 256 rows x 128 bytes at a 4 KB stride) is one contiguous block;
- `cuBLAS dense`: torch.mm on the same padded [slots, H] x [H, 2I] and [slots, I] x [I, H]: what a
  tuned dense GEMM reaches on this many rows (the padding costs it as much as us).

TFLOP/s are given on the useful rows (the pairs) and on the padded slots; the padding fraction
depends on rows per expert (uniform random routing here: V2-Lite 192 rows per expert at T = 2048,
2 blocks of 128 = 25% padding; GLM-4.7-Flash 128 rows, 31%).

    python -m benchmarks.moe.bench_moe_prefill_gemms --out /tmp/mpg [--tokens 2048,4096]
    python -m benchmarks.moe.bench_moe_prefill_gemms --render docs/benchmarks/moe_prefill_gemms.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch


SHAPES = {"v2_lite": (64, 6, 2048, 1408), "glm_4_7_flash": (64, 4, 2048, 1536)}  # E, top-k, H, I


def _kernels():
    """The inline comparison kernels (defined on first use: triton is only needed to run)."""
    import triton
    import triton.language as tl

    from benchmarks.lib import moe_tile_of

    @triton.jit
    def up_two_acc(XS_DESC, W_DESC, BLOCK_EXPERT, OUT, K, N, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        m0 = pid_m * BLOCK_M
        row_g = e * 2 * N + pid_n * BLOCK_N
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = XS_DESC.load([m0, k0])
            acc_g = tl.dot(a, tl.trans(W_DESC.load([row_g, k0])), acc_g)
            acc_u = tl.dot(a, tl.trans(W_DESC.load([row_g + N, k0])), acc_u)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        slots = m0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(OUT + slots.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], h.to(OUT.dtype.element_ty),
                 mask=(offs_n < N)[None, :])

    @triton.jit
    def up_row_interleaved(XS_DESC, W_DESC, BLOCK_EXPERT, OUT, K, N, stride_ot,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        m0 = pid_m * BLOCK_M
        row = e * 2 * N + pid_n * 2 * BLOCK_N
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(XS_DESC.load([m0, k0]), tl.trans(W_DESC.load([row, k0])), acc)
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        h = g / (1.0 + tl.exp(-g)) * u
        slots = m0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(OUT + slots.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], h.to(OUT.dtype.element_ty),
                 mask=(offs_n < N)[None, :])

    @triton.jit
    def up_not_flat(XS_DESC, W_DESC, BLOCK_EXPERT, NUM_BLOCKS, O_DESC, K, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
        n_tiles_n = tl.cdiv(N, BLOCK_N)
        total = tl.load(NUM_BLOCKS) * n_tiles_n
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
            pid_m = tile // n_tiles_n
            pid_n = tile % n_tiles_n
            e = tl.load(BLOCK_EXPERT + pid_m)
            m0 = pid_m * BLOCK_M
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for ki in range(tl.cdiv(K, BLOCK_K)):
                w = W_DESC.load([e * 2, pid_n * BLOCK_N, ki * BLOCK_K]).reshape([2 * BLOCK_N, BLOCK_K])
                acc = tl.dot(XS_DESC.load([m0, ki * BLOCK_K]), tl.trans(w), acc)
            g, u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
            O_DESC.store([m0, pid_n * BLOCK_N], (g / (1.0 + tl.exp(-g)) * u).to(O_DESC.dtype))

    @triton.jit
    def down_grid(A_DESC, W_DESC, SORTED, BLOCK_EXPERT, TOPK_W, OUT, n_pairs, K, N, stride_ot,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        m0 = pid_m * BLOCK_M
        row_w = e * N + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(A_DESC.load([m0, k0]), tl.trans(W_DESC.load([row_w, k0])), acc)
        pairs = tl.load(SORTED + m0 + tl.arange(0, BLOCK_M))
        rmask = pairs < n_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        wt = tl.load(TOPK_W + pairs, mask=rmask, other=0.0).to(tl.float32)
        tl.store(OUT + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
                 (acc * wt[:, None]).to(OUT.dtype.element_ty), mask=rmask[:, None] & (offs_n < N)[None, :])

    @triton.jit
    def down_slot_store(A_DESC, W_DESC, BLOCK_EXPERT, NUM_BLOCKS, O_DESC, K, N,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr):
        n_tiles_n = tl.cdiv(N, BLOCK_N)
        total = tl.load(NUM_BLOCKS) * n_tiles_n
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n, e, _ = moe_tile_of(tile, n_tiles_n, BLOCK_EXPERT, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for ki in range(tl.cdiv(K, BLOCK_K)):
                acc = tl.dot(A_DESC.load([pid_m * BLOCK_M, ki * BLOCK_K]),
                             tl.trans(W_DESC.load([e * N + pid_n * BLOCK_N, ki * BLOCK_K])), acc)
            O_DESC.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(O_DESC.dtype))

    @triton.jit
    def up_tiled_w(XS_DESC, WT_DESC, BLOCK_EXPERT, NUM_BLOCKS, O_DESC, K, N,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
        # weights pre-tiled: the [2 x BLOCK_N, BLOCK_K] tile (e, n, k) is one contiguous block of rows
        n_tiles_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        total = tl.load(NUM_BLOCKS) * n_tiles_n
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n, e, _ = moe_tile_of(tile, n_tiles_n, BLOCK_EXPERT, BLOCK_M)
            base = (e * n_tiles_n + pid_n) * k_tiles
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for ki in range(k_tiles):
                acc = tl.dot(XS_DESC.load([pid_m * BLOCK_M, ki * BLOCK_K]),
                             tl.trans(WT_DESC.load([(base + ki) * 2 * BLOCK_N, 0])), acc)
            g, u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
            O_DESC.store([pid_m * BLOCK_M, pid_n * BLOCK_N], (g / (1.0 + tl.exp(-g)) * u).to(O_DESC.dtype))

    @triton.jit
    def down_tiled_w(A_DESC, WT_DESC, SORTED, BLOCK_EXPERT, NUM_BLOCKS, TOPK_W, OUT, n_pairs, K, N, stride_ot,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_PROGRAMS: tl.constexpr):
        n_tiles_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        total = tl.load(NUM_BLOCKS) * n_tiles_n
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n, e, _ = moe_tile_of(tile, n_tiles_n, BLOCK_EXPERT, BLOCK_M)
            base = (e * n_tiles_n + pid_n) * k_tiles
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for ki in range(k_tiles):
                acc = tl.dot(A_DESC.load([pid_m * BLOCK_M, ki * BLOCK_K]),
                             tl.trans(WT_DESC.load([(base + ki) * BLOCK_N, 0])), acc)
            pairs = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            rmask = pairs < n_pairs
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            wt = tl.load(TOPK_W + pairs, mask=rmask, other=0.0).to(tl.float32)
            tl.store(OUT + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
                     (acc * wt[:, None]).to(OUT.dtype.element_ty), mask=rmask[:, None] & (offs_n < N)[None, :])

    return up_two_acc, up_row_interleaved, up_not_flat, down_grid, down_slot_store, up_tiled_w, down_tiled_w


def bench_shape(name: str, t: int) -> dict[str, Any]:
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.lib import moe_kernels as K
    from benchmarks.lib import persistent_programs, expert_layout
    from benchmarks.lib import moe_config

    up_two_acc, up_row_interleaved, up_not_flat, down_grid, down_slot_store, up_tiled_w, down_tiled_w = _kernels()
    e, k, h, i = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(t)
    w_up = (torch.randn(e, 2 * i, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(e, h, i, device=dev, generator=g) / i ** 0.5).to(torch.bfloat16)
    w_il = torch.stack([w_up[:, :i], w_up[:, i:]], dim=2).reshape(e, 2 * i, h).contiguous()
    x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    wts, ids = torch.topk(torch.rand(t, e, device=dev, generator=g).softmax(-1), k)
    n = t * k
    cfg = moe_config(n, e, h, i, torch.bfloat16, True)
    if not cfg.sorted_tma:
        raise SystemExit(f"{name} T={t}: the op does not take the sorted-rows path here (avg rows per expert too few)")
    bm = cfg.block_m
    lay = expert_layout(ids.reshape(-1), e, cfg)
    mb = lay.block_expert.shape[0]
    used = int(lay.num_blocks.item())
    xs = torch.empty(mb * bm, h, dtype=x.dtype, device=dev)
    K.gather_kernel[(mb, h // 128)](x, lay.sorted_pairs, lay.block_expert, xs, n, h, x.stride(0), TOP_K=k,
                                    BLOCK_M=bm, BLOCK_H=128)
    wflat = wts.reshape(-1).contiguous()
    valid = lay.sorted_pairs < n
    flops = {"up": (2 * n * h * 2 * i, 2 * used * bm * h * 2 * i), "down": (2 * n * i * h, 2 * used * bm * i * h)}
    row: dict[str, Any] = {"shape": name, "tokens": t, "pairs": n, "blocks_used": used, "slots": used * bm,
                           "pad_frac": 1 - n / (used * bm), "config": list(cfg.__dict__.values()),
                           "up": {}, "down": {}}

    def rec(kind: str, vname: str, fn: Callable[[], Any], err: Callable[[], float]) -> None:
        try:
            fn()
            torch.cuda.synchronize()
            e_ = err()
            ms = triton.testing.do_bench_cudagraph(fn, rep=60)
            fu, fp = flops[kind]
            row[kind][vname] = {"us": ms * 1e3, "tflops_useful": fu / ms / 1e9, "tflops_padded": fp / ms / 1e9,
                                "rel_err": e_}
            print(f"{name} T={t} {kind:4s} {vname:28s} {ms * 1e3:7.1f} us  useful {fu / ms / 1e9:4.0f}  "
                  f"padded {fp / ms / 1e9:4.0f} TFLOP/s  err {e_:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a variant may not compile; record it
            row[kind][vname] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name} T={t} {kind} {vname}: {row[kind][vname]['error']}", flush=True)

    # ---- up: the current kernel first (the reference of the others)
    inter = torch.zeros(mb * bm, i, dtype=x.dtype, device=dev)
    progs = persistent_programs(dev, mb * -(-i // cfg.up_n))
    xs_d = TensorDescriptor.from_tensor(xs, [bm, cfg.up_k])
    wu3_d = TensorDescriptor.from_tensor(w_up.view(e * 2, i, h), [2, cfg.up_n, cfg.up_k])
    out_d = TensorDescriptor.from_tensor(inter, [bm, cfg.up_n])

    def up_current():
        K.up_sorted_kernel[(progs,)](xs_d, wu3_d, lay.block_expert, lay.num_blocks, out_d, h, i, BLOCK_M=bm,
                                     BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, NUM_PROGRAMS=progs, DOT_PREC="tf32",
                                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    up_current()
    torch.cuda.synchronize()
    ref = inter.clone()
    scale = ref[valid].float().abs().max().item()

    def up_err(buf: torch.Tensor) -> Callable[[], float]:
        return lambda: (buf[valid].float() - ref[valid].float()).abs().max().item() / scale

    rec("up", "current", up_current, up_err(inter))
    buf1 = torch.zeros_like(inter)
    out1_d = TensorDescriptor.from_tensor(buf1, [bm, cfg.up_n])
    rec("up", "current, not flattened",
        lambda: up_not_flat[(progs,)](xs_d, wu3_d, lay.block_expert, lay.num_blocks, out1_d, h, i, BLOCK_M=bm,
                                      BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, NUM_PROGRAMS=progs,
                                      num_warps=cfg.num_warps, num_stages=cfg.num_stages), up_err(buf1))
    buf2 = torch.zeros_like(inter)
    xs64 = TensorDescriptor.from_tensor(xs, [bm, 64])
    w2_d = TensorDescriptor.from_tensor(w_up.view(e * 2 * i, h), [64, 64])
    rec("up", "two accumulators (before)",
        lambda: up_two_acc[(i // 64, mb)](xs64, w2_d, lay.block_expert, buf2, h, i, buf2.stride(0), BLOCK_M=bm,
                                          BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3), up_err(buf2))
    buf3 = torch.zeros_like(inter)
    wil_d = TensorDescriptor.from_tensor(w_il.view(e * 2 * i, h), [256, 64])
    rec("up", "row-interleaved weights",
        lambda: up_row_interleaved[(i // 128, mb)](xs64, wil_d, lay.block_expert, buf3, h, i, buf3.stride(0),
                                                   BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
        up_err(buf3))
    buf4 = torch.zeros_like(inter)
    out4_d = TensorDescriptor.from_tensor(buf4, [bm, cfg.up_n])
    for st in (3,):  # 5 stages do not fit: 5 x 48 KB + the 32 KB epilogue tile > 227 KB
        rec("up", f"current, {st} stages",
            lambda st=st: K.up_sorted_kernel[(progs,)](xs_d, wu3_d, lay.block_expert, lay.num_blocks, out4_d, h, i,
                                                        BLOCK_M=bm, BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k,
                                                        NUM_PROGRAMS=progs, DOT_PREC="tf32",
                                                        num_warps=cfg.num_warps, num_stages=st), up_err(buf4))
    # diagnostic: every block on expert 0, so the weights (one expert's, 12 MB) stay in L2: the time
    # the same kernel takes when weight traffic from HBM costs nothing (outputs differ: no error)
    one_expert = torch.where(lay.block_expert >= 0, 0, lay.block_expert).to(torch.int32)
    rec("up", "current, weights in L2 (diagnostic)",
        lambda: K.up_sorted_kernel[(progs,)](xs_d, wu3_d, one_expert, lay.num_blocks, out4_d, h, i, BLOCK_M=bm,
                                             BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, NUM_PROGRAMS=progs,
                                             DOT_PREC="tf32", num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages), lambda: float("nan"))
    # diagnostics of weight sharing between an expert's row blocks (outputs differ: no error check).
    # At T = 2048 most GLM experts get 2 blocks (the second nearly empty): are the second block's weight
    # tiles L2 hits (its tiles run beside the first block's) or a second read from HBM?
    ar = torch.arange(mb, device=dev, dtype=torch.int32)
    live = lay.block_expert >= 0
    sharing = [("each block its own expert", torch.where(live, ar % e, -1).to(torch.int32), lay.num_blocks),
               ("adjacent block pairs share an expert", torch.where(live, (ar // 2) % e, -1).to(torch.int32),
                lay.num_blocks),
               ("one full block per expert", torch.where(ar < e, ar, -1).to(torch.int32),
                torch.full_like(lay.num_blocks, min(e, mb)))]
    for dname, be, nb in sharing:
        rec("up", f"{dname} (diagnostic)",
            lambda be=be, nb=nb: K.up_sorted_kernel[(progs,)](xs_d, wu3_d, be, nb, out4_d, h, i, BLOCK_M=bm,
                                                              BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, NUM_PROGRAMS=progs,
                                                              DOT_PREC="tf32", num_warps=cfg.num_warps,
                                                              num_stages=cfg.num_stages), lambda: float("nan"))
    # weights re-laid once so each TMA box is one contiguous 32 KB block (the box of the shipped kernel
    # reads 256 rows x 128 bytes at a 4 KB stride)
    bn, bk = cfg.up_n, cfg.up_k
    wt_up = torch.stack([w_up[:, :i], w_up[:, i:]], 1).view(e, 2, i // bn, bn, h // bk, bk) \
        .permute(0, 2, 4, 1, 3, 5).contiguous().view(-1, bk)
    wt_up_d = TensorDescriptor.from_tensor(wt_up, [2 * bn, bk])
    rec("up", "weights pre-tiled (contiguous boxes)",
        lambda: up_tiled_w[(progs,)](xs_d, wt_up_d, lay.block_expert, lay.num_blocks, out4_d, h, i, BLOCK_M=bm,
                                     BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=progs, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages), up_err(buf4))
    del wt_up
    xs_used, w0 = xs[: used * bm], w_up[0].t().contiguous()
    rec("up", "cuBLAS dense", lambda: torch.mm(xs_used, w0), lambda: 0.0)

    # ---- down
    pair = torch.zeros(n, h, dtype=x.dtype, device=dev)
    progs_d = persistent_programs(dev, mb * -(-h // cfg.down_n))
    a_d = TensorDescriptor.from_tensor(ref, [bm, cfg.down_k])
    wd_d = TensorDescriptor.from_tensor(w_down.view(e * h, i), [cfg.down_n, cfg.down_k])

    def down_current():
        K.down_sorted_kernel[(progs_d,)](a_d, wd_d, lay.sorted_pairs, lay.block_expert, lay.num_blocks, wflat, pair,
                                         n, i, h, pair.stride(0), BLOCK_M=bm, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k,
                                         NUM_PROGRAMS=progs_d, DOT_PREC="tf32", num_warps=cfg.num_warps,
                                         num_stages=cfg.num_stages)
    down_current()
    torch.cuda.synchronize()
    dref = pair.clone()
    dscale = dref.float().abs().max().item()
    rec("down", "current", down_current, lambda: (pair.float() - dref.float()).abs().max().item() / dscale)
    dbuf = torch.zeros_like(pair)
    a64 = TensorDescriptor.from_tensor(ref, [bm, 64])
    wd128 = TensorDescriptor.from_tensor(w_down.view(e * h, i), [128, 64])
    rec("down", "grid 128 x 128 (before)",
        lambda: down_grid[(h // 128, mb)](a64, wd128, lay.sorted_pairs, lay.block_expert, wflat, dbuf, n, i, h,
                                          dbuf.stride(0), BLOCK_M=bm, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                          num_stages=3),
        lambda: (dbuf.float() - dref.float()).abs().max().item() / dscale)
    rec("down", "current, 3 stages",
        lambda: K.down_sorted_kernel[(progs_d,)](a_d, wd_d, lay.sorted_pairs, lay.block_expert, lay.num_blocks, wflat,
                                                 dbuf, n, i, h, dbuf.stride(0), BLOCK_M=bm, BLOCK_N=cfg.down_n,
                                                 BLOCK_K=cfg.down_k, NUM_PROGRAMS=progs_d, DOT_PREC="tf32",
                                                 num_warps=cfg.num_warps, num_stages=3),
        lambda: (dbuf.float() - dref.float()).abs().max().item() / dscale)
    rec("down", "current, weights in L2 (diagnostic)",
        lambda: K.down_sorted_kernel[(progs_d,)](a_d, wd_d, lay.sorted_pairs, one_expert, lay.num_blocks, wflat,
                                                 dbuf, n, i, h, dbuf.stride(0), BLOCK_M=bm, BLOCK_N=cfg.down_n,
                                                 BLOCK_K=cfg.down_k, NUM_PROGRAMS=progs_d, DOT_PREC="tf32",
                                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        lambda: float("nan"))
    for dname, be, nb in sharing:
        rec("down", f"{dname} (diagnostic)",
            lambda be=be, nb=nb: K.down_sorted_kernel[(progs_d,)](a_d, wd_d, lay.sorted_pairs, be, nb, wflat, dbuf, n,
                                                                  i, h, dbuf.stride(0), BLOCK_M=bm, BLOCK_N=cfg.down_n,
                                                                  BLOCK_K=cfg.down_k, NUM_PROGRAMS=progs_d,
                                                                  DOT_PREC="tf32", num_warps=cfg.num_warps,
                                                                  num_stages=cfg.num_stages), lambda: float("nan"))
    dn, dk = cfg.down_n, cfg.down_k
    wt_down = w_down.view(e, h // dn, dn, i // dk, dk).permute(0, 1, 3, 2, 4).contiguous().view(-1, dk)
    wt_down_d = TensorDescriptor.from_tensor(wt_down, [dn, dk])
    rec("down", "weights pre-tiled (contiguous boxes)",
        lambda: down_tiled_w[(progs_d,)](a_d, wt_down_d, lay.sorted_pairs, lay.block_expert, lay.num_blocks, wflat,
                                         dbuf, n, i, h, dbuf.stride(0), BLOCK_M=bm, BLOCK_N=dn, BLOCK_K=dk,
                                         NUM_PROGRAMS=progs_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        lambda: (dbuf.float() - dref.float()).abs().max().item() / dscale)
    del wt_down
    # the epilogue as a TMA store of unweighted rows in slot order (the routing weights and the return
    # to pair order would move into the top-k sum): error checked on the used slots, weights applied here
    slot_out = torch.zeros(mb * bm, h, dtype=x.dtype, device=dev)
    so_d = TensorDescriptor.from_tensor(slot_out, [bm, cfg.down_n])
    pair_of_slot = lay.sorted_pairs[: used * bm].long()
    keep = pair_of_slot < n

    def slot_err() -> float:
        got = slot_out[: used * bm][keep].float() * wflat[pair_of_slot[keep]].float()[:, None]
        return (got - dref[pair_of_slot[keep]].float()).abs().max().item() / dscale

    # 3 stages: 4 x 48 KB + the [128, 256] bf16 store tile (64 KB) would exceed 227 KB of shared memory
    rec("down", "TMA store in slot order (no weights), 3 stages",
        lambda: down_slot_store[(progs_d,)](a_d, wd_d, lay.block_expert, lay.num_blocks, so_d, i, h, BLOCK_M=bm,
                                            BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, NUM_PROGRAMS=progs_d,
                                            num_warps=cfg.num_warps, num_stages=3), slot_err)
    inter_used, wd0 = ref[: used * bm], w_down[0].t().contiguous()
    rec("down", "cuBLAS dense", lambda: torch.mm(inter_used, wd0), lambda: 0.0)
    return row


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    m = data["meta"]
    out = ["# MoE prefill: the two expert GEMMs alone (sorted rows, TMA operands)", "",
           f"Machine: {m['gpu']}, torch {m['torch']}, triton {m['triton']}, {m['date']}.", "",
           f"Command: `{m['command']}`", "",
           "µs per call (CUDA-graph replays); TFLOP/s on the useful rows / on the padded 128-row slots; "
           "rel err against the current kernel.", "",
           "| shape | T | pad | GEMM | variant | µs | TFLOP/s useful | TFLOP/s padded | vs current | rel err |",
           "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        for kind in ("up", "down"):
            cur = r[kind].get("current", {}).get("us")
            for vn, v in r[kind].items():
                if "us" not in v:
                    out.append(f"| {r['shape']} | {r['tokens']} | {r['pad_frac']:.0%} | {kind} | {vn} | error: "
                               f"{v['error'][:80]} | | | | |")
                    continue
                rel = f"{v['us'] / cur:.2f}x" if cur else "-"
                out.append(f"| {r['shape']} | {r['tokens']} | {r['pad_frac']:.0%} | {kind} | {vn} | {v['us']:.1f} | "
                           f"{v['tflops_useful']:.0f} | {v['tflops_padded']:.0f} | {rel} | {v['rel_err']:.1e} |")
    path.with_suffix(".md").write_text("\n".join(out) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("up", "down")):
        names = list(dict.fromkeys(vn for r in rows for vn, v in r[kind].items() if "us" in v))
        width = 0.8 / max(1, len(names))
        for j, vn in enumerate(names):
            ax.bar([x + j * width for x in range(len(rows))],
                   [r[kind].get(vn, {}).get("tflops_useful", 0) for r in rows], width, label=vn)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
        ax.set_xticklabels([f"{r['shape']}\nT={r['tokens']}" for r in rows], fontsize=8)
        ax.set_ylabel("TFLOP/s on useful rows")
        ax.set_title(f"{kind} GEMM")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="2048,4096")
    args = ap.parse_args()
    if args.render:
        render(args.render)
        return
    if args.out is None:
        ap.error("--out is required (or --render)")
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_prefill_gemms.py times CUDA kernels: no CUDA device here")
    import datetime

    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [bench_shape(s, int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "moe_prefill_gemms.json"
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "date": str(datetime.date.today())}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    render(path)
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
