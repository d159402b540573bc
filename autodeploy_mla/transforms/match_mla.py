"""Rewrite Hugging Face MLA attention blocks of an exported graph into `torch_mla` (DESIGN §4, §5).

HF MLA attention (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral-Small-4, MiniCPM3, ...) materialises the
per-head key and value from the latent: `kv_b_proj(latent)` → split [Dn | Dv]; the key is
`[k_nope | broadcast(k_rope)]` and the query `[q_nope | q_rope]`; then SDPA (or the eager
matmul-softmax-matmul) with the softmax scale baked in as a float and a causal mask.
Every later pass (cache insertion, backend resolution) needs the *latent* form instead, so this
pass anchors on each attention node, walks the data flow back to those five tensors and replaces
the block with one `torch.ops.autodeploy.torch_mla(q_nope, q_pe, compressed_kv, kpe,
kv_b_proj_weight, True, scale)` call.

Soundness rules:
- Everything is checked for every block before the graph is touched: a refusal never leaves a
  half-rewritten graph.
- The rewritten op is causal over the sequence, so the mask being dropped must be proven to be the
  plain causal mask: it may depend on the values of `position_ids` only (padding masks and other
  data-dependent masks are refused), and evaluating its subgraph on probe positions must give
  exactly the lower-triangular mask. SDPA with `is_causal=True` and no mask needs no probe.
- An attention whose key and value come from one projection that the query does not use (the MLA
  signature) but that fails any check raises MLAMatchError naming the layer and the reason.
  Attention without that signature (plain MHA/GQA) is left alone and listed in
  `gm.meta["match_mla_skipped"]`; pass `strict=True` to refuse such graphs instead.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from pydantic import Field
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from ..custom_ops.attention.mla_dims import MLADims, infer_dims
from ..custom_ops.attention.torch_mla import source_arg
from .context import BuildContext
from .fx_utils import ASSERT_METADATA, RESHAPES, TORCH_MLA, aten, module_path, module_stack, skip
from .fx_utils import shape as _shape
from .sparse_export import sparse_mla_nodes, sparse_node_dims
from .registry import PassOptions, PassResult, Stage, register_pass

__all__ = ["MLAMatch", "MLAMatchError", "match_mla"]

logger = logging.getLogger(__name__)

# HF attention class → family key reported in MLAMatch.kind.
_FAMILY_BY_CLASS = {
    "DeepseekV2Attention": "deepseek_v2",
    "DeepseekV3Attention": "deepseek_v3",
    "Glm4MoeLiteAttention": "glm4_moe_lite",
    "MiniCPM3Attention": "minicpm3",
    "Mistral4Attention": "mistral4",
    "YoutuAttention": "youtu",
}

# Ops that only move/reshape data; used to find where key and value come from.
_MOVEMENT = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.split_with_sizes.default,
    aten.split.Tensor,
    aten.slice.Tensor,
    aten.expand.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.cat.default,
    operator.getitem,
}
_ALLOCATIONS = {aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default, aten.zeros.default}
# Probe (batch, seq) sizes at which a mask must equal the causal mask.
_MASK_PROBES = ((2, 1), (2, 7), (1, 64), (1, 333))


class MLAMatchError(RuntimeError):
    """An attention block looks like MLA but cannot be proven equivalent to torch_mla."""


@dataclass
class MLAMatch:
    """One torch_mla node of the matched graph, for the build report and the later passes."""

    layer: str  # module path, e.g. "model.layers.3.self_attn"
    node: str  # name of the torch_mla node in the graph
    dims: MLADims
    scale: float  # softmax scale passed to torch_mla (YaRN mscale included)
    kind: str  # HF family whose pattern matched ("deepseek_v3", ...), "mla" if unknown, "native"
    source: str  # what was rewritten: "sdpa", "eager" (matmul-softmax-matmul) or "torch_mla"
    notes: list[str] = field(default_factory=list)


@dataclass
class _Attention:
    """One attention computation found in the graph, normalised across SDPA and eager."""

    anchor: Node  # node producing the attention output [B, N, S, Dv]
    source: str
    layer: str
    kind: str
    q: Optional[Node]  # None when an eager chain was found but not understood (see problems)
    k: Optional[Node]
    v: Node
    mask: Optional[Node]
    is_causal: bool
    scale: Optional[float]
    problems: list[str]  # structural deviations found while parsing (eager chain)


@dataclass
class _Plan:
    """Everything needed to rewrite one attention block; built before any mutation."""

    att: _Attention
    q_nope: Node  # [B, N, S, Dn], or [B, S, N, Dn] if q_bsnd
    q_pe: Node  # [B, N, S, Dr], or [B, S, N, Dr] if q_bsnd
    q_bsnd: bool  # the query was concatenated in [B, S, N, D] and then transposed
    q_factor: Optional[Any]  # Node or number multiplying the whole [B,N,S,D] query (Mistral4), or None
    latent: Node  # [B, S, R] or [B, 1, S, R]
    kpe: Node  # [B, 1, S, Dr]
    weight: Node  # get_attr of kv_b_proj weight [N*(Dn+Dv), R]
    dims: MLADims
    scale: float
    notes: list[str]


class _Refuse(Exception):
    """Internal: a check failed; turned into MLAMatchError (MLA-like) or a skip (plain attention)."""


def match_mla(gm: GraphModule, *, strict: bool = False) -> list[MLAMatch]:
    """Rewrite every HF MLA attention block of `gm` into one torch_mla node, in place.

    Returns one record per torch_mla node of the result (rewritten ones and ones the model already
    called natively, kind "native"), in graph order. Raises MLAMatchError, before changing the
    graph, if an MLA-looking block cannot be proven equivalent; with `strict=True` also if the
    graph has attention that is not MLA at all (otherwise that attention is left alone, logged and
    listed in `gm.meta["match_mla_skipped"]` as (layer, reason)).
    """
    graph = gm.graph
    records: dict[Node, MLAMatch] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is TORCH_MLA:
            records[node] = _native_record(node)
    plans: list[_Plan] = []
    skipped: list[tuple[str, str]] = []
    mask_cache: dict[Node, list[str]] = {}
    for att in _find_attention(gm):
        try:
            plans.append(_plan(gm, att, mask_cache))
        except _Refuse as why:
            if _looks_like_mla(att):
                raise MLAMatchError(
                    f"{att.layer}: attention looks like MLA ({att.kind}, {att.source}) but cannot be "
                    f"rewritten into torch_mla: {why}"
                ) from None
            if strict:
                raise MLAMatchError(f"{att.layer}: attention is not MLA ({att.source}): {why}") from None
            logger.warning("match_mla: left %s alone (not MLA): %s", att.layer, why)
            skipped.append((att.layer, str(why)))

    for plan in plans:
        node = _rewrite(gm, plan)
        att = plan.att
        records[node] = MLAMatch(att.layer, node.name, plan.dims, plan.scale, att.kind, att.source, plan.notes)
    _erase_dead(graph, [p.att.anchor for p in plans])
    graph.lint()
    gm.recompile()
    gm.meta["match_mla_skipped"] = skipped

    ordered = [records[n] for n in graph.nodes if n in records]
    for node, rec in records.items():
        node.meta["mla_dims"] = rec.dims
        node.meta["mla_layer"] = rec.layer
    return ordered


# --------------------------------------------------------------------------------------------
# Finding attention nodes
# --------------------------------------------------------------------------------------------


def _find_attention(gm: GraphModule) -> list[_Attention]:
    """All SDPA nodes and eager matmul(softmax(q·kᵀ·scale + mask), v) chains, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            found.append(_parse_sdpa(node))
        elif node.target in (aten.matmul.default, aten.bmm.default):
            att = _parse_eager(node)
            if att is not None:
                found.append(att)
    return found


