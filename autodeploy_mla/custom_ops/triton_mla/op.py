"""`torch.ops.autodeploy.triton_mla_with_cache`: the Triton backend's cached op (descriptor: backend.py).

Same contract as the torch reference op (torch_backend.py): append the step's tokens to the paged
latent cache, then attend — prefill tokens causally over (cached prefix + new tokens), decode
tokens over their whole history — for a mixed flat batch in one call. See docs/triton_backend.md.

Plan of one call (host decisions read only `*_host` metadata; nothing syncs the device):

1. `append_kernel` over the step's real tokens.
2. Prefill part (if any): the cost rule `tuning.choose_prefill_path` picks
   - "expand": gather the prefill sequences' history, K/V = latent @ kv_b_proj^T (one GEMM), then
     `expanded_prefill_kernel` (FlashAttention-style) writes the output directly; or
   - "absorb": the prefill tokens join the absorbed path below.
3. Absorbed tokens (decode tokens, plus prefill tokens on the "absorb" path): q_abs = q_nope·W_kn
   (bmm), `absorbed_attn_kernel` (+ `split_reduce_kernel` when split-K), out = latent·W_v (bmm).

A step on static bounds (a mixed CUDA graph, replayed for any batch of its token count) runs
`_attend_static` instead: every token appended and absorbed in one launch sized by the token count
and the sequence capacity only.

The op reads its model's `TritonMLASession` from the step context when there is one: its policy
(forced prefill path or split count for benchmarks, NaN-poisoned buffers for tests), the step's
host shape and launch plans made once per step for all layers, and the compiled kernels it launches
directly (launch.py). Called outside a model step it runs with the default policy, plans for that
call alone and launches through Triton's JIT launcher (docs/triton_backend.md, "The lean eager path").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Optional

import torch

from ..attention.cache_format import CacheScales, is_fp8
from ..attention.contract import MLAInputs, check_cached_inputs, define_cached_op_and_kernel
from ..attention.mla_dims import MLADims, MLAShapeError, resolve_scale
from ..attention.step_context import active_session
from .call import OpCall, capturing_on, per_model
from .launchers import (HAS_TRITON, LOG2E, TRITON_IMPORT_ERROR, absorb_config, cache_scaled, fa3_for_step,
                        gluon_decode_choice, launch_absorbed, launch_append, launch_gluon_decode,
                        policy_decode_config, prefill_expanded, quantize_queries)
from .policy import DEFAULT_POLICY
from .session import TritonMLASession
from .step_shape import StepShape
from .tuning import MAX_EXPAND_HEAD_DIM, MULTI_TOKEN_MAX_Q, choose_prefill_path, expansion_supported, validate_dims

OP = "triton_mla_with_cache"
METADATA: tuple[str, ...] = (
    "batch_info_host",
    "max_seq_info_host",
    "cu_seqlen_host",
    "input_pos_host",
    "cu_seqlen",
    "input_pos",
    "seq_len_with_cache",
    "page_table",
    "cache_loc",
)

def _current_call(meta: Mapping[str, torch.Tensor]) -> tuple[OpCall, StepShape]:
    """The call context and the step's host shape. With a session whose `prepare` saw this step
    (its batch counts and, with prefill sequences, their cached prefix match the host metadata), both
    come from the session and the step's plans are shared by all layers; otherwise they are made for
    this call alone. The contract is FlashInfer's: the runner prepares every step before the graph;
    the checks keep a call made without it from running on another step's sizes."""
    bi = meta["batch_info_host"].tolist()  # host mirrors (CPU tensors): no device sync
    ms = meta["max_seq_info_host"].tolist()
    sess = active_session("triton")
    if isinstance(sess, TritonMLASession):
        step = sess.step
        if step is not None and step.key == (bi[0], bi[1], bi[2], ms[0], ms[1]) and \
                (step.n_pre == 0 or int(meta["input_pos_host"][: step.n_pre].numpy().sum()) == step.prefix):
            return sess.call, step
        call = replace(sess.call, plans=None)
    else:
        call = OpCall(DEFAULT_POLICY)
    return call, StepShape.from_host(meta["batch_info_host"], meta["max_seq_info_host"], meta["cu_seqlen_host"],
                                     meta["input_pos_host"])


def _absorb_weights(call: OpCall, dims: MLADims, kv_b_proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_kn, W_v) views of a layer's kv_b_proj weight, made once per weight when there is a session."""
    key = (kv_b_proj_weight.data_ptr(), kv_b_proj_weight.shape, kv_b_proj_weight.dtype, dims)
    return per_model(call.views, key, lambda: dims.split_kv_b(kv_b_proj_weight), call.memo_limit)


