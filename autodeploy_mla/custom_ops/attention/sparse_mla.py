"""Source ops of DeepSeek Sparse Attention (DSA): the lightning indexer's top-k and sparse MLA.

`torch.ops.autodeploy.torch_dsa_indexer` scores every visible key for each query and returns the
`index_topk` best as int32 `[B, S, index_topk]`, -1 where a query sees fewer keys than that. The
width is a constant, unlike Hugging Face's `topk(min(index_topk, T))`, so export can prove every
shape (the -1 padding is the contract sparse MLA kernels such as FlashMLA's use).

`torch.ops.autodeploy.torch_mla_sparse` is `torch_mla` restricted, per query, to the keys the indexer
selected (and that causality allows). Both are uncached: the sequence is its own history. The export
pass emits them in place of the HF sparse attention blocks (transforms/sparse_export.py); docs/sparse_mla.md
has the math, with line numbers in transformers 5.23.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .mla_dims import MLAShapeError, infer_dims, resolve_scale
from .torch_mla import _to_bnsd

INDEXER_OP, SPARSE_OP = "torch_dsa_indexer", "torch_mla_sparse"


def check_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, index_topk: int) -> None:
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise MLAShapeError(f"{INDEXER_OP}: expected q [B,S,H,D], k [B,T,D], weights [B,S,H]; got q "
                            f"{tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or tuple(weights.shape) != (b, s, h):
        raise MLAShapeError(f"{INDEXER_OP}: q {tuple(q.shape)} needs k [{b}, T, {d}] and weights [{b}, {s}, {h}]; "
                            f"got k {tuple(k.shape)}, weights {tuple(weights.shape)}")
    if index_topk < 1:
        raise MLAShapeError(f"{INDEXER_OP}: index_topk must be >= 1, got {index_topk}")


def causal_visible(s: int, t: int, device: torch.device) -> torch.Tensor:
    """[S, T] bool: query i (the last S of T positions) sees key j <= i + T - S."""
    rows = torch.arange(s, device=device).unsqueeze(1) + (t - s)
    return torch.arange(t, device=device).unsqueeze(0) <= rows


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """[B, S, T] fp32: sum_h w_h * relu(q_h . k * scale), in the order Hugging Face computes it."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale  # [B,S,H,T]
    return torch.matmul(weights.float().unsqueeze(-2), F.relu(scores)).squeeze(-2)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, index_topk: int) -> torch.Tensor:
    """int32 [B, S, index_topk]: the best visible keys per query, by descending score; -1 pads."""
    masked = scores.masked_fill(~visible, float("-inf"))
    width = min(index_topk, masked.shape[-1])
    vals, idx = masked.topk(width, dim=-1)
    idx = torch.where(vals == float("-inf"), torch.full_like(idx, -1), idx).to(torch.int32)
    if width < index_topk:
        idx = F.pad(idx, (0, index_topk - width), value=-1)
    return idx


@torch.library.custom_op("autodeploy::torch_dsa_indexer", mutates_args=())
def torch_dsa_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    index_topk: int,
    softmax_scale: float,
    is_causal: bool = True,
) -> torch.Tensor:
    """Top-`index_topk` keys per query (int32 [B,S,index_topk], -1 = none). q [B,S,H,D] and k [B,T,D]
    after the indexer's RoPE and key norm; weights [B,S,H] = weights_proj(x) * H^-1/2."""
    check_indexer(q, k, weights, index_topk)
    s, t = q.shape[1], k.shape[1]
    visible = (causal_visible(s, t, q.device) if is_causal
               else torch.ones(s, t, dtype=torch.bool, device=q.device))
    return select_topk(index_scores(q, k, weights, softmax_scale), visible, index_topk)


@torch_dsa_indexer.register_fake
def _torch_dsa_indexer_fake(q, k, weights, index_topk, softmax_scale, is_causal=True):
    check_indexer(q, k, weights, index_topk)
    return q.new_empty((q.shape[0], q.shape[1], index_topk), dtype=torch.int32)


def selected_mask(topk_indices: torch.Tensor, t: int) -> torch.Tensor:
    """[B, S, T] bool: True at the keys `topk_indices` names (-1 entries name none)."""
    b, s, _ = topk_indices.shape
    idx = torch.where(topk_indices < 0, torch.full_like(topk_indices, t), topk_indices).long()
    sel = torch.zeros(b, s, t + 1, dtype=torch.bool, device=topk_indices.device)
    return sel.scatter(-1, idx, True)[..., :t]


