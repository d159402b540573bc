"""The Triton op's launch planners and launchers: append, the absorbed attention (heads on M or N,
split-K and its merge), the Gluon decode, the expanded prefill (own kernel or FA3 attention), and
the launch configs under the policy. Each planner makes one step's plan for every layer of a kind
(`OpCall.plan`); each launcher runs it on one layer's tensors."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..attention.cache_format import FP8_DTYPE, FP8_MAX, UNIT_SCALES, CacheScales, is_fp8
from ..attention.mla_dims import MLADims, MLAShapeError
from ..attention.prefill_kernels import PrefillAttention
from ..triton_helpers import dot_precision, interpreting, pow2
from . import gluon_decode as GD
from . import tuning
from .call import OpCall, capturing_on, per_model
from .launch import BoundKernel
from .policy import DEFAULT_POLICY
from .step_shape import StepShape
from .tuning import (MULTI_TOKEN_MAX_Q, absorb_prefill_config, decode_config, expand_config, heads_on_n_supported,
                     min_chunk, multi_token_config, nope_chunks, num_sms, resident_programs, split_plan,
                     split_plan_waves)

try:  # Triton is optional: without it the op is registered but check() refuses every node.
    import triton

    from . import kernels as K

    HAS_TRITON = True
    TRITON_IMPORT_ERROR = ""
except ImportError as e:  # pragma: no cover - exercised only without triton
    triton = None
    K = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = str(e)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- launchers
APPEND_BLOCK_T = 16


def _append_kernel(call: OpCall, dims: MLADims, cache_dtype: torch.dtype) -> BoundKernel:
    r, dr = dims.kv_lora_rank, dims.qk_rope_head_dim
    return call.bound(K.append_kernel, dict(R=r, DR=dr, BLOCK_T=APPEND_BLOCK_T, BLOCK_R=pow2(r), BLOCK_DR=pow2(dr),
                                            QUANT=is_fp8(cache_dtype), EXACT_CAST=interpreting(), num_warps=4))


def launch_append(compressed_kv, kpe, mla_cache, cache_loc, num_tok, dims, scales: CacheScales = UNIT_SCALES,
                   call: Optional[OpCall] = None):
    """append_kernel over the first `num_tok` tokens (the cache is passed whole: its rows are
    [num_pages * page_size, R + Dr] with row stride mla_cache.stride(1))."""
    call = call or OpCall(DEFAULT_POLICY)
    bk = call.plan(("append", dims, mla_cache.dtype), lambda: _append_kernel(call, dims, mla_cache.dtype))
    bk.launch((triton.cdiv(num_tok, APPEND_BLOCK_T),), (compressed_kv, kpe, mla_cache, cache_loc),
              (num_tok, 1.0 / scales.latent, 1.0 / scales.rope, compressed_kv.stride(1), kpe.stride(1),
               mla_cache.stride(1)))


def cache_scaled(mla_cache: torch.Tensor, scales: CacheScales) -> bool:
    """Whether the kernels must apply the cache's scales (an FP8 cache with scales other than 1)."""
    return is_fp8(mla_cache.dtype) and not scales.identity


