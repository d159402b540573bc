"""Runs a piecewise-split graph (transforms/piecewise.py): static pieces eager, torch.compile'd, or
replayed from CUDA graphs per token-count bucket; dynamic (attention) ops eagerly in between.

Per step (`runner(input_ids, position_ids, *metadata, *caches)`), with T = input_ids.shape[1]:
1. decode-only step padded to a bucket with dummy decode sequences (T == num_decode_seqs), CUDA
   graphs on, and every dynamic op decode_graph_safe: replay one whole-graph CUDA graph for T;
2. else T is a bucket: each static piece replays its CUDA graph for T; dynamic pieces run eagerly,
   reading the static output buffers of the piece before them; their fresh outputs are copied into
   the static input buffers of the piece after them;
3. else (unseen size, or no CUDA): every piece runs eagerly (compiled if configured). Correct for
   any size; only slower.
Graphs are captured lazily, the first time a bucket is met, on that step's real inputs (warm-up run,
capture, replay: static pieces are pure and cache appends idempotent, so running them twice is
harmless). A piece or a decode graph whose capture fails runs eagerly from then on; the reason is
kept in `runner.failures`. Host-side `prepare` hooks (FlashInfer plan) run in forward_step before
the runner, never inside a capture.

With CUDA graphs on, the runner sets `seq_info.token_buckets`, so `SequenceInfo.prepare_step` pads
every step up to the next bucket (decode-only steps with dummy sequences on the scratch page).

The returned logits of a replayed step live in a static buffer that the next replay of that bucket
overwrites: consume (or copy) them before the next step, as the engine does.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from .cuda_graphs import BORROW, OWNED, CaptureError, GraphCapturer, cuda_graphs_available, tensor_key

if TYPE_CHECKING:
    from ..transforms.piecewise import SplitGraph
    from .sequence_info import SequenceInfo


class _StaticPiece(nn.Module):
    """A static piece: eager/compiled callable, plus one CUDA graph per bucket once captured."""

    def __init__(self, runner: "PiecewiseRunner", index: int, name: str, fn: nn.Module, sources: list[str],
                 capturable: Optional[str]) -> None:
        super().__init__()
        self.fn = fn
        self.index, self.piece_name = index, name
        self._runner = [runner]  # a list: keep the runner out of nn.Module child registration
        self.modes = [BORROW if s == "input" else OWNED for s in sources]
        self.graphs: dict[int, Any] = {}
        self.not_capturable = capturable  # reason, or None

    def forward(self, *args: Any) -> Any:
        r = self._runner[0]
        key = r._bucket
        if key is None:
            return self.fn(*args)
        cap = self.graphs.get(key)
        if cap is None:
            if key in self.graphs or self.not_capturable:
                return self.fn(*args)
            cap = r._capture_piece(self, key, args)
            self.graphs[key] = cap
            if cap is None:
                return self.fn(*args)
        if not cap.bind(args):
            r.stats["piece_eager_fallback"] += 1
            return self.fn(*args)
        return cap.replay()


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    return copy.deepcopy(gm.graph)


class PiecewiseRunner:
    def __init__(
        self,
        split: "SplitGraph",
        seq_info: "SequenceInfo",
        *,
        compile: str = "none",
        cuda_graphs: bool = True,
        buckets: Optional[list[int]] = None,
        decode_graph: bool = True,
        report: Optional[list[dict]] = None,
    ) -> None:
        from ..transforms.piecewise import STATIC

        self.split = split
        self.seq_info = seq_info
        self.device = torch.device(seq_info.device)
        self.compile = compile
        self.report = report if report is not None else [p.to_dict() for p in split.pieces]
        why_not = cuda_graphs_available(self.device) if cuda_graphs else "cuda_graphs: false"
        self.graphs_off_reason = why_not
        self.use_graphs = why_not is None
        self.buckets: list[int] = sorted({b for b in (buckets or []) if 1 <= b <= seq_info.max_num_tokens})
        self._bucket_set = frozenset(self.buckets) if self.use_graphs else frozenset()
        self.decode_graph = bool(decode_graph and split.decode_graph_safe and self.use_graphs)
        self.stats: Counter[str] = Counter()
        self.failures: dict[str, str] = {}
        self._bucket: Optional[int] = None
        self._static_outputs: dict[int, set[tuple]] = {}
        self._decode_graphs: dict[int, Any] = {}
        self._capturer = GraphCapturer(self.device) if self.use_graphs else None

        top = split.module
        eager_attrs: dict[str, Any] = {}
        graph_attrs: dict[str, Any] = {}
        self.static_pieces: list[_StaticPiece] = []
        for piece in split.pieces:
            sub = top.get_submodule(piece.name)
            fn: nn.Module = sub
            if piece.kind == STATIC and compile != "none":
                fn = torch.compile(_without_asserts(sub), backend=compile, fullgraph=True, dynamic=None)
            eager_attrs[piece.name] = fn
            if piece.kind == STATIC:
                why = _mutation_reason(sub)
                sp = _StaticPiece(self, piece.index, piece.name, fn, piece.arg_sources, why)
                if why and piece.index < len(self.report):
                    self.report[piece.index]["not_capturable"] = why
                self.static_pieces.append(sp)
                graph_attrs[piece.name] = sp
            else:
                graph_attrs[piece.name] = fn
        for node in top.graph.nodes:  # leftover top-level attributes (normally none)
            if node.op == "get_attr":
                val = top
                for part in node.target.split("."):
                    val = getattr(val, part)
                eager_attrs[node.target] = graph_attrs[node.target] = val
        self.eager_module = torch.fx.GraphModule(eager_attrs, _copy_graph(top), "PiecewiseEager")
        self.graph_module = torch.fx.GraphModule(graph_attrs, _copy_graph(top), "PiecewiseGraphs")
        if self.use_graphs:
            seq_info.token_buckets = tuple(self.buckets)

    # ------------------------------------------------------------------ stepping
    def __call__(self, *args: Any) -> Any:
        if not self.use_graphs:
            self.stats["eager"] += 1
            return self.eager_module(*args)
        t = int(args[0].shape[-1])
        if t not in self._bucket_set:
            self.stats["eager"] += 1
            return self.eager_module(*args)
        info = self.seq_info
        if (self.decode_graph and info.num_prefill_seqs == 0 and info.num_decode_seqs == t
                and info.num_padded_tokens == t):
            out = self._run_decode_graph(t, args)
            if out is not None:
                self.stats["decode_graph"] += 1
                return out
        self._bucket = t
        try:
            out = self.graph_module(*args)
        finally:
            self._bucket = None
        self.stats["piecewise"] += 1
        return out

    __call__.__doc__ = "Run one step: (input_ids [1,T], position_ids [1,T], *metadata, *caches) -> outputs."

    # ------------------------------------------------------------------ capture
    def _run_decode_graph(self, t: int, args: tuple) -> Optional[Any]:
        cap = self._decode_graphs.get(t)
        if cap is None:
            if t in self._decode_graphs:
                return None  # capture failed before
            label = f"decode graph (batch {t})"
            try:
                cap = self._capturer.capture(self.eager_module, args, [BORROW] * len(args), label)
            except CaptureError as exc:
                self.failures[label] = str(exc)
                self._decode_graphs[t] = None
                return None
            self._decode_graphs[t] = cap
            for entry in self.report:
                entry["captured"]["decode_graph"].append(t)
        if not cap.bind(args):
            self.stats["decode_graph_bind_miss"] += 1
            return None
        return cap.replay()

    def _capture_piece(self, piece: _StaticPiece, t: int, args: tuple) -> Optional[Any]:
        label = f"piece {piece.index} ({piece.piece_name}, {t} tokens)"
        owned = self._static_outputs.setdefault(t, set())
        try:
            cap = self._capturer.capture(piece.fn, args, piece.modes, label,
                                         owned_ok=lambda x: tensor_key(x) in owned)
        except CaptureError as exc:
            self.failures[label] = str(exc)
            return None
        owned.update(tensor_key(x) for x in cap.output_tensors())
        self.report[piece.index]["captured"]["piecewise"].append(t)
        return cap

    # ------------------------------------------------------------------ introspection
    def captured(self) -> dict[str, list[int]]:
        return {
            "piecewise": sorted({t for sp in self.static_pieces for t, c in sp.graphs.items() if c is not None}),
            "decode_graph": sorted(t for t, c in self._decode_graphs.items() if c is not None),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "pieces": len(self.split.pieces),
            "cuda_graphs": self.use_graphs,
            "cuda_graphs_off_reason": self.graphs_off_reason,
            "buckets": self.buckets,
            "decode_graph": self.decode_graph,
            "decode_graph_reason": self.split.decode_graph_reason,
            "captured": self.captured(),
            "stats": dict(self.stats),
            "failures": dict(self.failures),
        }


_ASSERT_OPS = (torch.ops.aten._assert_tensor_metadata.default,)


def _without_asserts(sub: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `sub` (sharing its parameters) without export's `_assert_tensor_metadata` checks.

    They are no-ops when run eagerly, but inductor re-checks them against its own dtype inference:
    on the H200 (transformers 5.17 DeepseekV3, bf16) one such node asserted float32 on an int64 view
    and stopped compilation. Dropping checks changes no result."""
    graph = copy.deepcopy(sub.graph)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _ASSERT_OPS]:
        if not node.users:
            graph.erase_node(node)
    return torch.fx.GraphModule(sub, graph, sub.__class__.__name__)


def _mutation_reason(sub: torch.fx.GraphModule) -> Optional[str]:
    """Why `sub` cannot be captured with copied inputs: it writes into one of its inputs in place."""
    phs = {n for n in sub.graph.nodes if n.op == "placeholder"}
    for n in sub.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            base = _alias_base(v)
            if base in phs:
                return f"{n.name} ({n.target}) writes into input {base.name} in place"
    return None


def _alias_base(v: Any) -> Any:
    """Follow view ops (outputs that alias an input) back to the tensor they view."""
    seen = 0
    while isinstance(v, torch.fx.Node) and v.op == "call_function" and seen < 64:
        schema = getattr(v.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        if not v.args:
            break
        v, seen = v.args[0], seen + 1
    return v
