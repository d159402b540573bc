"""Launching compiled Triton kernels without `JITFunction.run` on every call (the lean eager path).

`kernel[grid](*args, **constexprs)` binds and specialises every argument, hashes a cache key and
builds launch metadata on each call: measured on the H200 host at ~10-25 us per launch for this
backend's 20-30-argument kernels (docs/benchmarks/op_host_cost.md), several times per layer. A
`BoundKernel` is one kernel with its constexprs and launch options fixed (one per launch config of
a step); it keeps the `CompiledKernel` that the first JIT launch of each *specialisation* returned
and calls its launcher directly afterwards.

The specialisation key is computed here, and it is at least as fine as Triton's own: per tensor its
dtype and whether its address is 16-byte aligned, per int whether it is 1, a multiple of 16 and
fits 32 bits, per tensor descriptor its block shape and dtype (the op builds descriptors only
on 16-byte aligned buffers), per other value its type
(and the value for bools and None). Two calls with equal keys therefore run the same compiled
kernel Triton would have picked; a finer key only costs an extra JIT launch, never a wrong kernel.

The JIT path stays in use where the direct call cannot be made safely: the interpreter
(TRITON_INTERPRET=1), a CPU tensor, a profiler's launch hooks being set (they need the launch
metadata the JIT path builds), or a Triton whose compiled kernels lack the launcher API.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

try:  # the op module imports without triton (its check() then refuses every node)
    import triton
except ImportError:  # pragma: no cover
    triton = None

from ..triton_helpers import interpreting

_ALIGN = 16


def _spec(v: Any) -> Any:
    """The part of one runtime argument that Triton may specialise a compiled kernel on."""
    if type(v) is torch.Tensor or isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % _ALIGN == 0)
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return (v == 1, v % 16 == 0, -(2 ** 31) <= v < 2 ** 31)
    if isinstance(v, float):
        return float
    base = getattr(v, "base", None)
    if isinstance(base, torch.Tensor):  # a host TensorDescriptor: TMA needs 16-byte aligned bases and strides
        return ("desc", tuple(v.block_shape), base.dtype)
    return type(v)


def _spec_unspecialised(v: Any) -> Any:
    """`_spec` of a `do_not_specialize` parameter: Triton keeps only an int's width (i32 or i64)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return ("int", -(2 ** 31) <= v < 2 ** 31)
    return _spec(v)


