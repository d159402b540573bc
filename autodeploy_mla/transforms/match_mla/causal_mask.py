"""Proving that the mask a rewrite drops is the plain causal mask: it may depend on position_ids only,
and its subgraph, evaluated at probe sizes, must equal the lower-triangular mask."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from ..fx_utils import aten
from ..fx_utils import shape as _shape
from .model import _Attention, _MASK_PROBES, _Refuse
from .rewrite import _val



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