def _arg(node: Node, idx: int, name: str, default: Any = None) -> Any:
    if len(node.args) > idx:
        return node.args[idx]
    return node.kwargs.get(name, default)


def _parse_sdpa(node: Node) -> _Attention:
    layer, kind = _layer_and_kind(node)
    problems = []
    if _arg(node, 4, "dropout_p", 0.0) != 0.0:
        problems.append(f"SDPA has dropout_p={_arg(node, 4, 'dropout_p')}")
    if node.kwargs.get("enable_gqa", False):
        problems.append("SDPA uses enable_gqa (MLA has one key head per query head)")
    return _Attention(
        anchor=node,
        source="sdpa",
        layer=layer,
        kind=kind,
        q=node.args[0],
        k=node.args[1],
        v=node.args[2],
        mask=_arg(node, 3, "attn_mask"),
        is_causal=bool(_arg(node, 5, "is_causal", False)),
        scale=node.kwargs.get("scale"),
        problems=problems,
    )


def _is_noop_dropout(node: Node) -> bool:
    return node.target is aten.dropout.default and (node.args[1] == 0.0 or not node.args[2])


def _skip_passthrough(node: Any) -> Any:
    """Skip dtype casts, contiguous and no-op dropout between softmax and the value matmul."""
    while isinstance(node, Node) and node.op == "call_function":
        if node.target in (aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.contiguous.default):
            node = node.args[0]
        elif _is_noop_dropout(node):
            node = node.args[0]
        else:
            break
    return node


