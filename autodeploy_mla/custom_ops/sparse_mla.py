"""Source ops of DeepSeek Sparse Attention (DSA): the lightning indexer's top-k and sparse MLA.

`torch.ops.autodeploy.torch_dsa_indexer` scores every visible key for each query and returns the
`index_topk` best as int32 `[B, S, index_topk]`, -1 where a query sees fewer keys than that. The
width is a constant, unlike Hugging Face's `topk(min(index_topk, T))`, so export can prove every
shape (the -1 padding is the contract sparse MLA kernels such as FlashMLA's use).

`torch.ops.autodeploy.torch_mla_sparse` is `torch_mla` restricted, per query, to the keys the indexer
selected (and that causality allows). Both are uncached: the sequence is its own history. The export
pass emits them in place of the HF sparse attention blocks (transforms/sparse_export.py); docs/sparse_mla.md
has the math with transformer's line numbers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .mla_dims import MLAShapeError, infer_dims, resolve_scale
from .torch_mla import _to_bnsd

INDEXER_OP, SPARSE_OP = "torch_dsa_indexer", "torch_mla_sparse"


def _check_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, index_topk: int) -> None:
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
    _check_indexer(q, k, weights, index_topk)
    s, t = q.shape[1], k.shape[1]
    visible = (causal_visible(s, t, q.device) if is_causal
               else torch.ones(s, t, dtype=torch.bool, device=q.device))
    return select_topk(index_scores(q, k, weights, softmax_scale), visible, index_topk)


@torch_dsa_indexer.register_fake
def _torch_dsa_indexer_fake(q, k, weights, index_topk, softmax_scale, is_causal=True):
    _check_indexer(q, k, weights, index_topk)
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


SPARSE_SOURCE_OPS = (torch.ops.autodeploy.torch_dsa_indexer.default, torch.ops.autodeploy.torch_mla_sparse.default)