def _check_indices(topk_indices: torch.Tensor, b: int, s: int) -> None:
    if topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (b, s) or topk_indices.dtype != torch.int32:
        raise MLAShapeError(f"{SPARSE_OP}: topk_indices must be int32 [{b}, {s}, K]; got {topk_indices.dtype} "
                            f"{tuple(topk_indices.shape)}")


@torch.library.custom_op("autodeploy::torch_mla_sparse", mutates_args=())
def torch_mla_sparse(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    topk_indices: torch.Tensor,
    is_causal: bool = True,
    scale: Optional[float] = None,
    layout: str = "bsnd",
) -> torch.Tensor:
    """Uncached sparse MLA: `torch_mla` where query i attends only to the keys in topk_indices[:, i]
    (that causality allows). Expanded form, as the oracle for cached sparse ops."""
    dims, b, s = infer_dims(SPARSE_OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, layout)
    _check_indices(topk_indices, b, s)
    n, dn, dv = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    w = kv_b_proj_weight.view(n, dn + dv, dims.kv_lora_rank)
    kv = torch.einsum("bsr,ndr->bnsd", compressed_kv, w)
    k_nope, v = kv.split([dn, dv], dim=-1)
    q = torch.cat([_to_bnsd(q_nope, layout), _to_bnsd(q_pe, layout)], dim=-1)
    k = torch.cat([k_nope, _to_bnsd(kpe, layout).expand(b, n, s, dims.qk_rope_head_dim)], dim=-1)
    allowed = selected_mask(topk_indices, s)
    if is_causal:
        allowed = allowed & causal_visible(s, s, q.device)
    out = F.scaled_dot_product_attention(q, k, v.contiguous(), attn_mask=allowed.unsqueeze(1),
                                         scale=resolve_scale(dims, scale))  # [B,N,S,Dv]
    return out.transpose(1, 2).contiguous() if layout == "bsnd" else out


@torch_mla_sparse.register_fake
def _torch_mla_sparse_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, topk_indices, is_causal=True,
                           scale=None, layout="bsnd"):
    dims, b, s = infer_dims(SPARSE_OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, layout)
    _check_indices(topk_indices, b, s)
    shape = (b, s, dims.num_heads, dims.v_head_dim) if layout == "bsnd" else (b, dims.num_heads, s, dims.v_head_dim)
    return q_nope.new_empty(shape)



# ----------------------------------------------------------------------------- cached (paged) form
#: host/device metadata the cached indexer reads (the torch reference backend's fields)
INDEXER_METADATA = ("batch_info_host", "max_seq_info_host", "cu_seqlen", "input_pos", "seq_len_with_cache",
                    "page_table", "batch_idx", "cache_loc")
CACHED_INDEXER_OP = "torch_dsa_indexer_with_cache"