def _parse_eager(mm_out: Node) -> Optional[_Attention]:
    """Recognise matmul(softmax(matmul(q, kᵀ) * scale [+ mask]), v).

    None if the matmul is not applied to a softmax (not attention); an _Attention with problems
    (and q/k None) if it is but the score computation is not understood.
    """
    probs = _skip_passthrough(mm_out.args[0])
    if not (isinstance(probs, Node) and probs.target in (aten.softmax.int, aten._softmax.default)):
        return None
    problems = []
    rank = len(_shape(probs))
    if probs.args[1] not in (-1, rank - 1):
        problems.append(f"softmax over dim {probs.args[1]} instead of the key dim")
    scores, mask = probs.args[0], None
    if isinstance(scores, Node) and scores.target is aten.add.Tensor:
        a, b = scores.args
        if _scores_matmul(a) is not None:
            scores, mask = a, b
        elif _scores_matmul(b) is not None:
            scores, mask = b, a
    layer, kind = _layer_and_kind(mm_out)
    mm_qk = _scores_matmul(scores)
    if mm_qk is None:
        problems.append(f"unrecognised eager attention: softmax input {scores} is not q·kᵀ·scale (+ mask)")
        return _Attention(mm_out, "eager", layer, kind, None, None, mm_out.args[1], None, False, None, problems)
    scale = 1.0
    if scores is not mm_qk:
        if scores.target is aten.mul.Tensor:
            scale = float(scores.args[1] if scores.args[0] is mm_qk else scores.args[0])
        else:
            scale = 1.0 / float(scores.args[1])
    q, kt = mm_qk.args
    is_kt = isinstance(kt, Node) and kt.target is aten.transpose.int
    if not (is_kt and {kt.args[1], kt.args[2]} in ({2, 3}, {-2, -1})):
        problems.append(f"unrecognised eager attention: scores {mm_qk.name} are not q·kᵀ with kᵀ a transpose")
        return _Attention(mm_out, "eager", layer, kind, None, None, mm_out.args[1], None, False, None, problems)
    if mask is not None and not isinstance(mask, Node):
        problems.append(f"attention adds a constant {mask!r} to the scores")
    return _Attention(
        anchor=mm_out,
        source="eager",
        layer=layer,
        kind=kind,
        q=q,
        k=kt.args[0],
        v=mm_out.args[1],
        mask=mask,
        is_causal=False,
        scale=scale,
        problems=problems,
    )


def _scores_matmul(node: Any) -> Optional[Node]:
    """The q·kᵀ matmul under an optional multiplication/division by a Python scalar."""
    if not isinstance(node, Node):
        return None
    if node.target in (aten.mul.Tensor, aten.div.Tensor):
        a, b = node.args
        if node.target is aten.mul.Tensor and isinstance(a, (int, float)):
            a, b = b, a
        if not isinstance(b, (int, float)):
            return None
        node = a
    if isinstance(node, Node) and node.target is aten.matmul.default:
        return node
    return None


