"""FX vocabulary the passes share: op sets, node predicates, shapes, module paths, graph tensors,
and fake-tensor shape propagation. One definition each, instead of a private copy per pass."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

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


def _same_val(a: Any, b: Any) -> bool:
    """Whether two fake values describe the same tensor(s): shape, strides, dtype, device."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.device == b.device and [str(x) for x in a.shape] == [str(x) for x in b.shape]
                and [str(x) for x in a.stride()] == [str(x) for x in b.stride()])
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_val(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - symbolic or opaque values: treat as changed
        return False


def refresh_shapes(gm: GraphModule, new_nodes: Optional[set[Node]] = None) -> None:
    """Re-run fake-tensor propagation over the whole graph (new shapes after a rewrite that changed
    weights or shape literals), from the fake inputs export recorded.

    `new_nodes` (the nodes a rewrite added): recompute only those, the nodes left without a value, and
    from them the nodes whose inputs' values came out different (a fused GEMM's slices have the fused
    row stride, so the views after them do too), stopping where a recomputed value equals the old
    one. Equal to a full run (tests/test_refresh_shapes.py) for rewrites that only add nodes and rewire
    uses (no existing node's target or arguments edited in place); on the DeepSeek-V2-Lite graph
    (4104 nodes) it costs milliseconds where the full run costs seconds of symbolic-shape work."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in placeholders(gm)]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise ValueError("the graph has no fake values on its inputs (was it exported?)")

    incremental = new_nodes is not None
    changed: set[Node] = set()

    class _Prop(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            if n.op == "placeholder":
                return n.meta.get("val")
            old = n.meta.get("val")
            if incremental and n.op != "output" and old is not None and n not in new_nodes:
                if not any(a in changed for a in n.all_input_nodes):
                    return old
                out = self._compute(n)
                if _same_val(out, old):
                    return old
                changed.add(n)
            else:
                out = self._compute(n)
                if incremental and n.op != "output":
                    changed.add(n)
            if out is not None and n.op != "output":
                n.meta["val"] = out
            return out

        def _compute(self, n: Node) -> Any:
            if n.op == "get_attr":
                t = self.fetch_attr(n.target)
                return mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
            if n.op == "call_module":
                return None  # export's input guards: nothing to propagate
            with mode:
                return super().run_node(n)

    # The Python dispatcher runs composite ops (linear -> matmul) through their SymInt-aware Python
    # decompositions, as export did; the C++ composites may call numel() on symbolic sizes (seen on
    # CUDA: a new linear whose input strides send matmul down its bmm branch).
    from torch._dispatch.python import enable_python_dispatcher

    with torch.no_grad(), enable_python_dispatcher():
        _Prop(gm).run(*vals)
