"""`torch.ops.autodeploy.torch_mla_with_cache`: the torch reference cached MLA op (DESIGN §6).

Runs anywhere (CPU or CUDA, any dims) and is the correctness oracle for every other backend. It is
vectorised over the whole mixed batch: the step's tokens are scattered into a [seqs, max_q] grid,
each sequence's history is gathered through its page table, and one masked softmax serves prefill,
chunked prefill and decode alike. Sizes come from host metadata only, so it never syncs the device;
they are baked per call, so it is not safe inside a whole-graph CUDA graph. Stateless: its session
is the plain `BackendSession`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from .attention.registry import CheckResult, MLABackend, SparseOps, Target, register_backend
from .attention.cache_format import CacheScales, cache_dtype_name, dequantize_rows, is_fp8
from .attention.mla_dims import MLADims, resolve_scale
from .attention.contract import MLAInputs, append_to_paged_cache, check_cached_inputs, define_cached_op, define_cached_op_and_kernel
from .attention.sparse_mla import DSA_INDEXER_WITH_CACHE, allowed_by_topk

OP = "torch_mla_with_cache"
METADATA: tuple[str, ...] = (
    "batch_info_host",
    "max_seq_info_host",
    "cu_seqlen",
    "input_pos",
    "seq_len_with_cache",
    "page_table",
    "batch_idx",
    "cache_loc",
)


def _torch_mla_with_cache(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                          scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Append the step's tokens to the paged cache, then attend. Returns [1, T, N, Dv]. An FP8 cache
    is quantised in the append and dequantised (times its scales) where the history is gathered."""
    dims = check_cached_inputs(OP, x, mla_cache)
    append_to_paged_cache(mla_cache, x, meta["cache_loc"], scales)

    n, dv, r = dims.num_heads, dims.v_head_dim, dims.kv_lora_rank
    t_all = x.q_nope.shape[1]
    out = x.q_nope.new_zeros(1, t_all, n, dv)
    # Host metadata (CPU tensors): reading them never waits for the GPU.
    n_pre, n_pre_tok, n_dec = meta["batch_info_host"].tolist()
    max_q, max_kv = meta["max_seq_info_host"].tolist()
    nb, num_tok = n_pre + n_dec, n_pre_tok + n_dec
    if nb == 0 or num_tok == 0:
        return out

    cu_seqlen, input_pos, seq_len = meta["cu_seqlen"], meta["input_pos"], meta["seq_len_with_cache"]
    acc = torch.promote_types(x.q_nope.dtype, torch.float32)
    dev = x.q_nope.device
    ps = mla_cache.shape[1]
    kv_pos = torch.arange(max_kv, device=dev)
    slots = meta["page_table"][:nb, kv_pos // ps].long() * ps + kv_pos % ps  # [nb, max_kv]
    hist = dequantize_rows(mla_cache.view(-1, mla_cache.shape[-1])[slots], r, acc, scales)  # [nb, max_kv, R+Dr]
    # Slots past a sequence's length hold stale data (maybe non-finite): zero them, since a masked
    # probability of 0 times NaN is still NaN.
    in_seq = kv_pos[None] < seq_len[:nb, None].long()
    hist = hist.masked_fill(~in_seq[..., None], 0.0)
    ckv_hist, kpe_hist = hist[..., :r], hist[..., r:]

    w_kn, w_v = (w.to(acc) for w in dims.split_kv_b(x.kv_b_proj_weight))
    tok_seq = meta["batch_idx"][:num_tok].long()
    tok_q = torch.arange(num_tok, device=dev) - cu_seqlen[tok_seq].long()  # index within its sequence
    q_abs = torch.einsum("tnd,ndr->tnr", x.q_nope[0, :num_tok].to(acc), w_kn)
    grid_abs = q_abs.new_zeros(nb, max_q, n, r)
    grid_abs[tok_seq, tok_q] = q_abs
    grid_pe = q_abs.new_zeros(nb, max_q, n, dims.qk_rope_head_dim)
    grid_pe[tok_seq, tok_q] = x.q_pe[0, :num_tok].to(acc)

    scores = torch.einsum("bqnr,bkr->bnqk", grid_abs, ckv_hist)
    scores = scores + torch.einsum("bqnd,bkd->bnqk", grid_pe, kpe_hist)
    scores = scores * resolve_scale(dims, scale)
    q_abs_pos = input_pos[:nb, None].long() + torch.arange(max_q, device=dev)[None]  # [nb, max_q]
    visible = (kv_pos[None, None] <= q_abs_pos[..., None]) & in_seq[:, None]
    topk = meta.get("topk_indices")
    if topk is not None:  # sparse MLA: only the positions the indexer selected
        visible = visible & allowed_by_topk(topk, tok_seq, tok_q, nb, max_q, max_kv)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    latent = torch.einsum("bnqk,bkr->bqnr", probs, ckv_hist)[tok_seq, tok_q]  # [num_tok, N, R]
    out[0, :num_tok] = torch.einsum("tnr,nvr->tnv", latent, w_v).to(out.dtype)
    return out


torch_mla_with_cache, _direct = define_cached_op_and_kernel(OP, METADATA, _torch_mla_with_cache)
#: Sparse MLA (DSA): the same op restricted to each token's `topk_indices` ([1, T, K] int32 positions
#: within its sequence, -1 = none; from torch_dsa_indexer_with_cache or an earlier layer's).
SPARSE_OP = "torch_mla_sparse_with_cache"
torch_mla_sparse_with_cache = define_cached_op(SPARSE_OP, (*METADATA, "topk_indices"), _torch_mla_with_cache)


@register_backend
class TorchMLABackend(MLABackend):
    name = "torch"
    cached_op = torch_mla_with_cache
    direct_call = staticmethod(_direct)
    metadata = METADATA
    source = "autodeploy_mla reference implementation (vectorised torch)"
    decode_graph_safe = False  # sizes are read from host metadata at call time
    sparse_ops = SparseOps(indexer=DSA_INDEXER_WITH_CACHE, attention=torch_mla_sparse_with_cache)

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        if not dtype.is_floating_point:
            return CheckResult(False, f"dtype {dtype} is not floating point")
        return CheckResult(True, "reference op: any device, any dims (slow; the correctness oracle)")

    def check_cache(self, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
        if cache_dtype == dtype or is_fp8(cache_dtype):
            return CheckResult(True, f"{cache_dtype_name(cache_dtype)} cache: dequantised on gather")
        return CheckResult(False, f"a {cache_dtype_name(cache_dtype)} cache under {cache_dtype_name(dtype)} "
                                  "activations (caches hold the model dtype or fp8_e4m3)")