def _layer_and_kind(node: Node) -> tuple[str, str]:
    """Module path and family of the attention module that produced `node`.

    export_model makes nn_module_stack paths the model's own module names ("model.layers.3.self_attn");
    attention computed in the root module's forward is named after the node.
    """
    stack = module_stack(node)
    if not stack:
        return node.name, "mla"
    path, cls = stack[-1]
    for p, c in reversed(stack):
        if _class_name(c).endswith("Attention"):
            path, cls = p, c
            break
    return path or node.name, _FAMILY_BY_CLASS.get(_class_name(cls), "mla")


def _class_name(cls: Any) -> str:
    return cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")


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
    dims = _check_shapes(att, q_nope, q_pe, q_bsnd, latent, kpe, weight, dn, dv, n_heads)

    scale = att.scale if att.scale is not None else dims.default_scale()
    if not isinstance(scale, (int, float)):
        raise _Refuse(f"softmax scale is not a constant float ({scale!r})")
    scale = float(scale)
    if abs(scale - dims.default_scale()) > 1e-12 * dims.default_scale():
        notes.append(f"scale {scale:.6g} != (Dn+Dr)^-0.5 = {dims.default_scale():.6g} (e.g. YaRN mscale)")

    notes.extend(_check_causal(gm, att, mask_cache))
    if linear.kwargs.get("bias") is not None or (len(linear.args) > 2 and linear.args[2] is not None):
        raise _Refuse("kv_b_proj has a bias; torch_mla takes the weight only")
    return _Plan(att, q_nope, q_pe, q_bsnd, factor, latent, kpe, weight, dims, scale, notes)


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
    if not (isinstance(linear, Node) and linear.target is aten.linear.default):
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
) -> MLADims:
    """Cross-check every shape and dtype; returns the block's MLA dims."""
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
    dtypes = {str(_val(x).dtype) for x in (q_nope, q_pe, latent, kpe, weight, att.k)}
    if len(dtypes) != 1:
        raise _Refuse(f"MLA inputs have mixed dtypes {sorted(dtypes)}")
    return MLADims(num_heads=n, qk_nope_head_dim=dn, qk_rope_head_dim=int(dr), v_head_dim=dv, kv_lora_rank=int(r))


# --------------------------------------------------------------------------------------------
# Proving the mask causal
# --------------------------------------------------------------------------------------------


def _check_causal(gm: GraphModule, att: _Attention, cache: dict[Node, list[str]]) -> list[str]:
    """Prove the block attends causally; returns notes. Raises _Refuse otherwise."""
    if att.mask is None:
        if att.is_causal:
            return ["causal via SDPA is_causal=True"]
        raise _Refuse("attention is not causal (no mask and is_causal=False); torch_mla is causal")
    if att.is_causal:
        raise _Refuse("SDPA has both a mask and is_causal=True")
    if att.mask not in cache:
        cache[att.mask] = _prove_causal_mask(gm, att.mask, att.q, additive=att.source == "eager")
    return cache[att.mask]