def _triton_mla_with_cache(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                           scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Append the step's tokens to the paged cache (quantised when it is FP8), then attend. Returns [1, T, N, Dv]."""
    dims = check_cached_inputs(OP, x, mla_cache)
    if not HAS_TRITON:
        raise RuntimeError(f"{OP}: triton is not installed ({TRITON_IMPORT_ERROR}); "
                           "install triton>=3.4 or pick another MLA backend (e.g. 'torch').")
    why = validate_dims(dims, x.q_nope.dtype)
    if why:
        raise MLAShapeError(f"{OP}: {why}. The descriptor's check() refuses these dims; use another backend.")
    call, step = _current_call(meta)
    prefill_mode = call.policy.prefill_mode
    if prefill_mode == "expand" and not expansion_supported(dims):
        raise MLAShapeError(f"{OP}: prefill_mode='expand' needs Dn, Dv <= {MAX_EXPAND_HEAD_DIM}, got "
                            f"Dn={dims.qk_nope_head_dim}, Dv={dims.v_head_dim}; use 'auto' or 'absorb'.")
    q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight = x
    if compressed_kv.stride(-1) != 1 or kpe.stride(-1) != 1 or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        for name, t in (("compressed_kv", compressed_kv), ("kpe", kpe), ("q_nope", q_nope), ("q_pe", q_pe)):
            if t.stride(-1) != 1:
                raise MLAShapeError(f"{OP}: {name} must have a unit stride in its last dim, got strides {t.stride()}.")
    if not mla_cache.is_contiguous():
        raise MLAShapeError(f"{OP}: mla_cache must be contiguous [num_pages, page_size, R+Dr].")
    page_table, cu_seqlen, input_pos = meta["page_table"], meta["cu_seqlen"], meta["input_pos"]
    seq_len_with_cache = meta["seq_len_with_cache"]

    if step.static:
        return _attend_static(call, x, meta, mla_cache, dims, resolve_scale(dims, scale) * LOG2E, scales)
    n, dv = dims.num_heads, dims.v_head_dim
    t_all = q_nope.shape[1]
    dev = q_nope.device
    out = call.empty(1, t_all, n, dv, dtype=q_nope.dtype, device=dev)
    n_pre, n_pre_tok, n_dec, max_q, max_kv = step.key
    num_tok = step.num_tok
    if num_tok < t_all:
        out[:, num_tok:].zero_()  # padded tokens: finite
    if num_tok == 0:
        return out

    launch_append(compressed_kv, kpe, mla_cache, meta["cache_loc"], num_tok, dims, scales, call)
    qk_scale = resolve_scale(dims, scale) * LOG2E

    mode = None
    total_kv = 0
    if n_pre > 0:
        total_kv = n_pre_tok + step.prefix
        mode = choose_prefill_path(dims, n_pre_tok, step.prefix, step.pairs) if prefill_mode == "auto" \
            else prefill_mode

    abs_lo = 0 if mode == "absorb" else n_pre_tok
    if abs_lo < num_tok:
        w_kn, w_v = _absorb_weights(call, dims, kv_b_proj_weight)
        q_abs = torch.bmm(q_nope[0, abs_lo:num_tok].transpose(0, 1), w_kn)  # [N, Ta, R]
        latent = call.empty(*q_abs.shape, dtype=q_abs.dtype, device=dev)
        q_in, qpe_in, q_scale = q_abs, q_pe, None
        if is_fp8(mla_cache.dtype) and call.policy.fp8_dot:
            q_in, qpe_in, q_scale = quantize_queries(q_abs, q_pe[:, :num_tok])
        if mode == "absorb":
            launch_absorbed(
                call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, input_pos, seq_len_with_cache, latent,
                seq_base=0, n_seqs=n_pre, tok_base=0, n_tok=n_pre_tok, abs_base=abs_lo, max_q=max_q,
                kv_bound=max_kv, dims=dims, qk_scale=qk_scale,
                cfg=call.plan(("absorb_cfg", dims, q_nope.dtype, mla_cache.dtype, max_q),
                              lambda: absorb_config(call, dims, q_nope.dtype, mla_cache.dtype, max_q)),
                scales=scales, q_scale=q_scale,
            )
        if n_dec > 0:
            # Decode grid: from host batch_info (fixed per captured graph) and, under CUDA-graph
            # capture, a split count from the static cache capacity (page-table width), so a replay
            # stays correct while sequences grow; kernels skip chunks past each sequence's length.
            static_kv = page_table.shape[1] * mla_cache.shape[1]
            kv_bound = static_kv if capturing_on(dev) else min(max_kv, static_kv)
            cfg = call.plan(("decode_cfg", dims, q_nope.dtype, mla_cache.dtype),
                            lambda: policy_decode_config(call, dims, q_nope.dtype, mla_cache.dtype))
            use_gluon = q_scale is None and call.plan(
                ("gluon_choice", dims, q_in.dtype, mla_cache.dtype, mla_cache.shape[1]),
                lambda: gluon_decode_choice(call, cfg, dims, q_in.dtype, mla_cache, dev,
                                             cache_scaled(mla_cache, scales)))
            if not (use_gluon and launch_gluon_decode(
                    call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, seq_len_with_cache, latent,
                    seq_base=n_pre, n_seqs=n_dec, tok_base=n_pre_tok, abs_base=abs_lo, kv_bound=kv_bound,
                    dims=dims, qk_scale=qk_scale)):
                launch_absorbed(
                    call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, input_pos, seq_len_with_cache, latent,
                    seq_base=n_pre, n_seqs=n_dec, tok_base=n_pre_tok, n_tok=n_dec, abs_base=abs_lo, max_q=1,
                    kv_bound=kv_bound, cfg=cfg, dims=dims, qk_scale=qk_scale, scales=scales, q_scale=q_scale,
                )
        # latent . W_v^T written straight into out's rows ([N, Ta, Dv] view, row stride N*Dv): no copy
        torch.bmm(latent, w_v.transpose(1, 2), out=out[0, abs_lo:num_tok].transpose(0, 1))
    if mode == "expand":
        fa3 = call.fa3 if fa3_for_step(call, step, dev) else None
        prefill_expanded(
            call, q_nope, q_pe, mla_cache, kv_b_proj_weight, page_table, cu_seqlen, input_pos, seq_len_with_cache,
            out, n_pre=n_pre, max_q=max_q, max_kv=max_kv, total_kv=total_kv, dims=dims, qk_scale=qk_scale,
            scales=scales, fa3=fa3, step=step,
        )
    return out


#: Cap on the fp32 split partials of one static-bounds call ([T, N, splits, R]): a captured graph
#: keeps them in its memory pool.
STATIC_PARTIAL_BYTES = 64 << 20


def _attend_static(call: OpCall, x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                   dims: MLADims, qk_scale: float, scales: CacheScales) -> torch.Tensor:
    """The op for a step captured once per token count and replayed for any batch of that size
    (mixed prefill + decode steps): no launch reads a host count. Every one of the T tokens is
    appended (padded tokens go to the scratch page) and attended on the absorbed path (no expansion:
    its history buffer is sized by the cached prefix) by one launch whose programs find their
    (sequence, query block) in the device cu_seqlen (kernels._work_item) over the sequence
    capacity; the split count comes from the cache capacity (page-table width), as in decode
    graphs. Padded tokens get a zero output. Returns [1, T, N, Dv]."""
    q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight = x
    page_table, cu_seqlen = meta["page_table"], meta["cu_seqlen"]
    n, r, dv = dims.num_heads, dims.kv_lora_rank, dims.v_head_dim
    t_all = q_nope.shape[1]
    b_cap = cu_seqlen.shape[0] - 1
    dev = q_nope.device
    out = call.empty(1, t_all, n, dv, dtype=q_nope.dtype, device=dev)
    launch_append(compressed_kv, kpe, mla_cache, meta["cache_loc"], t_all, dims, scales, call)
    w_kn, w_v = _absorb_weights(call, dims, kv_b_proj_weight)
    q_abs = torch.bmm(q_nope[0].transpose(0, 1), w_kn)  # [N, T, R]
    latent = call.empty(*q_abs.shape, dtype=q_abs.dtype, device=dev)
    q_in, qpe_in, q_scale = q_abs, q_pe, None
    if is_fp8(mla_cache.dtype) and call.policy.fp8_dot:
        q_in, qpe_in, q_scale = quantize_queries(q_abs, q_pe)
    # Per-sequence query counts are not known here: the heads-on-N kernel with multi-token query
    # columns where decode runs heads-on-N (decode and spec-verify items fill few columns; prefill
    # items take BLOCK_Q queries each), else the rows of the absorbed prefill.
    q_cols = min(t_all, MULTI_TOKEN_MAX_Q)
    cfg = call.plan(("absorb_cfg", dims, q_nope.dtype, mla_cache.dtype, q_cols),
                    lambda: absorb_config(call, dims, q_nope.dtype, mla_cache.dtype, q_cols))
    max_splits = max(1, STATIC_PARTIAL_BYTES // (t_all * n * r * 4))
    launch_absorbed(
        call, q_in, qpe_in, mla_cache, page_table, cu_seqlen, meta["input_pos"], meta["seq_len_with_cache"], latent,
        seq_base=0, n_seqs=b_cap, tok_base=0, n_tok=t_all, abs_base=0, max_q=t_all,
        kv_bound=page_table.shape[1] * mla_cache.shape[1], cfg=cfg, dims=dims, qk_scale=qk_scale, scales=scales,
        q_scale=q_scale, work_list=b_cap, max_splits=max_splits,
    )
    torch.bmm(latent, w_v.transpose(1, 2), out=out[0].transpose(0, 1))
    return out


#: the op, and its implementation that the piecewise runner calls directly for eager attention pieces
triton_mla_with_cache, triton_mla_with_cache_direct = define_cached_op_and_kernel(OP, METADATA, _triton_mla_with_cache)
