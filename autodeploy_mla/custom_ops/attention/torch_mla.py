"""`torch.ops.autodeploy.torch_mla`: the uncached MLA source op (DESIGN §4).

Models call it (or the match_mla pass rewrites HF attention into it); the cache-insertion pass
replaces it with a backend's cached op. The math here is the plain, expanded form (K/V materialised
through kv_b_proj) so that it is an independent oracle for the absorbed cached ops.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from .mla_dims import infer_dims, resolve_scale

if TYPE_CHECKING:
    import torch.fx

OP = "torch_mla"


def _to_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bsnd" else x


def mla_expanded_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    is_causal: bool,
    scale: Optional[float],
    layout: str,
) -> torch.Tensor:
    dims, b, s = infer_dims(OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, layout)
    n, dn, dv = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    w = kv_b_proj_weight.view(n, dn + dv, dims.kv_lora_rank)  # whole head rows: K_nope and V together
    kv = torch.einsum("bsr,ndr->bnsd", compressed_kv, w)  # [B,N,S,Dn+Dv]
    k_nope, v = kv.split([dn, dv], dim=-1)
    q = torch.cat([_to_bnsd(q_nope, layout), _to_bnsd(q_pe, layout)], dim=-1)
    k_pe = _to_bnsd(kpe, layout).expand(b, n, s, dims.qk_rope_head_dim)
    k = torch.cat([k_nope, k_pe], dim=-1)
    out = F.scaled_dot_product_attention(
        q, k, v.contiguous(), is_causal=is_causal, scale=resolve_scale(dims, scale)
    )  # [B,N,S,Dv]
    return out.transpose(1, 2).contiguous() if layout == "bsnd" else out


@torch.library.custom_op("autodeploy::torch_mla", mutates_args=())
def torch_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    is_causal: bool = True,
    scale: Optional[float] = None,
    layout: str = "bsnd",
) -> torch.Tensor:
    """Uncached MLA attention. Shapes per DESIGN §4; returns [B,S,N,Dv] (bsnd) or [B,N,S,Dv]."""
    return mla_expanded_attention(
        q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, is_causal, scale, layout
    )


@torch_mla.register_fake
def _torch_mla_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, is_causal=True, scale=None, layout="bsnd"):
    dims, b, s = infer_dims(OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, layout)
    shape = (b, s, dims.num_heads, dims.v_head_dim) if layout == "bsnd" else (b, dims.num_heads, s, dims.v_head_dim)
    return q_nope.new_empty(shape)


_SCHEMA = torch.ops.autodeploy.torch_mla.default._schema
_ARG_INDEX = MappingProxyType({a.name: i for i, a in enumerate(_SCHEMA.arguments)})
_ARG_DEFAULT = MappingProxyType({a.name: a.default_value for a in _SCHEMA.arguments if a.has_default_value()})


def source_arg(node: "torch.fx.Node", name: str) -> Any:
    """Argument `name` of a `torch_mla` node, whether passed positionally, by keyword, or defaulted
    (read from the op's own schema, so it cannot drift from the signature above)."""
    if name in node.kwargs:
        return node.kwargs[name]
    idx = _ARG_INDEX[name]
    if idx < len(node.args):
        return node.args[idx]
    return _ARG_DEFAULT.get(name)
