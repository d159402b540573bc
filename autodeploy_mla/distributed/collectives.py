"""Collectives as the sharded graph and the runtime use them.

In the graph: torch's functional collectives, `_c10d_functional.all_reduce(x, "sum", group)`
followed by `_c10d_functional.wait_tensor`. They are ordinary ATen-style ops with fake/meta
kernels, so the FX graph keeps shape propagation, prints and recompiles like any other, runs under
gloo on CPU and NCCL on GPU, and NCCL's version can be captured in a CUDA graph. The group is
referred to by name (the default group's is "0"), so the graph holds no Python object.

At runtime: `rank0_logits_step` is the safety net that makes every rank sample from rank 0's
logits rows (see docs/tensor_parallel.md, "sampling").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
COLLECTIVE_OPS = frozenset({ALL_REDUCE, WAIT_TENSOR})


def insert_all_reduce(graph: torch.fx.Graph, node: torch.fx.Node, group_name: str) -> torch.fx.Node:
    """Insert `wait_tensor(all_reduce(node, "sum", group_name))` right after `node`; returns the wait node.

    The caller rewires the users it wants reduced; meta is copied from `node` (same shape/dtype).
    """
    with graph.inserting_after(node):
        ar = graph.call_function(ALL_REDUCE, (node, "sum", group_name))
    with graph.inserting_after(ar):
        wt = graph.call_function(WAIT_TENSOR, (ar,))
    for new in (ar, wt):
        for key in ("nn_module_stack", "stack_trace", "val"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        new.meta["tp_collective"] = "all_reduce"
    return wt


def count_all_reduces(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is ALL_REDUCE)


def rank0_logits_step(step_fn: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """Wrap an engine step function (SequenceInfo -> next-token logits [num_seqs, V]) so that
    every rank samples from rank 0's rows."""

    def step(info: Any) -> torch.Tensor:
        rows = step_fn(info).contiguous()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            with torch.inference_mode():
                dist.broadcast(rows, src=0)
        return rows

    return step
