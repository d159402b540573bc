"""Planning one block: walk back from the attention to the five torch_mla inputs and prove the
block equivalent (shapes, the shared rope key, the kv_b_proj split), before the graph is touched."""

from __future__ import annotations

import operator
from typing import Any, Optional

from torch.fx import GraphModule, Node

from ...custom_ops.attention.mla_dims import MLADims
from ...custom_ops.fp8.linear import FP8_LINEAR
from ..fp8_graph import fp8_linear_parts
from ..fx_utils import RESHAPES, aten, skip
from ..fx_utils import shape as _shape
from .causal_mask import _check_causal
from .find import _arg
from .model import _ALLOCATIONS, _Attention, _Plan, _Refuse
from .rewrite import _dim_eq, _same_shape, _val



# --------------------------------------------------------------------------------------------
# Planning: prove one block equivalent to torch_mla
# --------------------------------------------------------------------------------------------


def _plan(gm: GraphModule, att: _Attention, mask_cache: dict[Node, list[str]]) -> _Plan:
    """Check one attention block and collect the torch_mla inputs; raises _Refuse on any doubt."""
    if att.problems:
        raise _Refuse("; ".join(att.problems))
    notes = [f"{att.source} attention"]

    # Key = [k_nope | broadcast(kpe)], value from the same kv_b_proj split as k_nope.
    key_parts = _concat_parts(att.k)
    if key_parts is None:
        raise _Refuse(f"key {att.k.name} is not a concatenation [k_nope | k_rope] (cat or new_empty + copy_)")
    k_nope, k_rope = key_parts
    linear, dn, dv, n_heads = _kv_b_proj(k_nope, att.v)
    weight = linear.args[1]
    fp8 = fp8_linear_parts(linear) if linear.target is FP8_LINEAR else None
    kpe = _shared_rope_key(k_rope)

    # Query = [q_nope | q_pe], optionally times a factor broadcast over the head dim (Mistral4).
    q, factor = att.q, None
    if q.target is aten.mul.Tensor and _concat_view(q) is None:
        q, factor = _split_query_factor(q)
        notes.append(f"query factor {getattr(factor, 'name', factor)} folded into q_nope and q_pe")
    q_parts = _concat_view(q)
    if q_parts is None:
        raise _Refuse(f"query {q.name} is not a concatenation [q_nope | q_pe]")
    q_nope, q_pe, q_bsnd = q_parts

    latent = linear.args[0]
    dims = _check_shapes(att, q_nope, q_pe, q_bsnd, latent, kpe, weight, dn, dv, n_heads, fp8 is not None)

    scale = att.scale if att.scale is not None else dims.default_scale()
    if not isinstance(scale, (int, float)):
        raise _Refuse(f"softmax scale is not a constant float ({scale!r})")
    scale = float(scale)
    if abs(scale - dims.default_scale()) > 1e-12 * dims.default_scale():
        notes.append(f"scale {scale:.6g} != (Dn+Dr)^-0.5 = {dims.default_scale():.6g} (e.g. YaRN mscale)")

    notes.extend(_check_causal(gm, att, mask_cache))
    bias = fp8.bias if fp8 is not None else (linear.kwargs.get("bias") or (linear.args[2] if len(linear.args) > 2 else None))
    if bias is not None:
        raise _Refuse("kv_b_proj has a bias; torch_mla takes the weight only")
    if fp8 is not None:
        notes.append(f"kv_b_proj is FP8 (blocks [{fp8.block_n}, {fp8.block_k}]): dequantized once at build for "
                     "weight absorption")
    return _Plan(att, q_nope, q_pe, q_bsnd, factor, latent, kpe, weight, dims, scale, notes, fp8)


def _concat_parts(node: Node) -> Optional[tuple[Node, Node]]:
    """(first, second) if `node` is [first | second] along the last dim, else None.

    Accepts `cat([a, b], -1)` and the HF `new_empty` buffer written by exactly two `copy_` into
    slices [0:a] and [a:] of its last dim (the buffer must have no other writer).
    """
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    rank = len(_shape(node))
    if node.target is aten.cat.default:
        parts, dim = node.args[0], _arg(node, 1, "dim", 0)
        if len(parts) == 2 and dim in (-1, rank - 1):
            return parts[0], parts[1]
        return None
    if node.target not in _ALLOCATIONS:
        return None
    width = _shape(node)[-1]
    writes = []
    for user in node.users:
        if user.target is aten.slice.Tensor:
            copies = list(user.users)
            if len(copies) != 1 or copies[0].target is not aten.copy_.default or copies[0].args[0] is not user:
                return None
            writes.append((_slice_range(user, width, rank), copies[0].args[1]))
        elif user.target in (aten.copy_.default, aten.fill_.Scalar, aten.zero_.default) or _mutates(user):
            return None
    if len(writes) != 2 or any(rng is None for rng, _ in writes):
        return None
    (r0, src0), (r1, src1) = sorted(writes, key=lambda w: w[0])
    if r0[0] != 0 or r0[1] != r1[0] or not _dim_eq(r1[1], width):
        return None
    return src0, src1