def _launch_hooks_active() -> bool:
    """Whether a profiler set Triton's launch enter/exit hooks (they need the JIT path's launch
    metadata). Triton >= 3.5 keeps them as a `HookChain` that is empty by default; older versions
    as None or a plain callable."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        h = getattr(rt, name, None)
        if h is None:
            continue
        calls = getattr(h, "calls", None)
        if calls is None or calls:
            return True
    return False


class BoundKernel:
    """`fn` with fixed constexprs and options: `launch(grid, ptrs, scalars)` ==
    `fn[grid](*ptrs, *scalars, **constexprs)`.

    `ptrs` are the kernel's leading tensor (or tensor-descriptor, or None) parameters and `scalars`
    the runtime parameters after them, in signature order (constexprs are not repeated). The
    scalars' specialisation is computed once per distinct tuple (a step's layers repeat it), the
    pointers' on every call (their alignment is what changes). Not thread safe: one per backend
    session (sessions are per model and stepped by one thread)."""

    __slots__ = ("fn", "constexprs", "_tail", "_compiled", "_scalar_keys", "_nospec", "direct", "jit_launches",
                 "direct_launches", "why_jit")

    #: distinct scalar tuples remembered (a step's layers share one; bases change between steps)
    MAX_SCALAR_KEYS = 256

    def __init__(self, fn: Any, constexprs: Mapping[str, Any]) -> None:
        self.fn = fn
        self.constexprs = dict(constexprs)
        params = list(getattr(fn, "params", ()))
        # The launcher takes every parameter in signature order, constexprs included (it skips them):
        # the runtime ones come first in these kernels, so a call appends the constexprs' values.
        n_runtime = sum(not getattr(p, "is_constexpr", True) for p in params)
        prefix_ok = all(not getattr(p, "is_constexpr", True) for p in params[:n_runtime])
        self._tail: Optional[tuple[Any, ...]] = None
        #: why launches go through the JIT launcher ("" while direct launches are possible)
        self.why_jit = ""
        if interpreting():
            self.why_jit = "interpreter"
        elif not params or not prefix_ok:
            self.why_jit = "runtime parameters are not the signature's prefix"
        else:
            try:
                self._tail = tuple(self.constexprs[p.name] if p.name in self.constexprs else _default(p)
                                   for p in params[n_runtime:])
            except KeyError as e:
                self.why_jit = f"no value for constexpr {e}"  # stay on the JIT path
        self._compiled: dict[tuple, Any] = {}
        self._scalar_keys: dict[tuple, tuple] = {}
        #: per runtime parameter, whether the kernel declared it `do_not_specialize` (the key then
        #: ignores its divisibility too, so a per-step base does not send launches down the JIT path)
        self._nospec = tuple(bool(getattr(p, "do_not_specialize", False)) for p in params[:n_runtime])
        self.direct = self._tail is not None
        self.jit_launches = 0
        self.direct_launches = 0

    def launch(self, grid: Sequence[int], ptrs: Sequence[Any], scalars: Sequence[Any]) -> None:
        if not self.direct:
            self.fn[tuple(grid)](*ptrs, *scalars, **self.constexprs)
            self.jit_launches += 1
            return
        skey = self._scalar_keys.get(scalars)
        if skey is None:
            if len(self._scalar_keys) >= self.MAX_SCALAR_KEYS:
                self._scalar_keys.clear()
            flags = self._nospec[len(ptrs):]
            skey = self._scalar_keys[scalars] = tuple(
                _spec_unspecialised(v) if i < len(flags) and flags[i] else _spec(v) for i, v in enumerate(scalars))
        key = (tuple(map(_spec, ptrs)), skey)
        ck = self._compiled.get(key)
        if ck is not None:
            if not _launch_hooks_active():
                stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
                ck.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                       ck.function, ck.packed_metadata, None, None, None, *ptrs, *scalars, *self._tail)
                self.direct_launches += 1
                return
        ck = self.fn[tuple(grid)](*ptrs, *scalars, **self.constexprs)
        self.jit_launches += 1
        missing = [a for a in ("run", "function", "packed_metadata") if not hasattr(ck, a)]
        if missing:
            self.why_jit = f"compiled kernel {type(ck).__name__} lacks {missing}"
        elif _on_cuda(ptrs):
            self._compiled[key] = ck

    def warmup(self, ptrs: Sequence[Any], scalars: Sequence[Any]) -> None:
        """Compile (and load) the kernel for these arguments' specialisation without launching it."""
        self.fn.warmup(*ptrs, *scalars, grid=(1,), **self.constexprs).run  # noqa: B018 - loads the module


def _default(p: Any) -> Any:
    d = getattr(p, "default", inspect.Parameter.empty)
    if d is inspect.Parameter.empty:
        raise KeyError(p.name)
    return d


def _on_cuda(ptrs: Sequence[Any]) -> bool:
    for a in ptrs:
        if isinstance(a, torch.Tensor):
            return a.device.type == "cuda"
    return False


class LaunchCache:
    """A session's `BoundKernel`s, one per (kernel, constexprs): what a step's layers share."""

    def __init__(self) -> None:
        self._bound: dict[tuple, BoundKernel] = {}

    def get(self, fn: Any, constexprs: Mapping[str, Any]) -> BoundKernel:
        key = (fn, frozenset(constexprs.items()))
        bk = self._bound.get(key)
        if bk is None:
            bk = self._bound[key] = BoundKernel(fn, constexprs)
        return bk

    def stats(self) -> dict[str, int]:
        return {"bound_kernels": len(self._bound),
                "jit_launches": sum(b.jit_launches for b in self._bound.values()),
                "direct_launches": sum(b.direct_launches for b in self._bound.values())}
