"""FX vocabulary for FP8 weights shared by the passes: the source ops, their parts, and folding
weight dequantization into a parameter once the weights are real.

`fp8_block_linear(x, weight, weight_scale_inv, bias, block_n, block_k)` nodes are linears to the
passes; `fp8_block_dequantize(weight, scale_inv, block_n, block_k, dtype)` of two parameters is a
16-bit weight that only exists because a consumer needs one (MLA weight absorption takes the
16-bit kv_b_proj): `fold_dequantize` computes it once, when the FP8 weights are real (after
loading), and the graph reads the result as a parameter — the one 16-bit copy of an FP8 weight the
compiled model holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from ..custom_ops.fp8.linear import FP8_DEQUANTIZE, FP8_LINEAR
from ..models.skeleton import is_placeholder
from .fx_utils import is_op, module_tensor

#: suffix of the parameter a folded dequantization is stored as (next to the FP8 weight)
DEQUANTIZED_SUFFIX = "_dequantized"
#: node.meta key of dequantize nodes a pass inserted to be folded (the FP8 experts' own dequantize
#: nodes are per-step reference math, never folded: that would hold the experts in 16 bits)
FOLD = "fp8_fold"


@dataclass(frozen=True)
class FP8LinearParts:
    """The arguments of one fp8_block_linear node."""

    x: Any
    weight: Any
    scale: Any
    bias: Any
    block_n: int
    block_k: int


def fp8_linear_parts(node: Node) -> FP8LinearParts:
    """The arguments of an fp8_block_linear node, positional or keyword."""
    names = ("x", "weight", "weight_scale_inv", "bias", "block_n", "block_k")
    vals = [node.args[i] if i < len(node.args) else node.kwargs.get(n) for i, n in enumerate(names)]
    return FP8LinearParts(*vals)


def is_fp8_linear(node: Any) -> bool:
    return is_op(node, {FP8_LINEAR})


def insert_dequantize(graph: torch.fx.Graph, parts: FP8LinearParts, dtype: torch.dtype) -> Node:
    """A dequantize node of an FP8 linear's weight (inserted at the graph's current point), marked
    to be folded into a parameter (`fold_dequantize`)."""
    node = graph.call_function(FP8_DEQUANTIZE, (parts.weight, parts.scale, parts.block_n, parts.block_k, dtype))
    node.meta[FOLD] = True
    w = parts.weight.meta.get("val") if isinstance(parts.weight, Node) else None
    if w is not None:
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode([w])
        if mode is not None:
            with mode:
                node.meta["val"] = torch.empty(tuple(w.shape), dtype=dtype, device=w.device)
    return node


def fold_dequantize(gm: GraphModule) -> list[str]:
    """Replace every dequantize marked for folding (`insert_dequantize`) of two real parameters by a
    parameter holding its result (computed once); placeholders (a skeleton before load_weights) are
    left for later. Returns the new parameters' names."""
    done = []
    for node in list(gm.graph.nodes):
        if not is_op(node, {FP8_DEQUANTIZE}) or not node.meta.get(FOLD):
            continue
        w, s = node.args[0], node.args[1]
        if not all(isinstance(a, Node) and a.op == "get_attr" for a in (w, s)):
            continue
        wt, st = module_tensor(gm, str(w.target)), module_tensor(gm, str(s.target))
        if is_placeholder(wt) or is_placeholder(st):
            continue
        value = FP8_DEQUANTIZE(wt, st, *node.args[2:])
        parent, _, attr = str(w.target).rpartition(".")
        owner = gm.get_submodule(parent) if parent else gm
        name = attr + DEQUANTIZED_SUFFIX
        owner.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
        target = f"{parent}.{name}" if parent else name
        with gm.graph.inserting_before(node):
            new = gm.graph.get_attr(target)
        new.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for a in (w, s):
            if not a.users:
                gm.graph.erase_node(a)
        done.append(target)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def fp8_weight_source(node: Any) -> Optional[tuple[Node, Node, int, int]]:
    """(fp8 weight, scale, block_n, block_k) when `node` is a dequantize of an FP8 weight."""
    if not is_op(node, {FP8_DEQUANTIZE}):
        return None
    return node.args[0], node.args[1], int(node.args[2]), int(node.args[3])


__all__ = ["DEQUANTIZED_SUFFIX", "FOLD", "FP8_DEQUANTIZE", "FP8_LINEAR", "FP8LinearParts", "fold_dequantize",
           "fp8_linear_parts", "fp8_weight_source", "insert_dequantize", "is_fp8_linear"]
