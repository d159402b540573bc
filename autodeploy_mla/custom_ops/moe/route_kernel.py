"""Triton kernel of the MoE routing op (routing.py has the contract and the reference).

`route_kernel`: one program per BLOCK_T token rows holds the rows' logits for all experts
([BLOCK_T, E_PAD] fp32 in registers), computes the scores, the biased choice, the group scores (max or top-2 sum per group,
one static pass per group), keeps the TOPK_GROUP best groups, then picks the K experts by repeated
arg-max (ties: the lowest index; a taken expert is never picked again, even when every remaining
choice is -inf) and writes their weights normalised and scaled, and their ids as int64.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _route_rows(x, cols, cmask, BIAS, scale, SCORE_TY: tl.constexpr,
                E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_TOP2: tl.constexpr,
                FILL_NEG_INF: tl.constexpr, FILL: tl.constexpr, FROM_CHOICE: tl.constexpr,
                RENORM: tl.constexpr, EPS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Routing of BLOCK_T rows of fp32 logits `x` [BLOCK_T, E_PAD] (-inf past E): (weights, ids)
    [BLOCK_T, K_PAD], weights normalised and scaled."""
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        mx = tl.max(x, axis=1)
        ex = tl.exp(x - mx[:, None])
        s = ex / tl.sum(ex, axis=1)[:, None]
    # the scores in the logits' dtype, as the model computes them (bf16 routers round here)
    s = s.to(SCORE_TY).to(tl.float32)
    s = tl.where(cmask[None, :], s, 0.0)
    if HAS_BIAS:
        b = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)
        c = s + b[None, :]
    else:
        c = s
    c = tl.where(cmask[None, :], c, float("-inf"))

    if N_GROUP > 1:
        PER: tl.constexpr = E // N_GROUP
        grp = cols // PER
        gcols = tl.arange(0, G_PAD)
        gs = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            cg = tl.where(((grp == g) & cmask)[None, :], c, float("-inf"))
            m1 = tl.max(cg, axis=1)
            if GROUP_TOP2:
                first = tl.min(tl.where(cg == m1[:, None], cols[None, :], E_PAD), axis=1)
                m2 = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), cg), axis=1)
                val = m1 + m2
            else:
                val = m1
            gs = tl.where(gcols[None, :] == g, val[:, None], gs)
        gtaken = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int32)
        keep = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
        gvalid = gcols[None, :] < N_GROUP
        for _j in tl.static_range(TOPK_GROUP):
            gm = tl.where((gtaken == 0) & gvalid, gs, float("-inf"))
            gmax = tl.max(gm, axis=1)
            gsel = tl.min(tl.where((gm == gmax[:, None]) & (gtaken == 0) & gvalid, gcols[None, :], G_PAD), axis=1)
            gtaken = tl.where(gcols[None, :] == gsel[:, None], 1, gtaken)
            keep = tl.where(grp[None, :] == gsel[:, None], 1, keep)
        if FILL_NEG_INF:
            c = tl.where(keep > 0, c, float("-inf"))
        else:
            c = tl.where(keep > 0, c, FILL)
        c = tl.where(cmask[None, :], c, float("-inf"))

    if FROM_CHOICE:
        src = c
    else:
        src = s
    kcols = tl.arange(0, K_PAD)
    taken = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
    wacc = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    iacc = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(K):
        free = (taken == 0) & cmask[None, :]
        cm = tl.where(free, c, float("-inf"))
        best = tl.max(cm, axis=1)
        idx = tl.min(tl.where((cm == best[:, None]) & free, cols[None, :], E_PAD), axis=1)
        hit = cols[None, :] == idx[:, None]
        wj = tl.sum(tl.where(hit, src, 0.0), axis=1)
        taken = tl.where(hit, 1, taken)
        wacc = tl.where(kcols[None, :] == j, wj[:, None], wacc)
        iacc = tl.where(kcols[None, :] == j, idx[:, None], iacc)
    if RENORM:
        wacc = wacc / (tl.sum(wacc, axis=1)[:, None] + EPS)
    return wacc * scale, iacc


@triton.jit
def _store(W, IDS, rows, rmask, wacc, iacc, K: tl.constexpr, K_PAD: tl.constexpr):
    kcols = tl.arange(0, K_PAD)
    omask = rmask[:, None] & (kcols[None, :] < K)
    tl.store(W + rows[:, None] * K + kcols[None, :], wacc.to(W.dtype.element_ty), mask=omask)
    tl.store(IDS + rows[:, None] * K + kcols[None, :], iacc.to(tl.int64), mask=omask)


@triton.jit(do_not_specialize=["T"])
def route_kernel(
    LOGITS, BIAS, W, IDS, T, stride_t, scale,
    E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_TOP2: tl.constexpr,
    FILL_NEG_INF: tl.constexpr, FILL: tl.constexpr, FROM_CHOICE: tl.constexpr,
    RENORM: tl.constexpr, EPS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Routing of BLOCK_T rows of given logits [T, E]."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    rmask = rows < T
    cmask = cols < E
    x = tl.load(LOGITS + rows[:, None] * stride_t + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))
    wacc, iacc = _route_rows(x, cols, cmask, BIAS, scale, LOGITS.dtype.element_ty, E, E_PAD, K, K_PAD, N_GROUP,
                             G_PAD, TOPK_GROUP, SIGMOID, HAS_BIAS, GROUP_TOP2, FILL_NEG_INF, FILL, FROM_CHOICE,
                             RENORM, EPS, BLOCK_T)
    _store(W, IDS, rows, rmask, wacc, iacc, K, K_PAD)
