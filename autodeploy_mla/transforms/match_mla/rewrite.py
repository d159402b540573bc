"""Rewriting a planned block into one torch_mla node, erasing what it leaves dead, and the records of
the torch_mla nodes a model already calls natively; plus the small FX value helpers."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from ...custom_ops.attention.mla_dims import infer_dims
from ...custom_ops.attention.torch_mla import source_arg
from ..fp8_graph import insert_dequantize
from ..fx_utils import ASSERT_METADATA, RESHAPES, TORCH_MLA, aten
from ..fx_utils import shape as _shape
from .find import _layer_and_kind
from .model import MLAMatch, MLAMatchError, _ALLOCATIONS, _Plan, _Refuse



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
        weight = plan.weight
        if plan.kv_b_fp8 is not None:  # weight absorption needs 16 bits: folded into a parameter once loaded
            weight = insert_dequantize(graph, plan.kv_b_fp8, _val(latent).dtype)
            for key in ("nn_module_stack", "stack_trace"):
                if key in anchor.meta:
                    weight.meta[key] = anchor.meta[key]
        mla = add(TORCH_MLA, q_nope, q_pe, latent, kpe, weight, True, plan.scale)
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
