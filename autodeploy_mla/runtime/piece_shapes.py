"""Which inputs of each static piece vary with a step's token count T (and in which dims).

The compiled static pieces should be dynamic in T from their first compile, and static in every other
dim (hidden sizes, heads, experts: Inductor sizes kernels better on constants). Dynamo decides that by
itself only after it has seen two token counts, so it compiles each graph twice (first specialised to
the first count, then dynamic); to compile once, the runner names the token-dependent inputs up front
(`compiled_groups.CompiledGroup`). Guessing them from one call's sizes ("every dim equal to T") is not
exact: DeepSeek-V2-Lite's hidden size is 2048, the largest token bucket too; GLM-4.7-Flash's Dv is 256,
the default top bucket.

So every value crossing pieces is evaluated at two token counts (PROBES), and an input varies with T
iff its two values differ:
- a value whose export metadata (`meta["val"]`, symbolic in T) survived the split is evaluated by
  binding the graph inputs' symbols: the token count to the probe, a symbol that is 1 in the example
  step (the batch dim of the `[1, T]` token inputs) to 1;
- a value without it (an attention op's output: the cache-insertion pass adds its ops without
  metadata) is computed by running the piece that produces it under a `FakeTensorMode`, at each probe,
  from its inputs' values; graph inputs without metadata are the metadata buffers and caches, whose
  shapes do not depend on T (they are taken from the example step's real tensors).
A value neither way can give is reported as unknown; the runner then leaves it to Dynamo's automatic
dynamic shapes (one recompile of that group at the second token count, no error).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

#: The two token counts every value is evaluated at (small: only shapes are computed, on fake tensors).
PROBES = (3, 5)


@dataclass(frozen=True)
class TokenDims:
    """A static piece's inputs that vary with T: (input position, its varying dims) for tensors, the
    positions of varying ints, and the positions whose values could not be derived."""

    tensors: tuple[tuple[int, tuple[int, ...]], ...] = ()
    ints: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": {str(i): list(d) for i, d in self.tensors}, "ints": list(self.ints),
                "unknown": list(self.unknown)}


class _Unknown(Exception):
    pass


def _bind_symbols(top: torch.fx.GraphModule, example: Sequence[Any]) -> tuple[dict[Any, int], set[Any]]:
    """(symbol -> its example value, the symbols that vary with T: example value >= 2) from the graph
    inputs whose metadata is symbolic."""
    values: dict[Any, int] = {}
    phs = [n for n in top.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(phs, example):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor) and val.dim() == arg.dim():
            pairs = list(zip(val.shape, arg.shape))
        elif isinstance(val, torch.SymInt) and isinstance(arg, int):
            pairs = [(val, arg)]
        else:
            continue
        for sym, real in pairs:
            if isinstance(sym, torch.SymInt) and isinstance(sym.node.expr, sympy.Symbol):
                values[sym.node.expr] = int(real)
    return values, {s for s, v in values.items() if v >= 2}


def _concrete(x: Any, binding: dict[Any, int]) -> int:
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        v = sympy.sympify(x.node.expr).xreplace({s: sympy.Integer(n) for s, n in binding.items()})
        if isinstance(v, int) or getattr(v, "is_Integer", False):
            return int(v)
    raise _Unknown(f"{x} has a symbol the graph inputs do not bind")


def _from_meta(val: Any, binding: dict[Any, int], mode: FakeTensorMode) -> Any:
    """A value's metadata at one probe: a fake tensor or an int (raises _Unknown)."""
    if isinstance(val, torch.Tensor):
        shape = [_concrete(s, binding) for s in val.shape]
        stride = [_concrete(s, binding) for s in val.stride()]
        with mode:
            return torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)
    if isinstance(val, (int, torch.SymInt)):
        return _concrete(val, binding)
    raise _Unknown(f"no usable metadata ({type(val).__name__})")


def _piece_outputs(sub: torch.fx.GraphModule, args: list[Any], binding: dict[Any, int], mode: FakeTensorMode) -> Any:
    """A piece's outputs at one probe: from its output nodes' metadata, else by running it on fakes."""
    out_node = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
    try:
        return torch.fx.map_arg(out_node.args[0], lambda n: _from_meta(n.meta.get("val"), binding, mode))
    except _Unknown:
        pass
    if any(a is None for a in args):
        raise _Unknown("an input of the producing piece is unknown")
    with mode:
        return torch.fx.Interpreter(sub).run(*args)


def _evaluate(top: torch.fx.GraphModule, example: Sequence[Any], binding: dict[Any, int],
              static: Mapping[str, int]) -> dict[int, list[Any]]:
    """Every static piece's input values (None: unknown) at one probe binding."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    vals: dict[torch.fx.Node, Any] = {}
    phs = iter(example)
    out: dict[int, list[Any]] = {}

    def get(a: Any) -> Any:
        return vals.get(a) if isinstance(a, torch.fx.Node) else a

    for node in top.graph.nodes:
        try:
            if node.op == "placeholder":
                arg = next(phs)
                val = node.meta.get("val")
                if val is not None:
                    vals[node] = _from_meta(val, binding, mode)
                elif isinstance(arg, torch.Tensor):
                    vals[node] = mode.from_tensor(arg)  # a fixed-size buffer: metadata or a cache
                else:
                    vals[node] = arg
            elif node.op == "call_module":
                args = [get(a) for a in node.args]
                if node.target in static:
                    out[static[node.target]] = args
                vals[node] = _piece_outputs(top.get_submodule(node.target), args, binding, mode)
            elif node.op == "call_function" and node.target is operator.getitem:
                src = get(node.args[0])
                vals[node] = None if src is None else src[node.args[1]]
        except Exception:  # noqa: BLE001 - unknown from here on; its consumers say so
            vals[node] = None
    return out


def static_token_dims(top: torch.fx.GraphModule, static: Mapping[str, int], example: Sequence[Any]
                      ) -> tuple[dict[int, TokenDims], str]:
    """For each static piece (`static`: submodule name -> piece index) of the split module `top`, which
    inputs vary with T, from one example step's graph inputs `example` (module docstring); and a line
    saying how complete that is."""
    values, varying = _bind_symbols(top, example)
    if not varying:
        return {}, "no graph input has a symbolic token dim (no export metadata): Dynamo decides dynamism itself"
    probes = []
    for p in PROBES:
        probes.append(_evaluate(top, example, {s: (p if s in varying else v) for s, v in values.items()}, static))
    dims: dict[int, TokenDims] = {}
    unknown = 0
    for index in static.values():
        a, b = probes[0].get(index), probes[1].get(index)
        if a is None or b is None:
            continue
        tensors, ints, unk = [], [], []
        for pos, (x, y) in enumerate(zip(a, b)):
            if x is None or y is None:
                unk.append(pos)
            elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                changed = tuple(d for d, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n)
                if changed:
                    tensors.append((pos, changed))
            elif isinstance(x, int) and isinstance(y, int) and not isinstance(x, bool) and x != y:
                ints.append(pos)
        unknown += len(unk)
        dims[index] = TokenDims(tuple(tensors), tuple(ints), tuple(unk))
    missing = len(static) - len(dims)
    note = "every static piece input derived" if not unknown and not missing else \
        f"{unknown} static-piece inputs and {missing} pieces not derived (left to Dynamo's automatic dynamic shapes)"
    return dims, note


__all__ = ["PROBES", "TokenDims", "static_token_dims"]
