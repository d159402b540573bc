"""Compile groups: static pieces that compute the same function of (inputs, weights) share one compiled graph.

A model of L layers splits into ~L+1 static pieces, and most of them are the same graph: a MoE layer's
tail plus the next layer's pre-attention, with only the weights differing (DeepSeek-V2-Lite: 23 of
28). Compiled one by one, each costs its own Dynamo trace, AOTAutograd and Inductor run, and even
Inductor's FX graph cache never hits between them: each piece reads its weights as attributes named
after its layer (`p_model_layers_<i>_...`). So every static piece is put in a *canonical form* first:

- its tensor `get_attr`s (weights, buffers) become trailing positional inputs `w0, w1, ...` in order
  of appearance, after its own inputs `x0, x1, ...`, and every other node is renamed `n0, n1, ...`;
- export's `_assert_tensor_metadata` checks are dropped (Inductor re-checks them against its own
  dtype inference and once refused a valid graph on the H200; they compute nothing).

Pieces whose canonical forms have the same *structural key* form a group; the group compiles one
representative's canonical graph once, and every member calls it with its own weights (a CUDA-graph
capture of a member then records that member's weight addresses, as before). A piece whose body is
the same but which returns only a leading part of the representative's outputs joins too and drops
the rest (the layer before the last does not hand the rotary table on: without this it would be a
group of its own; the extra output is a value the member computes anyway). The key is safe by
construction: it lists, node by node in graph order, the op kind, the target *object* (the same
`OpOverload` / function, compared by identity), and every argument — a reference to an earlier node by
its position, a constant by type and exact value (floats by `float.hex`), an unknown object by its
identity (so it is never shared) — then the output structure, every input's recorded shape and dtype,
and every weight's shape, stride, dtype, device, type, `requires_grad` and 16-byte alignment (Inductor
assumes the alignment it saw at compile time). Two pieces that differ in any op, constant, argument
order, weight shape or dtype land in different groups; a submodule call or a non-tensor attribute
keys by identity, so a piece holding one is a group of its own. Whatever the key does not cover is
guarded by Dynamo at run time (input shapes, strides, dtypes): a mismatch recompiles, it never reuses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Inductor's assumed input alignment (torch._inductor.utils.ALIGNMENT): a weight at another alignment
#: would be copied on every call of a graph compiled for an aligned one.
ALIGN_BYTES = 16
_ASSERT_OPS = (torch.ops.aten._assert_tensor_metadata.default,)


@dataclass(frozen=True)
class CanonicalPiece:
    """A static piece with its weights as explicit inputs: `gm(x0, ..., w0, ...)` computes the piece."""

    gm: torch.fx.GraphModule
    params: tuple[torch.Tensor, ...]  # this piece's w0, w1, ... (its own tensors, not copies)
    num_inputs: int  # the piece's own inputs x0 ... x{n-1}
    key: tuple[Any, ...]  # structural key of everything but the outputs (op targets compared by identity)
    #: the returned values' keys when the piece returns a tuple (prefix-compatible pieces may share), else None
    outputs: Any
    digest: str  # 12 hex digits of the canonical code and weight metadata, for reports

    def input_names(self) -> list[str]:
        return [f"x{i}" for i in range(self.num_inputs)]


@dataclass(frozen=True)
class CompileGroup:
    """Static pieces (by `Piece.index`) that share one compiled graph; the first is the representative."""

    index: int
    pieces: tuple[int, ...]
    digest: str
    #: per member: how many of the representative's outputs it returns (None: all of them)
    keep_outputs: tuple[Any, ...] = ()

    def keep(self, piece: int) -> Any:
        return self.keep_outputs[self.pieces.index(piece)] if self.keep_outputs else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.index, "pieces": list(self.pieces), "digest": self.digest}
        trimmed = {str(p): k for p, k in zip(self.pieces, self.keep_outputs) if k is not None}
        if trimmed:
            out["keeps_first_outputs"] = trimmed
        return out


def _fetch(mod: torch.nn.Module, target: str) -> Any:
    path, _, attr = target.rpartition(".")
    return getattr(mod.get_submodule(path) if path else mod, attr)


def value_key(v: Any, index_of: dict[torch.fx.Node, int]) -> Any:
    """Hashable, exact key of a node argument (see the module docstring)."""
    if isinstance(v, torch.fx.Node):
        return ("node", index_of[v])
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return (type(v).__name__, v)
    if isinstance(v, float):
        return ("float", v.hex())
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(value_key(x, index_of) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((str(k), value_key(x, index_of)) for k, x in v.items()))
    if isinstance(v, slice):
        return ("slice", value_key(v.start, index_of), value_key(v.stop, index_of), value_key(v.step, index_of))
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(v).__name__, str(v))
    return ("object", type(v).__qualname__, id(v))  # unknown constant: never shared


def _meta_key(node: torch.fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return ("tensor", str(tuple(val.shape)), str(val.dtype))
    if isinstance(val, (int, torch.SymInt)):
        return ("int", str(val))
    return ("unknown",)


def weight_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (type(t), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device), bool(t.requires_grad),
            t.data_ptr() % ALIGN_BYTES == 0)


def canonicalize(sub: torch.fx.GraphModule) -> CanonicalPiece:
    """The canonical form of static piece `sub` (module docstring); `sub` itself is not changed."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    lifted = [n for n in sub.graph.nodes if n.op == "get_attr" and isinstance(_fetch(sub, n.target), torch.Tensor)]
    for i, n in enumerate(phs):
        env[n] = graph.placeholder(f"x{i}")
        env[n].meta = dict(n.meta)
    params = []
    for j, n in enumerate(lifted):
        env[n] = graph.placeholder(f"w{j}")
        env[n].meta = dict(n.meta)
        params.append(_fetch(sub, n.target))
    key: list[Any] = [("inputs", tuple(_meta_key(n) for n in phs)),
                      ("weights", tuple(weight_key(t) for t in params))]
    index_of = {n: i for i, n in enumerate([*phs, *lifted])}
    k = 0
    for n in sub.graph.nodes:
        if n.op == "placeholder" or n in index_of:
            continue
        if n.op == "call_function" and n.target in _ASSERT_OPS and not n.users:
            continue
        args = torch.fx.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.map_arg(n.kwargs, lambda a: env[a])
        if n.op == "output":
            graph.output(args[0])
            ret = n.args[0]
            outputs = tuple(value_key(x, index_of) for x in ret) if isinstance(ret, (tuple, list)) else None
            if outputs is None:
                key.append(("output", value_key(ret, index_of)))
            else:
                key.append(("output", type(ret).__name__))
            continue
        target: Any = n.target
        if n.op in ("call_module", "get_attr"):  # a submodule or non-tensor attribute: kept, keyed by identity
            obj = sub.get_submodule(n.target) if n.op == "call_module" else _fetch(sub, n.target)
            name = f"m{k}"
            setattr(root, name, obj)
            target, ident = name, id(obj)
        else:
            ident = target if n.op == "call_function" else str(target)
        new = graph.create_node(n.op, target, args, kwargs, name=f"n{k}")
        new.meta = dict(n.meta)
        env[n] = new
        key.append((n.op, ident, value_key(n.args, index_of), value_key(dict(n.kwargs), index_of)))
        index_of[n] = len(index_of)
        k += 1
    gm = torch.fx.GraphModule(root, graph, "CanonicalPiece")
    weights = ";".join(f"{tuple(t.shape)}/{tuple(t.stride())}/{t.dtype}/{t.data_ptr() % ALIGN_BYTES == 0}"
                       for t in params)
    digest = hashlib.sha256((gm.code + "\n" + weights).encode()).hexdigest()[:12]
    return CanonicalPiece(gm, tuple(params), len(phs), tuple(key), outputs, digest)