def _prove_causal_mask(gm: GraphModule, mask: Node, q: Node, additive: bool) -> list[str]:
    """Evaluate the mask's subgraph on probe positions and compare with the lower-triangular mask.

    The subgraph may read the values of `position_ids` only (other inputs: shapes only), so a
    padding mask (an `attention_mask` input) or a token-dependent mask is refused up front.
    """
    ancestors = _ancestors(mask)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and n in ancestors]
    for ph in inputs:
        shape_only = (aten.sym_size.int, aten.sym_numel.default)
        data_users = [u for u in ph.users if u in ancestors and u.target not in shape_only]
        if data_users and ph.name != "position_ids":
            if "mask" in ph.name:
                raise _Refuse(
                    f"padding attention mask: the mask is computed from graph input '{ph.name}'; torch_mla "
                    "is causal over packed sequences and cannot apply a padding mask. Export without "
                    "attention_mask (export_model does) and pack sequences instead of padding them"
                )
            raise _Refuse(f"data-dependent mask: the mask depends on the values of graph input '{ph.name}'")
    sub = _extract(gm, mask, ancestors, inputs)
    qshape = _shape(q)
    batch_sym, seq_sym = qshape[0], qshape[2]
    probes = [(b, s) for b, s in _MASK_PROBES if _fits(batch_sym, b) and _fits(seq_sym, s)] or [
        (int(batch_sym), int(seq_sym))
    ]
    for b, s in probes:
        positions = torch.arange(s).expand(b, s)
        got = _run_mask(sub, inputs, {str(batch_sym): b, str(seq_sym): s}, positions)
        want = torch.ones(s, s, dtype=torch.bool).tril()
        if not _mask_equals(got, want, additive):
            raise _Refuse(
                f"mask {mask.name} is not the plain causal mask at batch={b}, seq={s} (sliding window, "
                "bidirectional or otherwise modified masks are not supported by torch_mla)"
            )
    notes = [f"mask {mask.name} proven causal for position_ids=arange at (batch, seq) in {probes}"]
    if any(ph.name == "position_ids" for ph in inputs) and _fits(batch_sym, 1) and _fits(seq_sym, 5):
        packed = torch.tensor([[0, 1, 2, 0, 1]])
        got = _run_mask(sub, inputs, {str(batch_sym): 1, str(seq_sym): 5}, packed)
        block = torch.zeros(5, 5, dtype=torch.bool)
        block[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
        block[3:, 3:] = torch.ones(2, 2, dtype=torch.bool).tril()
        if _mask_equals(got, block, additive):
            notes.append("mask is packed-sequence aware: position_ids resets start a new causal block")
    return notes


def _fits(dim: Any, value: int) -> bool:
    """A probe size is usable for a symbolic dim (any size) or a static dim equal to it."""
    return not isinstance(dim, int) or dim == value


def _ancestors(node: Node) -> set[Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _extract(gm: GraphModule, out: Node, nodes: set[Node], inputs: list[Node]) -> GraphModule:
    """A GraphModule computing `out` from `inputs` (the mask subgraph), sharing gm's attributes."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node in nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[out])
    return GraphModule(gm, graph)


def _run_mask(sub: GraphModule, inputs: list[Node], sizes: dict[str, int], positions: torch.Tensor) -> torch.Tensor:
    args = []
    for ph in inputs:
        val = _val(ph)
        shape = []
        for d in val.shape:
            if isinstance(d, int):
                shape.append(d)
            elif str(d) in sizes:
                shape.append(sizes[str(d)])
            else:
                raise _Refuse(f"cannot evaluate the mask: input '{ph.name}' has a size {d} other than batch/seq")
        if ph.name == "position_ids":
            if tuple(shape) != tuple(positions.shape):
                raise _Refuse(f"cannot evaluate the mask: position_ids has shape {tuple(val.shape)}, not [B,S]")
            args.append(positions.to(device=val.device, dtype=val.dtype))
        else:
            args.append(torch.zeros(shape, dtype=val.dtype, device=val.device))
    with torch.no_grad():  # probe on the graph's own device (CUDA graphs hold CUDA constants)
        out = sub(*args)
    return out.cpu() if isinstance(out, torch.Tensor) else out


def _mask_equals(got: Any, want: torch.Tensor, additive: bool) -> bool:
    """Bool masks: True = attend. Float masks: 0 = attend, <= finfo.min/2 (or -inf) = masked."""
    if not isinstance(got, torch.Tensor) or got.dim() < 2 or tuple(got.shape[-2:]) != tuple(want.shape):
        return False
    if got.dtype == torch.bool:
        return not additive and bool((got == want).all())
    if not got.dtype.is_floating_point:
        return False
    attend = got == 0
    blocked = got <= torch.finfo(got.dtype).min / 2
    return bool((attend == want).all() and (blocked == ~want).all())


# --------------------------------------------------------------------------------------------
# Telling MLA from plain attention
# --------------------------------------------------------------------------------------------


def _looks_like_mla(att: _Attention) -> bool:
    """Key and value come from one projection that the query does not use (kv_b_proj of a latent).

    Fused-QKV attention shares one projection among q, k and v, so it does not count. An eager
    chain whose scores could not be parsed (q/k unknown) is not claimed as MLA: it is skipped.
    """
    if att.q is None or att.k is None:
        return False
    k_src = _projection_sources(att.k)
    v_src = _projection_sources(att.v)
    q_src = _projection_sources(att.q)
    return bool((k_src & v_src) - q_src)


def _projection_sources(node: Any) -> set[Node]:
    """Linear/matmul nodes reached from `node` through data-movement ops and key-assembly buffers."""
    found, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or n in seen:
            continue
        seen.add(n)
        if n.target in (aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default):
            found.add(n)
        elif n.target in _MOVEMENT:
            stack.extend(n.all_input_nodes)
        elif n.target in _ALLOCATIONS:
            for user in n.users:
                for w in user.users if user.target is aten.slice.Tensor else ():
                    if w.target is aten.copy_.default:
                        stack.append(w.args[1])
    return found


# --------------------------------------------------------------------------------------------
# Rewriting
# --------------------------------------------------------------------------------------------


def _rewrite(gm: GraphModule, plan: _Plan) -> Node:
    """Insert torch_mla before the anchor and redirect the anchor's users to its output."""
    graph, anchor = gm.graph, plan.att.anchor

    def add(target: Callable, *args: Any) -> Node:
        node = graph.call_function(target, args)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in anchor.meta:
                node.meta[key] = anchor.meta[key]
        node.meta["val"] = _fake_eval(target, args)
        return node

    with graph.inserting_before(anchor):
        q_nope, q_pe = plan.q_nope, plan.q_pe
        if not plan.q_bsnd or plan.q_factor is not None:
            if plan.q_bsnd:  # the factor broadcasts against [B, N, S, D]
                q_nope, q_pe = add(aten.transpose.int, q_nope, 1, 2), add(aten.transpose.int, q_pe, 1, 2)
            if plan.q_factor is not None:
                q_nope = add(aten.mul.Tensor, q_nope, plan.q_factor)
                q_pe = add(aten.mul.Tensor, q_pe, plan.q_factor)
            q_nope, q_pe = add(aten.transpose.int, q_nope, 1, 2), add(aten.transpose.int, q_pe, 1, 2)
        latent = plan.latent
        if len(_shape(latent)) == 4:
            latent = _unflattened_source(latent) or add(aten.squeeze.dim, latent, 1)
        kpe = add(aten.transpose.int, plan.kpe, 1, 2)
        mla = add(TORCH_MLA, q_nope, q_pe, latent, kpe, plan.weight, True, plan.scale)
        out = add(aten.transpose.int, mla, 1, 2)
    anchor.replace_all_uses_with(out)
    return mla


def _unflattened_source(latent: Node) -> Optional[Node]:
    """The [B,S,R] tensor that a [B,1,S,R] latent view was made from, if it is one."""
    if latent.target in RESHAPES or latent.target is aten.unsqueeze.default:
        src = latent.args[0]
        shape, src_shape = _shape(latent), _shape(src)
        if len(src_shape) == 3 and _same_shape(src_shape, [shape[0], shape[2], shape[3]]):
            return src
    return None


def _fake_eval(target: Callable, args: tuple) -> Any:
    vals = [a.meta.get("val") if isinstance(a, Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return target(*vals)


def _erase_dead(graph: torch.fx.Graph, seeds: Iterable[Node]) -> None:
    """Erase the replaced anchors and everything that only fed them.

    Removes pure nodes left without users, `_assert_tensor_metadata` checks of removed values, and
    write-only key buffers (`new_empty` + `copy_` into slices) that nobody reads any more. Unlike
    Graph.eliminate_dead_code it never touches unrelated parts of the graph.
    """
    erased: set[Node] = set()
    work = list(seeds)
    while work:
        node = work.pop()
        if node in erased or node.op in ("placeholder", "output"):
            continue
        if node.target in _ALLOCATIONS and _is_write_only(node):
            slices = list(node.users)
            for sl in slices:
                for cp in list(sl.users):
                    work.extend(cp.all_input_nodes)
                    graph.erase_node(cp)
                    erased.add(cp)
                graph.erase_node(sl)
                erased.add(sl)
        checks = [u for u in node.users if u.target is ASSERT_METADATA]
        if len(node.users) != len(checks) or (node.op == "call_function" and node.is_impure(impure_random=False)):
            continue
        if node.op in ("call_module", "get_attr"):
            continue
        for c in checks:
            graph.erase_node(c)
            erased.add(c)
        work.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _is_write_only(buf: Node) -> bool:
    """All users are slices whose only user is an unused copy_ into that slice."""
    for sl in buf.users:
        if sl.target is not aten.slice.Tensor:
            return False
        for cp in sl.users:
            if cp.target is not aten.copy_.default or cp.args[0] is not sl or cp.users:
                return False
    return True


# --------------------------------------------------------------------------------------------
# Native torch_mla nodes and small helpers
# --------------------------------------------------------------------------------------------


def _native_record(node: Node) -> MLAMatch:
    """Record for a torch_mla node the model called itself (dims from its fake inputs)."""
    layout = source_arg(node, "layout")
    vals = [a.meta.get("val") for a in node.args[:5]]
    if any(v is None for v in vals):
        raise MLAMatchError(f"torch_mla node {node.name} has inputs without shape metadata; export the model first")
    dims, _, _ = infer_dims("torch_mla", *vals, layout=layout)
    scale = source_arg(node, "scale")
    layer, _ = _layer_and_kind(node)
    scale = dims.default_scale() if scale is None else float(scale)
    return MLAMatch(layer, node.name, dims, scale, "native", "torch_mla", ["model calls torch_mla itself"])


def _val(node: Node) -> Any:
    val = node.meta.get("val")
    if val is None:
        raise _Refuse(f"node {node.name} has no shape metadata (meta['val']); run on an exported graph")
    return val


def _dim_eq(a: Any, b: Any) -> bool:
    """Size equality that works for ints and SymInts without adding shape guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)


def _same_shape(a: list, b: list) -> bool:
    return len(a) == len(b) and all(_dim_eq(x, y) for x, y in zip(a, b))



# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


class MatchMLAOptions(PassOptions):
    require_match: bool = Field(True, description="error if the graph has no MLA attention at all")


@register_pass("match_mla", MatchMLAOptions, stage=Stage.PATTERN, requires=("export",), refresh_shapes="missing")
def match_mla_pass(ctx: BuildContext, opts: MatchMLAOptions) -> PassResult:
    assert ctx.gm is not None
    matches = match_mla(ctx.gm)
    sparse = []
    for n in sparse_mla_nodes(ctx.gm):  # exported as DSA source ops already: record them like torch_mla nodes
        n.meta["mla_layer"] = module_path(n)
        n.meta["mla_dims"] = sparse_node_dims(n)
        sparse.append(n.meta["mla_layer"])
    if opts.require_match and not matches and not sparse:
        raise ValueError(
            "match_mla: no MLA attention found in the graph. Supported: DeepseekV2/V3, Kimi-K2, "
            "Moonlight, Glm4MoeLite, MiniCPM3, Mistral4 attention, or models calling torch_mla."
        )
    kinds = sorted({m.kind for m in matches})
    return PassResult(
        f"{len(matches)} attention blocks -> torch_mla ({', '.join(kinds)})"
        + (f"; {len(sparse)} sparse MLA blocks (exported as torch_mla_sparse)" if sparse else ""),
        {"layers": [{"layer": m.layer, "kind": m.kind, "scale": m.scale, "dims": vars(m.dims)} for m in matches],
         "sparse_layers": sparse,
         "skipped": [{"layer": layer, "reason": why} for layer, why in ctx.gm.meta.get("match_mla_skipped", [])]},
    )
