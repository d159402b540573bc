"""CUDA-graph capture of one callable with static input/output buffers (used by the piecewise runner).

A `CapturedGraph` remembers, for every positional argument of the callable it captured:
- a *borrowed* tensor: the caller guarantees a stable address (graph inputs: SequenceInfo buffers,
  caches; or another captured graph's static output). On replay the argument must be that very
  tensor (same address, shape, strides, dtype); if it is not, `bind` refuses and the caller runs the
  callable eagerly instead. Borrowed tensors that the runner owns (static outputs of its own graphs)
  may be refreshed by copying into them.
- an *owned* tensor: a buffer the capturer allocated (for values produced fresh each step, e.g. the
  output of an eager attention op); `bind` copies the argument into it.
- a scalar (int/float/bool/None/...): must equal the captured value (sizes derived from the token
  count are constant per bucket), else `bind` refuses.
Outputs are the tensors the capture produced (living in the shared memory pool; they are rewritten
by every replay) plus captured non-tensor values.

All graphs share one memory pool. That is safe because they replay in a fixed order on one stream and
every graph's outputs stay referenced (so no later capture can reuse their memory).

Every captured graph is also tracked weakly, so `release_cuda_graphs()` can free them all before the
NCCL process group is destroyed: a graph that captured an NCCL collective and is still alive makes
`destroy_process_group()` block forever in ncclCommDestroy (pytorch/pytorch#115388; seen here as
2-rank runs that finished their work and then never exited).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

BORROW, BORROW_OWNED, OWNED = 0, 1, 2


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class CaptureError(RuntimeError):
    pass


_LIVE_GRAPHS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track_graph(graph: Any) -> None:
    """Remember a captured graph (weakly) for `release_cuda_graphs`."""
    _LIVE_GRAPHS.add(graph)


def release_cuda_graphs() -> int:
    """Free every captured CUDA graph still alive in this process (`CUDAGraph.reset()`); returns how
    many. Call before tearing down NCCL; a model whose graphs were released cannot replay them."""
    graphs = list(_LIVE_GRAPHS)
    if graphs and torch.cuda.is_available():
        torch.cuda.synchronize()
    for g in graphs:
        g.reset()
    _LIVE_GRAPHS.clear()
    return len(graphs)


class CapturedGraph:
    __slots__ = ("graph", "slots", "scalars", "out_spec", "out_leaves", "out_tensor_idx", "label")

    def __init__(self, graph, slots, scalars, out_spec, out_leaves, label: str) -> None:
        self.graph: torch.cuda.CUDAGraph = graph
        self.slots: list[tuple[int, torch.Tensor, int]] = slots  # (arg index, static tensor, mode)
        self.scalars: list[tuple[int, Any]] = scalars
        self.out_spec = out_spec
        self.out_leaves: list[Any] = out_leaves
        self.label = label

    def bind(self, args: Sequence[Any]) -> bool:
        """Make the static inputs hold `args`; False if that cannot be done (then run eagerly)."""
        for i, v in self.scalars:
            if args[i] != v:
                return False
        for i, st, mode in self.slots:
            a = args[i]
            if not isinstance(a, torch.Tensor):
                return False
            if _same(a, st):
                continue
            if mode == BORROW or a.dtype != st.dtype or a.shape != st.shape or a.device != st.device:
                return False
            st.copy_(a)
        return True

    def replay(self) -> Any:
        self.graph.replay()
        return tree_unflatten(self.out_leaves, self.out_spec)

    def output_tensors(self) -> list[torch.Tensor]:
        return [x for x in self.out_leaves if isinstance(x, torch.Tensor)]


class GraphCapturer:
    """Captures callables into CUDA graphs that share one memory pool and one capture stream."""

    def __init__(self, device: torch.device, warmup: int = 1) -> None:
        self.device = device
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def capture(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        borrow: Sequence[int],
        label: str,
        *,
        owned_ok: Callable[[torch.Tensor], bool] = lambda t: False,
    ) -> CapturedGraph:
        """Capture `fn(*args)`. `borrow`: per-arg mode hint (BORROW for stable graph inputs, anything
        else: borrowed if `owned_ok(tensor)` says it is a static output we own, else copied into an
        owned buffer). Raises CaptureError if capture fails (the caller then runs `fn` eagerly)."""
        static_args = list(args)
        slots: list[tuple[int, torch.Tensor, int]] = []
        scalars: list[tuple[int, Any]] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if borrow[i] == BORROW:
                    slots.append((i, a, BORROW))
                elif owned_ok(a):
                    slots.append((i, a, BORROW_OWNED))
                else:
                    st = a.clone(memory_format=torch.preserve_format)
                    static_args[i] = st
                    slots.append((i, st, OWNED))
            else:
                scalars.append((i, a))
        cur = torch.cuda.current_stream(self.device)
        # Warm up off the capture, on a side stream: first plainly (lazy inits, cuBLAS workspaces,
        # Triton/torch.compile compilation may synchronize), then once more with synchronizing ops
        # made errors. A host sync cannot be captured, and a capture that fails half-way leaves the
        # CUDA RNG generator in capture mode for the rest of the process (seen on the H200: later
        # RNG use raised "Offset increment outside graph capture"), so a callable that syncs in
        # steady state is refused here, before any capture begins.
        prev_mode = torch.cuda.get_sync_debug_mode()
        try:
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                for _ in range(self.warmup):
                    fn(*static_args)
                torch.cuda.set_sync_debug_mode("error")
                fn(*static_args)
        except Exception as exc:  # noqa: BLE001
            torch.cuda.set_sync_debug_mode(prev_mode)
            cur.wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            raise CaptureError(f"{label}: not capturable (warm-up under sync checking failed: "
                               f"{type(exc).__name__}: {exc})") from exc
        finally:
            torch.cuda.set_sync_debug_mode(prev_mode)
        try:
            cur.wait_stream(self.stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = fn(*static_args)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any failure means: not capturable, run eagerly
            torch.cuda.synchronize(self.device)
            raise CaptureError(f"{label}: CUDA-graph capture failed: {type(exc).__name__}: {exc}") from exc
        track_graph(graph)
        leaves, spec = tree_flatten(out)
        return CapturedGraph(graph, slots, scalars, spec, leaves, label)


def cuda_graphs_available(device: torch.device) -> Optional[str]:
    """None if CUDA graphs can be used on `device`, else why not."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None
