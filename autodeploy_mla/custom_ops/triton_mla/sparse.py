"""Sparse MLA (DSA) cached ops of the Triton backend: `triton_dsa_indexer_with_cache` and
`triton_mla_sparse_with_cache`, the same contracts as the torch reference ops
(custom_ops/attention/sparse_mla.py, custom_ops/torch_backend.py) with the scoring and the attention in Triton
(sparse_kernels.py). Appends, the W_UK / W_V products and the top-k selection stay in torch.

Both are CUDA-graph safe: eagerly they size their launches from the host metadata; under capture
from static shapes only (every padded token, the page table's full width), with lengths read on the
device, so a captured decode step replays correctly as the sequences grow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from ..attention.cache_format import CacheScales, is_fp8
from ..attention.mla_dims import MLAShapeError, resolve_scale
from ..attention.contract import MLAInputs, append_to_paged_cache, check_cached_inputs, define_cached_op
from ..attention.sparse_mla import INDEXER_METADATA, check_indexer, append_index_keys, select_topk
from ..triton_helpers import interpreting
from .tuning import index_scores_config

try:
    import triton

    from .sparse_kernels import index_scores_kernel, sparse_absorbed_kernel
    HAS_TRITON = True
except ImportError:  # pragma: no cover - the descriptor refuses every node then
    HAS_TRITON = False

INDEXER_OP, SPARSE_OP = "triton_dsa_indexer_with_cache", "triton_mla_sparse_with_cache"
BLOCK_H, BLOCK_N = 16, 32


def _need_triton(op: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: triton is not installed; use the torch backend for sparse MLA")


def _precision(dtype: torch.dtype) -> Optional[str]:
    """fp32 caches: exact fp32 products (no tf32); 16-bit: the default MMA."""
    return "ieee" if dtype == torch.float32 else None


def _capturing() -> bool:
    """True while a CUDA graph is being captured: sizes must then come from static shapes."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tokens(meta: Mapping[str, torch.Tensor], t_all: int, page_size: int,
            static: bool) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """(sequences, tokens, max_kv, token -> sequence, token -> absolute position).

    Eager: from the host sizes (exactly the step's tokens and longest history). `static` (under CUDA
    graph capture): every one of the T (padded) tokens, every page-table row and its full width, so
    a captured decode step replays for any lengths; padded tokens map to sequence 0 (their results
    are never read) and the kernels mask keys past each sequence's length on the device."""
    if static:
        nb, num_tok = meta["page_table"].shape[0], t_all
        max_kv = meta["page_table"].shape[1] * page_size
    else:
        n_pre, n_pre_tok, n_dec = meta["batch_info_host"].tolist()
        _, max_kv = meta["max_seq_info_host"].tolist()
        nb, num_tok = n_pre + n_dec, n_pre_tok + n_dec
    tok_seq = meta["batch_idx"][:num_tok].long()
    dev = tok_seq.device
    tok_pos = (meta["input_pos"][tok_seq].long() + torch.arange(num_tok, device=dev)
               - meta["cu_seqlen"][tok_seq].long())
    return nb, num_tok, max_kv, tok_seq, tok_pos


@torch.library.custom_op("autodeploy::triton_dsa_indexer_with_cache", mutates_args=("index_cache",))
def triton_dsa_indexer_with_cache(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
    batch_info_host: torch.Tensor, max_seq_info_host: torch.Tensor, cu_seqlen: torch.Tensor, input_pos: torch.Tensor,
    seq_len_with_cache: torch.Tensor, page_table: torch.Tensor, batch_idx: torch.Tensor, cache_loc: torch.Tensor,
    index_cache: torch.Tensor, index_topk: int, softmax_scale: float,
) -> torch.Tensor:
    """`torch_dsa_indexer_with_cache` with the scores from `index_scores_kernel`."""
    _need_triton(INDEXER_OP)
    flat, out = append_index_keys(INDEXER_OP, q, k, weights, index_cache, cache_loc, index_topk)
    t_all, h, d = q.shape[1], q.shape[2], q.shape[3]
    meta = dict(zip(INDEXER_METADATA, (batch_info_host, max_seq_info_host, cu_seqlen, input_pos, seq_len_with_cache,
                                        page_table, batch_idx, cache_loc)))
    nb, num_tok, max_kv, tok_seq, tok_pos = _tokens(meta, t_all, index_cache.shape[1], _capturing())
    if nb == 0 or num_tok == 0:
        return out
    qt = q[0, :num_tok].contiguous()
    wt = weights[0, :num_tok].float().contiguous()
    scores = torch.empty(num_tok, max_kv, dtype=torch.float32, device=q.device)
    cfg = index_scores_config(h, d, flat.dtype, compiled=q.is_cuda and not interpreting())
    launch_index_scores(cfg, qt, wt, flat, page_table, tok_seq, tok_pos, seq_len_with_cache, scores,
                        float(softmax_scale), index_cache.shape[1])
    out[0, :num_tok] = select_topk(scores, scores > float("-inf"), index_topk)
    return out


