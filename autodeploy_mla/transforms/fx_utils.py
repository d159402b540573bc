"""FX vocabulary the passes share: op sets, node predicates, shapes, module paths, graph tensors,
and fake-tensor shape propagation. One definition each, instead of a private copy per pass."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from ..models.checkpoint import module_tensor, set_module_tensor  # noqa: F401  (re-exported)

aten = torch.ops.aten
TORCH_MLA = torch.ops.autodeploy.torch_mla.default
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
#: export's `_assert_tensor_metadata` checks (no-ops when run; never data users)
ASSERT_METADATA = aten._assert_tensor_metadata.default
#: ops that change only dtype/layout/identity, never values' meaning
CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.contiguous.default,
                   aten.clone.default, aten.alias.default, aten.detach.default})


def grouped_mm_ops() -> set[Any]:
    """The grouped-GEMM ops an exported HF experts forward may contain: aten's, and transformers'
    CPU fallback op (fp32 MoE on CPU; registered once transformers has loaded its MoE module)."""
    ops: set[Any] = {aten._grouped_mm.default}
    try:
        ops.add(torch.ops.transformers.grouped_mm_fallback.default)
    except (AttributeError, RuntimeError):
        pass
    return ops


def is_op(node: Any, targets: Iterable[Any]) -> bool:
    """`node` is a call_function node whose target is one of `targets`."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def skip(node: Any, targets: Iterable[Any]) -> Any:
    """Follow first arguments back through ops in `targets` (casts, views, ...)."""
    targets = set(targets)
    while is_op(node, targets):
        node = node.args[0]
    return node


def val(node: Any) -> Any:
    """The fake value export recorded for `node` (None for non-nodes or nodes without one)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node: Any) -> tuple[Any, ...]:
    """The recorded shape of `node`, () when it has none (ints, or SymInts for dynamic dims)."""
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def module_stack(node: Node) -> list[tuple[str, Any]]:
    """(module path, module class) from the root to the innermost module that produced `node`.

    export_model makes the paths the model's own module names ("model.layers.3.self_attn")."""
    return [(p, c) for p, c in (node.meta.get("nn_module_stack") or {}).values()]


def module_path(node: Node) -> str:
    """The innermost module path that produced `node` (the node's name when computed at the root)."""
    stack = module_stack(node)
    return (stack[-1][0] or node.name) if stack else node.name


def placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def erase_dead_region(graph: torch.fx.Graph, region: set[Node]) -> None:
    """Erase the nodes of `region` that nothing outside the region uses any more (with their
    `_assert_tensor_metadata` checks), from the outputs back: a worklist over the region only, not
    passes over the whole graph. Region nodes still in use stay; `region` loses the erased ones."""
    def dead(n: Node) -> bool:
        return all(is_op(u, {ASSERT_METADATA}) for u in n.users)

    work = [n for n in region if dead(n)]
    while work:
        n = work.pop()
        if n not in region or not dead(n):
            continue
        for u in list(n.users):  # its metadata checks (which may be region members themselves)
            graph.erase_node(u)
            region.discard(u)
        inputs = n.all_input_nodes
        graph.erase_node(n)
        region.discard(n)
        work.extend(a for a in inputs if a in region)


def refresh_shapes(gm: GraphModule) -> None:
    """Re-run fake-tensor propagation over the whole graph (new shapes after a rewrite that changed
    weights or shape literals), from the fake inputs export recorded."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in placeholders(gm)]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise ValueError("the graph has no fake values on its inputs (was it exported?)")

    class _Prop(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            if n.op == "placeholder":
                return n.meta.get("val")
            if n.op == "get_attr":
                t = self.fetch_attr(n.target)
                out = mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
            elif n.op == "call_module":
                out = None  # export's input guards: nothing to propagate
            else:
                with mode:
                    out = super().run_node(n)
            if out is not None and n.op != "output":
                n.meta["val"] = out
            return out

    # The Python dispatcher runs composite ops (linear -> matmul) through their SymInt-aware Python
    # decompositions, as export did; the C++ composites may call numel() on symbolic sizes (seen on
    # CUDA: a new linear whose input strides send matmul down its bmm branch).
    from torch._dispatch.python import enable_python_dispatcher

    with torch.no_grad(), enable_python_dispatcher():
        _Prop(gm).run(*vals)