def quantize_queries(q_abs: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_abs / s0, q_pe / s1 in e4m3, [s0, s1] fp32 on the device): per-call scales from each part's
    amax (no host sync), for the FP8_DOT kernels."""
    pe_amax = q_pe.abs().amax() if q_pe.numel() else q_abs.new_zeros(())  # Dr = 0: no rope part
    amax = torch.stack([q_abs.abs().amax(), pe_amax]).float()
    qs = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q8 = (q_abs.float() / qs[0]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    qpe8 = (q_pe.float() / qs[1]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q8, qpe8, qs


def _heads_on_n_descriptors(flat: torch.Tensor, block_n: int, block_c: int, dr: int):
    """(latent, rope) tensor descriptors of whole one-page KV tiles of one layer's cache, or
    (None, None) where its rows are not 16-byte aligned. The config and the device were checked by
    the launch plan (`_AbsorbedLaunch.tma_ok`: TMA asked for, SM90+, tiles inside one page)."""
    if (flat.stride(0) * flat.element_size()) % 16 or flat.data_ptr() % 16:
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(flat, [block_n, block_c]),
            TensorDescriptor.from_tensor(flat, [block_n, pow2(dr)]) if dr else None)


def _reduce_meta(r: int) -> dict[str, Any]:
    return dict(R=r, BLOCK_R=pow2(r), num_warps=4 if r <= 256 else 8)


@dataclass(frozen=True)
class _AbsorbedLaunch:
    """One absorbed launch of a step, planned once for every layer of the same kind: the attention
    kernel (+ split merge), grid, split count and chunk."""

    attn: BoundKernel
    reduce: Optional[BoundKernel]
    grid: tuple[int, int, int]
    splits: int
    chunk: int
    heads_on_n: bool
    block_c: int
    tma_ok: bool  # the config asks for TMA tiles and the device has them (the cache's alignment is per layer)


def _plan_absorbed(call: OpCall, cfg, dims: MLADims, q_dtype: torch.dtype, mla_cache: torch.Tensor, scaled: bool,
                   fp8_dot: bool, n_seqs: int, max_q: int, kv_bound: int, dev: torch.device,
                   work_list: int = 0, max_splits: int = 0) -> _AbsorbedLaunch:
    """work_list > 0 (static bounds): one program per (work item, head block) over all sequences,
    items found in the kernel from the device cu_seqlen (`kernels._work_item`), `work_list` = the
    sequence capacity and `max_q` = the token count (at most ceil(T / BLOCK_Q) + sequences items,
    and at most T). The split count comes from `kv_bound` (under capture: the capacity); the kernel
    cuts each program's history into that many chunks of at least min_chunk (`_absorbed_work`).
    max_splits > 0 caps the split count."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    num_hb = triton.cdiv(n, cfg.block_h)
    if work_list:
        num_qb, n_seqs = min(max_q, triton.cdiv(max_q, cfg.block_q) + work_list), 1
    else:
        num_qb = triton.cdiv(max_q, cfg.block_q)
    progs = n_seqs * num_hb * num_qb
    page_size = mla_cache.shape[1]
    if cfg.heads_on_n:
        width = pow2(r) + (pow2(dr) if dr else 0)
        partial = cfg.block_h * cfg.block_q * r * 8 / (cfg.block_n * width * mla_cache.element_size())
        splits, chunk = split_plan_waves(progs, kv_bound, cfg.block_n, call.policy.decode_splits, dev,
                                         num_sms(dev) * resident_programs(cfg, dims, mla_cache.element_size(), dev),
                                         partial)
    else:
        splits, chunk = split_plan(progs, kv_bound, cfg.block_n, call.policy.decode_splits, dev)
    if max_splits and splits > max_splits:
        splits, chunk = split_plan(progs, kv_bound, cfg.block_n, max_splits, dev)
    # The kernel cuts each program's own history into `splits` chunks of at least this (whole tiles):
    # the plan fixes only the split count.
    chunk = min(chunk, -(-min_chunk(dev) // cfg.block_n) * cfg.block_n)
    meta = dict(
        N=n, R=r, DR=dr, PAGE_SIZE=page_size, NUM_HB=num_hb, BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n, BLOCK_DR=pow2(dr), DOT_PREC=dot_precision(q_dtype), SCALED=scaled,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if work_list:
        meta.update(B_CAP=work_list, B_PAD=pow2(work_list))
    block_c = 0
    tma_ok = False
    if cfg.heads_on_n:
        if fp8_dot:
            raise AssertionError("FP8_DOT runs on absorbed_attn_kernel only (decode_config picks it)")
        kernel = K.absorbed_attn_heads_on_n_kernel
        block_c = max(16, pow2(r) // 2)
        tma_ok = (cfg.tma and dev.type == "cuda" and page_size % cfg.block_n == 0
                  and torch.cuda.get_device_capability(dev) >= (9, 0))
        meta.update(BLOCK_C=block_c, F16=is_fp8(mla_cache.dtype) and q_dtype == torch.bfloat16,
                    WS=cfg.warp_spec and dev.type == "cuda" and not interpreting())
    else:
        kernel = K.absorbed_attn_kernel
        meta.update(BLOCK_R=pow2(r), FP8_DOT=fp8_dot, EXACT_CAST=interpreting())
    split = splits > 1
    if cfg.heads_on_n:  # USE_TMA is decided per layer (the cache's alignment): both variants may run
        attn = call.bound(kernel, {**meta, "SPLIT": split, "USE_TMA": tma_ok})
    else:
        attn = call.bound(kernel, {**meta, "SPLIT": split})
    reduce = call.bound(K.split_reduce_kernel, {**_reduce_meta(r), "B_CAP": work_list}) if split else None
    return _AbsorbedLaunch(attn, reduce, (num_hb * num_qb, n_seqs, splits), splits, chunk, cfg.heads_on_n, block_c,
                           tma_ok)


def launch_absorbed(call: OpCall, q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len, latent,
                     *, seq_base, n_seqs, tok_base, n_tok, abs_base, max_q, kv_bound, cfg, dims, qk_scale,
                     scales: CacheScales = UNIT_SCALES, q_scale: Optional[torch.Tensor] = None,
                     work_list: int = 0, max_splits: int = 0) -> int:
    """`q_scale` given: q_abs / q_pe are e4m3 (quantize_queries) and the kernel runs e4m3 MMAs.
    `cfg.heads_on_n`: absorbed_attn_heads_on_n_kernel (never with q_scale). `work_list`,
    `max_splits`: see _plan_absorbed (static bounds). Returns the split count."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_abs.device
    scaled = cache_scaled(mla_cache, scales) or q_scale is not None
    fp8_dot = q_scale is not None
    key = ("absorbed", cfg, dims, q_abs.dtype, mla_cache.dtype, mla_cache.shape[1], scaled, fp8_dot, n_seqs, max_q,
           kv_bound, work_list, max_splits)
    plan = call.plan(key, lambda: _plan_absorbed(call, cfg, dims, q_abs.dtype, mla_cache, scaled, fp8_dot, n_seqs,
                                                  max_q, kv_bound, dev, work_list, max_splits))
    splits, chunk = plan.splits, plan.chunk
    flat_stride = mla_cache.stride(1)
    if plan.heads_on_n:
        descs = _cache_descriptors(call, mla_cache, cfg, plan.block_c, dr) if plan.tma_ok else (None, None)
        attn = plan.attn
        if plan.tma_ok and descs[0] is None:  # this layer's cache cannot take TMA: the pointer variant
            attn = call.bound(attn.fn, {**attn.constexprs, "USE_TMA": False})
        extra: tuple[Any, ...] = descs
    else:
        attn = plan.attn
        extra = (latent if q_scale is None else q_scale,)

    def args(part_acc, part_lse):
        is_split = part_acc is not latent
        pa = part_acc.stride()[:3] if is_split else (0, 0, 0)
        pl = part_lse.stride()[:2] if is_split else (0, 0)
        ptrs = (q_abs, q_pe, mla_cache, page_table, cu_seqlen, input_pos, seq_len, latent, part_acc, part_lse, *extra)
        scalars = (seq_base, tok_base, abs_base, chunk, qk_scale, scales.latent, scales.rope,
                   q_abs.stride(0), q_abs.stride(1), q_pe.stride(1), q_pe.stride(2),
                   flat_stride, page_table.stride(0), latent.stride(0), latent.stride(1), *pa, *pl)
        red = (tok_base, abs_base, splits, *pa, *pl, latent.stride(0), latent.stride(1))
        return ptrs, scalars, (part_acc, part_lse, latent, cu_seqlen), red

    if dev.type == "cuda" and not capturing_on(dev):
        # Load both variants (SPLIT or not) now, in eager mode: a decode step captured into a CUDA
        # graph later plans its splits from the static capacity and may need the other variant,
        # and loading a kernel module while a stream is capturing is not allowed.
        wkey = (cfg, dims, q_abs.dtype, mla_cache.dtype, scaled, fp8_dot, dev, mla_cache.shape[1], extra[0] is None,
                work_list)
        if call.warmed is None or wkey not in call.warmed:
            dummy_acc = torch.empty(1, n, 2, r, dtype=torch.float32, device=dev)
            dummy_lse = torch.empty(1, n, 2, dtype=torch.float32, device=dev)
            for pa_, pl_, sp in ((latent, latent, False), (dummy_acc, dummy_lse, True)):
                ptrs, scalars, rptrs, red = args(pa_, pl_)
                call.bound(attn.fn, {**attn.constexprs, "SPLIT": sp}).warmup(ptrs, scalars)
                if sp:
                    call.bound(K.split_reduce_kernel, {**_reduce_meta(r), "B_CAP": work_list}).warmup(rptrs, red)
            if call.warmed is not None:
                call.warmed.add(wkey)

    if splits > 1:
        part_acc = call.empty(n_tok, n, splits, r, dtype=torch.float32, device=dev)
        part_lse = call.empty(n_tok, n, splits, dtype=torch.float32, device=dev)
    else:
        part_acc = part_lse = latent  # unused
        if work_list:  # static bounds, one split: no program writes the padded tokens' rows (a merge would)
            latent.zero_()
    ptrs, scalars, rptrs, red = args(part_acc, part_lse)
    attn.launch(plan.grid, ptrs, scalars)
    if plan.reduce is not None:
        plan.reduce.launch((n_tok, n), rptrs, red)
    return splits


def gluon_decode_choice(call: OpCall, cfg, dims: MLADims, q_dtype: torch.dtype, mla_cache: torch.Tensor,
                         dev: torch.device, scaled: bool) -> bool:
    """Whether this step's decode runs on the Gluon kernels (TritonPolicy.decode_kernel). "auto": where
    gluon_decode.supports accepts the dims and device and either the `tl` decode would run heads-on-N
    or N > 32 (the many-heads Gluon kernel: 1.2-3.0x faster than the `tl` kernel on all 24 measured
    N 64 / 128 shapes, docs/benchmarks/decode_gluon_wide.md); "gluon" raises where it cannot serve them."""
    want = call.policy.decode_kernel
    if want == "triton":
        return False
    if interpreting():
        ok, why = False, "the Triton interpreter (TRITON_INTERPRET=1) does not run Gluon kernels"
    else:
        ok, why = GD.supports(dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, mla_cache.shape[1], q_dtype,
                              mla_cache.dtype, dev)
    if ok and scaled:
        ok, why = False, "the Gluon decode kernel does not apply cache scales"
    if want == "gluon" and not ok:
        raise MLAShapeError(f"TritonPolicy(decode_kernel='gluon') cannot run this decode: {why}. "
                            "Use decode_kernel='auto' or 'triton'.")
    return ok and (want == "gluon" or cfg.heads_on_n or dims.num_heads > GD.NARROW_MAX_HEADS)


@dataclass(frozen=True)
class _GluonDecodeLaunch:
    """The Gluon decode of a step, planned once for every layer: the kernel variant, its split merge,
    grid, split count and minimum chunk; `q_heads` > 0: the many-heads kernel, which reads the latent
    queries through a TMA descriptor with boxes of that many heads."""

    attn: BoundKernel
    reduce: Optional[BoundKernel]
    grid: tuple[int, int, int]
    splits: int
    chunk: int
    q_heads: int = 0
    #: heads per program of the split merge (> 1: split_reduce_heads_kernel)
    reduce_heads: int = 1


def _plan_gluon_decode(call: OpCall, dims: MLADims, page_size: int, n_seqs: int, kv_bound: int,
                       dev: torch.device) -> _GluonDecodeLaunch:
    """Config and split count from `gluon_decode.plan` (the wave model, as for the `tl` heads-on-N
    kernel), bound kernels for the step's layers."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    gcfg, splits = GD.plan(n, r, dr, n_seqs, kv_bound, call.policy.decode_splits, dev)
    chunk = -(-min_chunk(dev) // GD.BLOCK_N) * GD.BLOCK_N
    split = splits > 1
    attn = call.bound(GD.kernel_for(gcfg), GD.kernel_meta(n, r, dr, page_size, gcfg, split))
    heads = _reduce_heads(n, r, n_seqs, splits) if gcfg.wide else 1
    reduce = None
    if split:
        reduce = call.bound(K.split_reduce_kernel, _reduce_meta(r)) if heads == 1 else \
            call.bound(K.split_reduce_heads_kernel, _reduce_heads_meta(r, heads))
    return _GluonDecodeLaunch(attn, reduce, GD.grid(n, n_seqs, splits, gcfg), splits, chunk,
                              gcfg.cols if gcfg.wide else 0, heads)


#: split_reduce_heads_kernel's heads per program
REDUCE_HEADS = 4


def _reduce_heads(n: int, r: int, n_seqs: int, splits: int) -> int:
    """Heads per program of the many-heads decode's split merge: REDUCE_HEADS where the merge has many
    (token, head) rows and few splits, else 1 (split_reduce_kernel). Measured on an H200 (merge after
    the decode, CUDA graph): N 128 batch 32 two splits 49.8 vs 51.6 us, N 64 batch 32 four splits
    41.8 vs 42.0; with 8+ splits or batch <= 8 the one-head merge is faster (batch 8, 8 splits: 50.0
    vs 48.8 us)."""
    ok = _reduce_heads_serves(n, r) and splits <= 4 and n_seqs * n >= 2048
    return REDUCE_HEADS if ok else 1


def _reduce_heads_serves(n: int, r: int) -> bool:
    """Whether split_reduce_heads_kernel can merge these dims (whole head blocks, R a power of two)."""
    return n % REDUCE_HEADS == 0 and r & (r - 1) == 0


def _reduce_heads_meta(r: int, heads: int) -> dict[str, Any]:
    return dict(R=r, BLOCK_H=heads, num_warps=4)


def _warm_gluon_decode(call: OpCall, descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, dims: MLADims,
                       page_size: int, common: dict[str, Any], q_desc=None) -> None:
    """Compile and load every Gluon decode variant this layer may launch (SPLIT or not, each
    candidate config) and the split merge, without launching them."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_abs.device
    dummy_acc = torch.empty(1, n, 2, r, dtype=torch.float32, device=dev)
    dummy_lse = torch.empty(1, n, 2, dtype=torch.float32, device=dev)
    for split in (False, True):
        pa, pl = (dummy_acc, dummy_lse) if split else (latent, latent)
        for gcfg in GD.candidate_configs(n, r, dr):  # a graph of another batch size may pick the other
            ptrs, scalars = GD.kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, pa, pl,
                                           split=split, q_desc=q_desc if gcfg.wide else None, **common)
            call.bound(GD.kernel_for(gcfg), GD.kernel_meta(n, r, dr, page_size, gcfg, split)).warmup(ptrs, scalars)
        if split:
            rest = (common["tok_base"], common["abs_base"], 2, *pa.stride()[:3], *pl.stride()[:2], latent.stride(0),
                    latent.stride(1))
            call.bound(K.split_reduce_kernel, _reduce_meta(r)).warmup((pa, pl, latent, cu_seqlen), rest)
            # The several-heads merge too, wherever some batch size of these dims would pick it.
            if any(c.wide for c in GD.candidate_configs(n, r, dr)) and _reduce_heads_serves(n, r):
                call.bound(K.split_reduce_heads_kernel, _reduce_heads_meta(r, REDUCE_HEADS)).warmup(
                    (pa, pl, latent), rest)


def launch_gluon_decode(call: OpCall, q_abs, q_pe, mla_cache, page_table, cu_seqlen, seq_len, latent, *, seq_base,
                         n_seqs, tok_base, abs_base, kv_bound, dims: MLADims, qk_scale: float) -> int:
    """The decode sequences [seq_base, seq_base + n_seqs) on gluon_decode_kernel (+ the split merge).
    Returns the split count, or 0 (nothing launched) where this layer's cache rows are not 16-byte
    aligned for TMA."""
    n, r, dr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_abs.device
    key = ("gluon", mla_cache.data_ptr(), tuple(mla_cache.shape), mla_cache.dtype)
    descs = per_model(call.descriptors, key, lambda: GD.cache_descriptors(mla_cache, r, dr), call.memo_limit)
    if descs is None:
        return 0
    page_size = mla_cache.shape[1]
    wkey = ("gluon", dims, q_abs.dtype, mla_cache.dtype, page_size, dev)
    if call.warmed is not None and ("gluon failed",) + wkey in call.warmed:
        return 0
    plan = call.plan(("gluon_decode", dims, q_abs.dtype, page_size, n_seqs, kv_bound),
                     lambda: _plan_gluon_decode(call, dims, page_size, n_seqs, kv_bound, dev))
    common = dict(seq_base=seq_base, tok_base=tok_base, abs_base=abs_base, chunk=plan.chunk, qk_scale=qk_scale)
    q_desc = None
    if plan.q_heads:
        q_desc = GD.query_descriptor(q_abs, plan.q_heads)
        if q_desc is None:
            return 0
    if not capturing_on(dev) and (call.warmed is None or wkey not in call.warmed):
        # Every variant (SPLIT or not, each candidate config) loaded eagerly: a decode graph captured
        # later plans its splits from the static capacity and its config from its batch size, and may
        # need another one (no module loads while capturing).
        try:
            _warm_gluon_decode(call, descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, dims, page_size,
                               common, q_desc)
        except Exception as e:  # noqa: BLE001 - a Triton whose Gluon cannot build the kernel
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
            if call.policy.decode_kernel == "gluon":
                raise MLAShapeError(f"TritonPolicy(decode_kernel='gluon'): the Gluon decode kernel did not compile "
                                    f"with triton {triton.__version__} ({why}). It was verified with triton 3.6; "
                                    "use decode_kernel='auto' or 'triton'.") from e
            warnings.warn(f"Gluon decode kernel did not compile with triton {triton.__version__} ({why}); this "
                          "model decodes on the tl kernels (TritonPolicy.decode_kernel='triton' silences this).",
                          RuntimeWarning, stacklevel=2)
            if call.warmed is not None:
                call.warmed.add(("gluon failed",) + wkey)
            return 0
        if call.warmed is not None:
            call.warmed.add(wkey)
    split = plan.splits > 1
    if split:
        part_acc = call.empty(n_seqs, n, plan.splits, r, dtype=torch.float32, device=dev)
        part_lse = call.empty(n_seqs, n, plan.splits, dtype=torch.float32, device=dev)
    else:
        part_acc = part_lse = latent  # unused
    ptrs, scalars = GD.kernel_args(descs, q_abs, q_pe, page_table, cu_seqlen, seq_len, latent, part_acc, part_lse,
                                   split=split, q_desc=q_desc, **common)
    plan.attn.launch(plan.grid, ptrs, scalars)
    if plan.reduce is not None:
        rest = (tok_base, abs_base, plan.splits, *part_acc.stride()[:3], *part_lse.stride()[:2], latent.stride(0),
                latent.stride(1))
        if plan.reduce_heads > 1:
            plan.reduce.launch((n_seqs, n // plan.reduce_heads), (part_acc, part_lse, latent), rest)
        else:
            plan.reduce.launch((n_seqs, n), (part_acc, part_lse, latent, cu_seqlen), rest)
    return plan.splits


def _cache_descriptors(call: OpCall, mla_cache: torch.Tensor, cfg, block_c: int, dr: int):
    """The heads-on-N TMA descriptors of one layer's cache, built once per cache (they hold no step data)."""
    key = (mla_cache.data_ptr(), tuple(mla_cache.shape), mla_cache.dtype, cfg.block_n, block_c, dr)
    return per_model(call.descriptors, key, lambda: _heads_on_n_descriptors(
        mla_cache.view(-1, mla_cache.shape[-1]), cfg.block_n, block_c, dr), call.memo_limit)


@dataclass(frozen=True)
class _ExpandLaunch:
    """The expanded prefill of a step, planned once for every layer of the same kind: tiles and the
    bound gather / attention kernels (TMA and pointer variants: TMA needs the step's fresh K/V
    buffers 16-byte aligned, which each call checks)."""

    block_m: int
    block_n: int
    dn1: int
    dn2: int
    tma: bool
    gather: BoundKernel
    expand_tma: BoundKernel
    expand_ptr: BoundKernel


def _plan_expanded(call: OpCall, dims: MLADims, dtype: torch.dtype, mla_cache: torch.Tensor, scaled: bool, n_pre: int,
                   max_q: int, dev: torch.device) -> _ExpandLaunch:
    n, dn, dv, r, dr = (dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank,
                        dims.qk_rope_head_dim)
    cfg = expand_config(dims, dtype, triton.cdiv(max_q, 128) * n * n_pre, tuning.num_sms(dev))
    dn1, dn2 = nope_chunks(dn, cfg.split_nope)
    w = r + dr
    gather = call.bound(K.gather_kv_kernel, dict(W=w, R=r, PAGE_SIZE=mla_cache.shape[1], BLOCK_T=GATHER_BLOCK_T,
                                                 BLOCK_W=min(256, pow2(w)), SCALED=scaled, num_warps=4))
    meta = dict(DN=dn, DV=dv, DR=dr, R=r, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_DN=dn1, BLOCK_DN2=dn2, BLOCK_DV=pow2(dv), BLOCK_DR=pow2(dr),
                DOT_PREC=dot_precision(dtype), HEAVY_FIRST=cfg.heavy_first,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tma = cfg.tma and not (dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (9, 0))
    return _ExpandLaunch(cfg.block_m, cfg.block_n, dn1, dn2, tma, gather,
                         call.bound(K.expanded_prefill_kernel, {**meta, "USE_TMA": True}),
                         call.bound(K.expanded_prefill_kernel, {**meta, "USE_TMA": False}))


GATHER_BLOCK_T = 32


def fa3_for_step(call: OpCall, step: StepShape, dev: torch.device) -> bool:
    """Whether this step's expanded prefill attends with FlashInfer's FA3 (the session has one, the step
    runs eagerly, and under "auto" its longest prefill is long enough and the FA3 module is compiled
    already: a step never waits for nvcc unless "flashinfer" is forced)."""
    if call.fa3 is None or not step.qo_indptr or capturing_on(dev):
        return False
    if call.policy.prefill_attention == "flashinfer":
        return True
    return step.max_q >= tuning.FA3_PREFILL_MIN_TOKENS and call.fa3.ready


def prefill_expanded(call: OpCall, q_nope, q_pe, mla_cache, kv_b_proj_weight, page_table, cu_seqlen, input_pos,
                      seq_len, out, *, n_pre, max_q, max_kv, total_kv, dims, qk_scale, scales: CacheScales = UNIT_SCALES,
                      fa3: Optional[PrefillAttention] = None, step: Optional[StepShape] = None):
    n, dv, r, dr = dims.num_heads, dims.v_head_dim, dims.kv_lora_rank, dims.qk_rope_head_dim
    dev = q_nope.device
    scaled = cache_scaled(mla_cache, scales)
    plan = call.plan(("expand", dims, q_nope.dtype, mla_cache.dtype, mla_cache.shape[1], scaled, n_pre, max_q),
                     lambda: _plan_expanded(call, dims, q_nope.dtype, mla_cache, scaled, n_pre, max_q, dev))
    kv_cu = call.plan(("kv_cu", n_pre, dev), lambda: _kv_offsets(seq_len, n_pre, dev))  # once per step
    lat = call.empty(total_kv, r + dr, dtype=q_nope.dtype, device=dev)  # an FP8 cache is dequantised here
    plan.gather.launch((triton.cdiv(max_kv, GATHER_BLOCK_T), n_pre), (mla_cache, page_table, seq_len, kv_cu, lat),
                       (scales.latent, scales.rope, mla_cache.stride(1), page_table.stride(0), lat.stride(0)))
    kv = torch.matmul(lat[:, :r], kv_b_proj_weight.t())  # [total_kv, N*(Dn+Dv)]: K_nope | V per head
    if fa3 is not None and step is not None:
        _attend_fa3(call, fa3, step, q_nope, q_pe, kv, lat, out, dims, qk_scale)
        return
    descs = _kv_descriptors(kv, lat, plan.block_n, plan.dn1, plan.dn2, pow2(dv), pow2(dr) if dr else 0) \
        if plan.tma else None
    expand = plan.expand_ptr if descs is None else plan.expand_tma
    expand.launch((triton.cdiv(max_q, plan.block_m), n, n_pre),
                  (q_nope, q_pe, kv, lat, cu_seqlen, input_pos, kv_cu, out, *(descs or (None,) * 4)),
                  (qk_scale, q_nope.stride(1), q_nope.stride(2), q_pe.stride(1), q_pe.stride(2),
                   kv.stride(0), lat.stride(0), out.stride(1), out.stride(2)))


#: rows (token, one head) per program of pack_heads_kernel: a [32, pow2(D)] tile
PACK_BLOCK_T = 32


def _attend_fa3(call: OpCall, fa3: PrefillAttention, step: StepShape, q_nope, q_pe, kv, lat, out, dims: MLADims,
                qk_scale: float) -> None:
    """The expanded prefill's attention by FlashInfer's FA3: K per head [k_nope | k_pe] and q [q_nope |
    q_pe] written by one kernel each (pack_heads_kernel; was four torch copies, ~35 µs at N 16 x 2048
    tokens on an H200), V a strided view of the expansion GEMM's output, the output straight into
    `out`'s prefill rows."""
    n, dn, dr, dv, r = (dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim,
                        dims.kv_lora_rank)
    t, total_kv = step.n_pre_tok, kv.shape[0]
    kv3 = kv.view(total_kv, n, dn + dv)
    k = call.empty(total_kv, n, dn + dr, dtype=kv.dtype, device=kv.device)
    q = call.empty(t, n, dn + dr, dtype=q_nope.dtype, device=q_nope.device)
    pack = call.plan(("fa3_pack", dn, dr), lambda: call.bound(K.pack_heads_kernel, dict(
        DA=dn, DB=dr, BLOCK_T=PACK_BLOCK_T, BLOCK_DA=pow2(dn), BLOCK_DB=pow2(dr), num_warps=4)))
    k_pe = lat[:, r:] if dr else lat  # (unused when Dr = 0)
    pack.launch((triton.cdiv(total_kv, PACK_BLOCK_T), n), (kv3, k_pe, k),
                (total_kv, kv3.stride(0), kv3.stride(1), lat.stride(0), 0, k.stride(0), k.stride(1)))
    qn, qp = q_nope[0], q_pe[0]
    pack.launch((triton.cdiv(t, PACK_BLOCK_T), n), (qn, qp, q),
                (t, qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), q.stride(0), q.stride(1)))
    fa3.run(q, k, kv3[..., dn:], out[0, :t], step.qo_indptr, step.kv_indptr, qk_scale / LOG2E)


def _kv_offsets(seq_len: torch.Tensor, n_pre: int, dev: torch.device) -> torch.Tensor:
    """[0, kv_0, kv_0 + kv_1, ...] of the prefill sequences, on the device (no sync): where each
    sequence's rows start in the expanded K/V buffers. The same for every layer of a step."""
    kv_cu = torch.zeros(n_pre + 1, dtype=torch.int32, device=dev)
    torch.cumsum(seq_len[:n_pre], 0, dtype=torch.int32, out=kv_cu[1:])
    return kv_cu


def _kv_descriptors(kv: torch.Tensor, lat: torch.Tensor, bn: int, dn1: int, dn2: int, dv: int, dr: int):
    """Tensor descriptors of the expanded K_nope (one or two chunks), V and k_pe tiles, or None where
    TMA cannot take the buffers (rows must be 16-byte aligned). The device (SM90+ or the interpreter)
    was checked by the launch plan."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if any((t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16 for t in (kv, lat)):
        return None
    return (TensorDescriptor.from_tensor(kv, [bn, dn1]), TensorDescriptor.from_tensor(kv, [bn, dn2]) if dn2 else None,
            TensorDescriptor.from_tensor(kv, [bn, dv]), TensorDescriptor.from_tensor(lat, [bn, dr]) if dr else None)


# ----------------------------------------------------------------------------- configs under the policy
def policy_decode_config(call: OpCall, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype):
    """decode_config under the policy: FP8_DOT runs on the head-rows kernel only."""
    layout = "heads_on_m" if (call.policy.fp8_dot and is_fp8(cache_dtype)) else call.policy.decode_layout
    return decode_config(dims, dtype, cache_dtype, layout)


def absorb_config(call: OpCall, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, max_q: int):
    """Config of the absorbed prefill part, which is also where multi-token decode lands (every
    sequence's few new tokens on a cached history: speculative-decoding verification; the cost rule
    keeps such chunks absorbed). Up to MULTI_TOKEN_MAX_Q new tokens per sequence, where decode runs
    heads-on-N: that kernel with query columns (multi_token_config); H200, bf16: 1.2-2.0x faster
    than the rows on 16 of 16 shapes of N 16/20/32/128 (docs/benchmarks/multi_token.md). Otherwise
    (longer chunks, N 33-64, an FP8 cache — columns measured in bf16 only — or
    decode_layout="heads_on_m"): absorb_prefill_config, 64 rows of query tokens x heads."""
    if max_q <= MULTI_TOKEN_MAX_Q and heads_on_n_supported(dims) and \
            (call.policy.decode_layout == "heads_on_n" or (call.policy.decode_layout == "auto" and not is_fp8(cache_dtype))):
        dec = policy_decode_config(call, dims, dtype, cache_dtype)
        if dec.heads_on_n:
            return multi_token_config(dec, max_q, dims.kv_lora_rank)
    return absorb_prefill_config(dims, dtype)