def launch_index_scores(cfg, qt: torch.Tensor, wt: torch.Tensor, flat_keys: torch.Tensor, page_table: torch.Tensor,
                        tok_seq: torch.Tensor, tok_pos: torch.Tensor, seq_len: torch.Tensor, scores: torch.Tensor,
                        softmax_scale: float, page_size: int) -> None:
    """scores[t, j] for every packed token t (rows of qt) and key position j < scores.shape[1]."""
    num_tok, max_kv = scores.shape
    h, d = qt.shape[1], qt.shape[2]
    grid = (num_tok, triton.cdiv(max_kv, cfg.block_n * cfg.kv_iters))
    index_scores_kernel[grid](
        qt, wt, flat_keys, page_table, tok_seq, tok_pos, seq_len, scores,
        softmax_scale, h, d, max_kv, page_size,
        qt.stride(0), qt.stride(1), wt.stride(0), page_table.stride(0), scores.stride(0),
        BLOCK_H=cfg.block_h, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=cfg.block_n,
        KV_ITERS=cfg.kv_iters, PRECISION=_precision(flat_keys.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


@triton_dsa_indexer_with_cache.register_fake
def _triton_dsa_indexer_with_cache_fake(q, k, weights, batch_info_host, max_seq_info_host, cu_seqlen, input_pos,
                                        seq_len_with_cache, page_table, batch_idx, cache_loc, index_cache,
                                        index_topk, softmax_scale):
    check_indexer(q, k, weights, index_topk)
    return q.new_empty((1, q.shape[1], index_topk), dtype=torch.int32)


def sparse_splits(programs: int, k_top: int, device: torch.device) -> int:
    """Splits of the top-k list so that a step has about two programs per SM (a decode step of few
    tokens has too few (token, head block) programs otherwise), each split at least two tiles long;
    none once the step alone has two per SM. Measured on the H200 (N 128, top-k 2048): batch 1, 32
    splits 178 us vs 385 unsplit; batch 32 (256 programs), 2 splits 520 us vs 455 unsplit."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min((2 * sms) // max(programs, 1), k_top // (2 * BLOCK_N)))


def merge_splits(part: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """[T, N, R]: the splits' unnormalised partials [S, T, N, R] merged by their maxima m and sums l
    (base 2); a split with no valid key has m = -inf and weighs 0; a row with none at all gives 0."""
    m_max = m.amax(0)
    w = torch.exp2(m - torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max))  # [S, T, N]
    w = torch.where(torch.isinf(m), torch.zeros_like(w), w)
    den = (w * l).sum(0)
    return (part * w[..., None]).sum(0) / torch.where(den == 0, torch.ones_like(den), den)[..., None]


def _triton_mla_sparse(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                       scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Append the step's latents, then absorbed attention over each token's top-k positions."""
    _need_triton(SPARSE_OP)
    dims = check_cached_inputs(SPARSE_OP, x, mla_cache)
    if is_fp8(mla_cache.dtype):
        raise MLAShapeError(f"{SPARSE_OP}: FP8 caches are not supported for sparse MLA yet")
    append_to_paged_cache(mla_cache, x, meta["cache_loc"], scales)
    n, r, dr, dv = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, dims.v_head_dim
    t_all = x.q_nope.shape[1]
    out = x.q_nope.new_zeros(1, t_all, n, dv)
    nb, num_tok, _, tok_seq, tok_pos = _tokens(meta, t_all, mla_cache.shape[1], _capturing())
    if nb == 0 or num_tok == 0:
        return out
    topk = meta["topk_indices"][0, :num_tok].contiguous()
    w_kn, w_v = (w.float() for w in dims.split_kv_b(x.kv_b_proj_weight))
    q_abs = torch.einsum("tnd,ndr->tnr", x.q_nope[0, :num_tok].float(), w_kn).contiguous()
    q_pe = x.q_pe[0, :num_tok].contiguous()
    k_top = topk.shape[1]
    splits = sparse_splits(num_tok * triton.cdiv(n, BLOCK_H), k_top, q_abs.device)
    chunk = triton.cdiv(triton.cdiv(k_top, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(k_top, chunk)
    part = torch.empty(splits, num_tok, n, r, dtype=torch.float32, device=q_abs.device)
    ml = torch.empty(splits, num_tok, n, 2, dtype=torch.float32, device=q_abs.device)
    page_table = meta["page_table"]
    flat = mla_cache.view(-1, mla_cache.shape[-1])
    grid = (num_tok, triton.cdiv(n, BLOCK_H), splits)
    sparse_absorbed_kernel[grid](
        q_abs, q_pe, flat, topk, page_table, tok_seq, tok_pos, part, ml,
        resolve_scale(dims, scale), n, r, dr, k_top, flat.shape[1], mla_cache.shape[1], chunk,
        q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), topk.stride(0), page_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_DR=max(16, triton.next_power_of_2(max(dr, 1))),
        BLOCK_N=BLOCK_N, PRECISION=_precision(mla_cache.dtype),
    )
    latent = merge_splits(part, ml[..., 0], ml[..., 1])
    out[0, :num_tok] = torch.einsum("tnr,nvr->tnv", latent, w_v).to(out.dtype)
    return out


triton_mla_sparse_with_cache = define_cached_op(SPARSE_OP, (*INDEXER_METADATA, "topk_indices"), _triton_mla_sparse)
DSA_INDEXER_WITH_CACHE = torch.ops.autodeploy.triton_dsa_indexer_with_cache
