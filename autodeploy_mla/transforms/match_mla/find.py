"""Finding the attention nodes of an exported graph (SDPA or the eager matmul-softmax-matmul chain),
normalised into `_Attention`, and telling MLA attention from plain MHA/GQA."""

from __future__ import annotations

from typing import Any, Optional

from torch.fx import GraphModule, Node

from ...custom_ops.fp8.linear import FP8_LINEAR
from ..fx_utils import aten, module_stack
from ..fx_utils import shape as _shape
from .model import _ALLOCATIONS, _Attention, _FAMILY_BY_CLASS, _MOVEMENT



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
        if n.target in (aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default, FP8_LINEAR):
            found.add(n)
        elif n.target in _MOVEMENT:
            stack.extend(n.all_input_nodes)
        elif n.target in _ALLOCATIONS:
            for user in n.users:
                for w in user.users if user.target is aten.slice.Tensor else ():
                    if w.target is aten.copy_.default:
                        stack.append(w.args[1])
    return found