def group_pieces(canonical: Sequence[tuple[int, CanonicalPiece]]) -> list[CompileGroup]:
    """Group (piece index, canonical form) pairs: equal structural keys, and outputs equal or a leading
    part of the representative's (the member with the most outputs represents its group). Groups are
    numbered by their first piece."""
    by_key: dict[tuple[Any, ...], list[tuple[int, CanonicalPiece]]] = {}
    for index, cp in canonical:
        by_key.setdefault(cp.key, []).append((index, cp))
    found: list[tuple[int, ...]] = []
    keeps: list[tuple[Any, ...]] = []
    digests: list[str] = []
    for members in by_key.values():
        left = list(members)
        while left:
            rep_index, rep = max(left, key=lambda m: -1 if m[1].outputs is None else len(m[1].outputs))
            joined = [(i, cp) for i, cp in left if cp.outputs == rep.outputs or (
                cp.outputs is not None and rep.outputs is not None and rep.outputs[:len(cp.outputs)] == cp.outputs)]
            left = [m for m in left if m not in joined]
            joined.sort(key=lambda m: (m[0] != rep_index, m[0]))  # the representative first, then in order
            found.append(tuple(i for i, _ in joined))
            keeps.append(tuple(None if cp.outputs == rep.outputs else len(cp.outputs) for _, cp in joined))
            digests.append(rep.digest)
    order = sorted(range(len(found)), key=lambda g: min(found[g]))
    return [CompileGroup(g, found[i], digests[i], keeps[i]) for g, i in enumerate(order)]


__all__ = ["ALIGN_BYTES", "CanonicalPiece", "CompileGroup", "canonicalize", "group_pieces", "value_key", "weight_key"]