def _concat_view(node: Node) -> Optional[tuple[Node, Node, bool]]:
    """(first, second, parts_are_bsnd): [first | second] as [B,N,S,D], or transposed from [B,S,N,D]."""
    parts = _concat_parts(node)
    if parts is not None:
        return parts[0], parts[1], False
    if isinstance(node, Node) and node.target is aten.transpose.int and {node.args[1], node.args[2]} == {1, 2}:
        parts = _concat_parts(node.args[0])
        if parts is not None:
            return parts[0], parts[1], True
    return None


def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _slice_range(node: Node, width: Any, rank: int) -> Optional[tuple[Any, Any]]:
    """(start, end) of a unit-step slice over the last dim (end clamped to the width)."""
    dim = _arg(node, 1, "dim", 0)
    start = _arg(node, 2, "start", None) or 0
    end = _arg(node, 3, "end", None)
    if dim not in (-1, rank - 1) or _arg(node, 4, "step", 1) != 1:
        return None
    if end is None or (isinstance(end, int) and (end >= 2**62 or (isinstance(width, int) and end >= width))):
        end = width
    return start, end


def _kv_b_proj(k_nope: Node, v: Node) -> tuple[Node, int, int, int]:
    """Prove k_nope, v = split(transpose(view(linear(latent, W), [B,S,N,Dn+Dv]), 1, 2), [Dn, Dv]).

    Returns (linear, Dn, Dv, N).
    """
    kn_base, kn_range = _last_dim_piece(k_nope)
    v_base, v_range = _last_dim_piece(skip(v, (aten.contiguous.default, aten.clone.default)))
    if kn_base is None or v_base is None or kn_base is not v_base:
        raise _Refuse("key (no-rope part) and value are not two halves of one kv_b_proj output")
    if kn_range[0] != 0 or kn_range[1] != v_range[0] or not _dim_eq(v_range[1], _shape(kn_base)[-1]):
        raise _Refuse(f"kv_b_proj output split {kn_range}/{v_range} is not [0:Dn] / [Dn:Dn+Dv]")
    dn, dv = int(kn_range[1]), int(v_range[1]) - int(kn_range[1])
    t = kn_base
    if t.target is not aten.transpose.int or {t.args[1], t.args[2]} != {1, 2}:
        raise _Refuse(f"kv_b_proj output {t.name} is not transposed from [B,S,N,D] to [B,N,S,D]")
    x = t.args[0]
    if x.target not in RESHAPES:
        raise _Refuse(f"kv_b_proj output {x.name} is not a view into heads")
    linear = x.args[0]
    if not (isinstance(linear, Node) and linear.target in (aten.linear.default, FP8_LINEAR)):
        raise _Refuse(f"key/value do not come from a linear projection of the latent ({linear})")
    n_heads, head = _shape(x)[-2], _shape(x)[-1]
    weight = linear.args[1]
    if not isinstance(n_heads, int) or head != dn + dv or weight.op != "get_attr":
        raise _Refuse(f"kv_b_proj view {tuple(_shape(x))} / weight {weight} do not give [N, Dn+Dv] heads")
    w_shape = tuple(_shape(weight))
    if len(w_shape) != 2 or w_shape[0] != n_heads * (dn + dv):
        raise _Refuse(f"kv_b_proj weight shape {w_shape} is not [N*(Dn+Dv), R] = [{n_heads}*{dn + dv}, R]")
    return linear, dn, dv, n_heads