def append_index_keys(op: str, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                      cache_loc: torch.Tensor, index_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached indexers' common start: check the inputs, write the step's index keys into their
    slots; returns (the cache viewed [slots, D], the output [1, T, index_topk] filled with -1)."""
    check_indexer(q, k, weights, index_topk)
    t_all, d = q.shape[1], q.shape[3]
    if index_cache.dim() != 3 or index_cache.shape[-1] != d:
        raise MLAShapeError(f"{op}: index_cache must be [num_pages, page_size, D={d}]; got {tuple(index_cache.shape)}")
    flat = index_cache.view(-1, d)
    flat.index_copy_(0, cache_loc[:t_all].long(), k[0].to(flat.dtype))
    return flat, torch.full((1, t_all, index_topk), -1, dtype=torch.int32, device=q.device)


@torch.library.custom_op("autodeploy::torch_dsa_indexer_with_cache", mutates_args=("index_cache",))
def torch_dsa_indexer_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    batch_info_host: torch.Tensor,
    max_seq_info_host: torch.Tensor,
    cu_seqlen: torch.Tensor,
    input_pos: torch.Tensor,
    seq_len_with_cache: torch.Tensor,
    page_table: torch.Tensor,
    batch_idx: torch.Tensor,
    cache_loc: torch.Tensor,
    index_cache: torch.Tensor,
    index_topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """The indexer over a packed token batch ([1, T, ...]) and a paged cache of index keys
    ([pages, page_size, D]): appends the step's keys, then per token returns the `index_topk` best
    positions (within its sequence) among those it may see, int32 [1, T, index_topk], -1 padded.
    Contract of every cached indexer op: the min(index_topk, position + 1) valid entries come first,
    the -1 entries after them (FlashInfer's sparse attention reads exactly that prefix).
    Vectorised like the torch MLA reference; sizes from host metadata only (no device sync)."""
    flat, out = append_index_keys(CACHED_INDEXER_OP, q, k, weights, index_cache, cache_loc, index_topk)
    d = q.shape[3]
    n_pre, n_pre_tok, n_dec = batch_info_host.tolist()
    max_q, max_kv = max_seq_info_host.tolist()
    nb, num_tok = n_pre + n_dec, n_pre_tok + n_dec
    if nb == 0 or num_tok == 0:
        return out
    dev = q.device
    ps = index_cache.shape[1]
    kv_pos = torch.arange(max_kv, device=dev)
    slots = page_table[:nb, kv_pos // ps].long() * ps + kv_pos % ps
    keys = flat[slots].float()  # [nb, max_kv, D]
    in_seq = kv_pos[None] < seq_len_with_cache[:nb, None].long()
    keys = keys.masked_fill(~in_seq[..., None], 0.0)  # stale slots may hold non-finite values
    tok_seq = batch_idx[:num_tok].long()
    tok_q = torch.arange(num_tok, device=dev) - cu_seqlen[tok_seq].long()
    h = q.shape[2]
    grid_q = q.new_zeros(nb, max_q, h, d, dtype=torch.float32)
    grid_q[tok_seq, tok_q] = q[0, :num_tok].float()
    grid_w = q.new_zeros(nb, max_q, h, dtype=torch.float32)
    grid_w[tok_seq, tok_q] = weights[0, :num_tok].float()
    scores = torch.matmul(grid_q, keys.transpose(-1, -2).unsqueeze(1)) * softmax_scale  # [nb, max_q, H, max_kv]
    scores = torch.matmul(grid_w.unsqueeze(-2), F.relu(scores)).squeeze(-2)  # [nb, max_q, max_kv]
    q_pos = input_pos[:nb, None].long() + torch.arange(max_q, device=dev)[None]
    visible = (kv_pos[None, None] <= q_pos[..., None]) & in_seq[:, None]
    out[0, :num_tok] = select_topk(scores, visible, index_topk)[tok_seq, tok_q]
    return out


@torch_dsa_indexer_with_cache.register_fake
def _torch_dsa_indexer_with_cache_fake(q, k, weights, batch_info_host, max_seq_info_host, cu_seqlen, input_pos,
                                       seq_len_with_cache, page_table, batch_idx, cache_loc, index_cache, index_topk,
                                       softmax_scale):
    check_indexer(q, k, weights, index_topk)
    return q.new_empty((1, q.shape[1], index_topk), dtype=torch.int32)


def allowed_by_topk(topk_indices: torch.Tensor, tok_seq: torch.Tensor, tok_q: torch.Tensor, nb: int, max_q: int,
                    max_kv: int) -> torch.Tensor:
    """[nb, max_q, max_kv] bool: the positions each packed token's top-k names (grid cells without a
    token allow everything, so their masked softmax stays finite)."""
    num_tok = tok_seq.shape[0]
    sel = topk_indices[0, :num_tok].long()
    sel = torch.where((sel < 0) | (sel >= max_kv), torch.full_like(sel, max_kv), sel)
    rows = torch.zeros(num_tok, max_kv + 1, dtype=torch.bool, device=sel.device).scatter(-1, sel, True)[:, :max_kv]
    grid = torch.ones(nb, max_q, max_kv, dtype=torch.bool, device=sel.device)
    grid[tok_seq, tok_q] = rows
    return grid


#: the op packets (fx nodes target `.default`)
DSA_INDEXER = torch.ops.autodeploy.torch_dsa_indexer
MLA_SPARSE = torch.ops.autodeploy.torch_mla_sparse
DSA_INDEXER_WITH_CACHE = torch.ops.autodeploy.torch_dsa_indexer_with_cache