def _last_dim_piece(node: Node) -> tuple[Optional[Node], Optional[tuple[int, Any]]]:
    """(base, (start, end)) if node is getitem(split_with_sizes(base, sizes, -1), i) or a slice."""
    if node.target is operator.getitem and node.args[0].target is aten.split_with_sizes.default:
        split, i = node.args
        base, sizes = split.args[0], list(split.args[1])
        dim = _arg(split, 2, "dim", 0)
        if dim in (-1, len(_shape(base)) - 1):
            return base, (sum(sizes[:i]), sum(sizes[: i + 1]))
    if node.target is aten.slice.Tensor:
        base = node.args[0]
        rng = _slice_range(node, _shape(base)[-1], len(_shape(base)))
        if rng is not None:
            return base, rng
    return None, None


def _shared_rope_key(k_rope: Node) -> Node:
    """The rope key [B, 1, S, Dr] shared by all heads (the key part is its expand or itself)."""
    src = k_rope
    if src.target is aten.expand.default:
        src = src.args[0]
    shape = _shape(src)
    if len(shape) != 4 or shape[1] != 1:
        raise _Refuse(
            f"rope part of the key {k_rope.name} is not one head broadcast to all heads (shape {tuple(shape)})"
        )
    return src


def _split_query_factor(q: Node) -> tuple[Node, Any]:
    """q = cat * f with f broadcast over the last dim: returns (cat, f) so f folds into both parts."""
    a, b = q.args
    for base, factor in ((a, b), (b, a)):
        if isinstance(base, Node) and _concat_view(base) is not None:
            if isinstance(factor, (int, float)):
                return base, factor
            fshape = _shape(factor)
            if len(fshape) <= len(_shape(base)) and (len(fshape) == 0 or fshape[-1] == 1):
                if _same_shape(_shape(q), _shape(base)):
                    return base, factor
            raise _Refuse(f"query factor {factor} of shape {tuple(fshape)} is not constant over the head dim")
    raise _Refuse(f"query {q.name} is a product that is not [q_nope | q_pe] * factor")


def _check_shapes(
    att: _Attention,
    q_nope: Node,
    q_pe: Node,
    q_bsnd: bool,
    latent: Node,
    kpe: Node,
    weight: Node,
    dn: int,
    dv: int,
    n: int,
    fp8_weight: bool = False,
) -> MLADims:
    """Cross-check every shape and dtype (an FP8 weight's is its own); returns the block's MLA dims."""
    qn, qp, lat, kp = _shape(q_nope), _shape(q_pe), _shape(latent), _shape(kpe)
    if len(qn) != 4 or len(qp) != 4:
        raise _Refuse(f"query parts are not 4-D: {tuple(qn)}, {tuple(qp)}")
    if q_bsnd:  # compare in [B, N, S, D]
        qn, qp = [qn[0], qn[2], qn[1], qn[3]], [qp[0], qp[2], qp[1], qp[3]]
    b, s = qn[0], qn[2]
    dr = qp[-1]
    if qn[1] != n or qp[1] != n or qn[-1] != dn:
        raise _Refuse(f"query parts {tuple(qn)}, {tuple(qp)} disagree with N={n}, Dn={dn} of kv_b_proj")
    if not (_dim_eq(qp[0], b) and _dim_eq(qp[2], s)):
        raise _Refuse("q_nope and q_pe disagree on batch/seq")
    if not (_dim_eq(kp[0], b) and _dim_eq(kp[2], s) and kp[-1] == dr):
        raise _Refuse(f"rope key {tuple(kp)} does not match the query rope part {tuple(qp)}")
    lat_tokens = [d for i, d in enumerate(lat[:-1]) if not (len(lat) == 4 and i == 1 and d == 1)]
    if len(lat_tokens) != 2 or not (_dim_eq(lat_tokens[0], b) and _dim_eq(lat_tokens[1], s)):
        raise _Refuse(f"latent {latent.name} of shape {tuple(lat)} is not per token [B,S,R] or [B,1,S,R]")
    r = lat[-1]
    if _shape(weight)[1] != r:
        raise _Refuse(f"kv_b_proj weight {tuple(_shape(weight))} does not take the latent width R={r}")
    dtypes = {str(_val(x).dtype) for x in (q_nope, q_pe, latent, kpe, *(() if fp8_weight else (weight,)), att.k)}
    if len(dtypes) != 1:
        raise _Refuse(f"MLA inputs have mixed dtypes {sorted(dtypes)}")
    return MLADims(num_heads=n, qk_nope_head_dim=dn, qk_rope_head_dim=int(dr), v_head_dim=dv, kv_lora_rank=int(r))
