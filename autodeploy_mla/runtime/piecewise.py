"""Runs a piecewise-split graph: static pieces eager, torch.compile'd, or replayed from CUDA graphs
per token-count bucket; dynamic (attention) ops eagerly in between.

The split itself (which nodes go in which piece) is the `piecewise` pass (transforms/piecewise.py);
it hands over a `SplitGraph` (defined here, the runtime's side of the contract) and `RunnerOptions`.

Per step (`runner(step, input_ids, position_ids, *metadata, *caches)` with T = input_ids.shape[1]
and `step` the model runner's StepDescriptor, whose `mode` and `bucket` the model runner decided
once, `model_runner.step_descriptor`):
1. "decode_graph" (a decode-only step padded to a bucket with dummy decode sequences, CUDA graphs
   on, every dynamic op decode_graph_safe): replay one whole-graph CUDA graph for T;
2. "mixed_graph" (a step marked `static_bounds`: T a bucket <= mixed_graph_max_tokens, every
   dynamic op mixed_graph_safe): replay the whole-graph *mixed* CUDA graph of T, captured on one
   batch of T tokens and valid for any other (its ops size launches from static bounds only), so
   prefill and mixed steps pay no per-layer host work;
3. "piecewise" (any other step of a bucket, or a whole graph whose capture failed): each static
   piece replays its CUDA graph for T (the graph module of bucket T binds its pieces to T:
   `_PieceAt`); dynamic pieces run eagerly, reading the static output buffers of the piece before
   them; their fresh outputs are copied into the static input buffers of the piece after them;
4. "eager" (unseen size, or no CUDA): every piece runs eagerly (compiled if configured). Correct
   for any size; only slower.
Static pieces that compute the same function of (inputs, weights) share one compiled graph: the
runner compiles one callable per *compile group* (runtime/piece_groups.py: canonical forms and their
structural key; runtime/compiled_groups.py: the compiled callable, dynamic in the token count from
its first compile), and each piece calls its group's with its own weights.

Graphs are captured lazily, the first time a bucket is met, on that step's real inputs (warm-up run,
capture, replay: static pieces are pure and cache appends idempotent, so running them twice is
harmless), or ahead of time by `ModelRunner.warmup()`. A piece or a decode graph whose capture fails
runs eagerly from then on; the reason is kept in `runner.failures`. Host-side session `prepare`
hooks (FlashInfer plan) run before the runner, never inside a capture.

Which token counts are buckets, and how a step is padded to one, is decided here too
(`resolve_buckets`, `bucket_for`); `ModelRunner` asks before it builds each step's metadata.

The returned logits of a replayed step live in a static buffer that the next replay of that bucket
overwrites: consume (or copy) them before the next step, as the engine does.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..custom_ops.attention.registry import StepDescriptor, direct_calls
from .compiled_groups import CompiledGroup, GroupMember
from .cuda_graphs import BORROW, OWNED, CaptureError, GraphCapturer, cuda_graphs_available, tensor_key
from .piece_groups import CanonicalPiece, CompileGroup, canonicalize, group_pieces
from .piece_shapes import static_token_dims

STATIC, DYNAMIC = "static", "dynamic"
#: Token buckets of `buckets: auto`: powers of two up to this (and max_num_tokens), plus max_batch_size.
#: Up to 2048 so that prefill chunks of that size replay too: run eagerly, a 2048-token step of the
#: DeepSeek-V2-Lite config spent ~15 ms of its ~55 ms launching ~2600 kernels (H200,
#: benchmarks/e2e/e2e_profile.py); the graphs of the larger buckets cost capture time and pool memory
#: for their activations only.
AUTO_BUCKET_LIMIT = 2048
#: Default largest token bucket replayed as a whole-graph mixed graph (when every dynamic op is
#: mixed_graph_safe). Above it, steps run piecewise with eager attention: their attention runs
#: absorbed on static bounds inside a mixed graph, while eager steps pick expansion for long prefill.
MIXED_GRAPH_MAX_TOKENS = 256


# ----------------------------------------------------------------------------- the split graph
@dataclass
class Piece:
    index: int
    name: str  # submodule name in SplitGraph.module
    kind: str  # "static" | "dynamic"
    nodes: int  # graph nodes in the piece (call nodes of the flat graph)
    ops: list[str] = field(default_factory=list)  # dynamic: the split-point op(s)
    backends: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    #: per argument of the submodule call: "input" (graph input or parameter), "static", "dynamic"
    arg_sources: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "kind": self.kind,
            "nodes": self.nodes,
            "ops": list(self.ops),
            "backends": list(self.backends),
            "layers": list(self.layers),
            "inputs": len(self.arg_sources),
            # Filled by the runner as it captures: token buckets (piecewise), decode batch sizes and
            # mixed-step token counts (whole-graph graphs, which contain every piece).
            "captured": {"piecewise": [], "decode_graph": [], "mixed_graph": []},
        }


@dataclass
class SplitGraph:
    source: torch.fx.GraphModule  # the flat graph that was split
    module: torch.fx.GraphModule  # top level: calls submod_<i> in topological order
    pieces: list[Piece]
    decode_graph_safe: bool
    decode_graph_reason: str
    mixed_graph_safe: bool = False
    mixed_graph_reason: str = "not checked"
    #: static pieces' canonical forms by Piece.index, and the compile groups they form (assign_compile_groups)
    canonical: dict[int, CanonicalPiece] = field(default_factory=dict)
    groups: list[CompileGroup] = field(default_factory=list)

    @property
    def num_static(self) -> int:
        return sum(p.kind == STATIC for p in self.pieces)

    @property
    def num_dynamic(self) -> int:
        return sum(p.kind == DYNAMIC for p in self.pieces)


def assign_compile_groups(split: SplitGraph) -> list[CompileGroup]:
    """Canonicalise every static piece and group them (runtime/piece_groups.py); stored on `split`
    (computed once: the pass's report and the runner share them)."""
    if not split.groups:
        split.canonical = {p.index: canonicalize(split.module.get_submodule(p.name))
                           for p in split.pieces if p.kind == STATIC}
        split.groups = group_pieces(list(split.canonical.items()))
    return split.groups


# ----------------------------------------------------------------------------- buckets
def resolve_buckets(buckets: str | Sequence[int], max_num_tokens: int, max_batch_size: int) -> list[int]:
    """Token counts to capture: `auto` = 1, 2, 4, ... up to min(max_num_tokens, AUTO_BUCKET_LIMIT),
    plus max_batch_size (so full decode batches replay); or the given list, checked."""
    if buckets == "auto":
        out, b = set(), 1
        while b <= min(max_num_tokens, AUTO_BUCKET_LIMIT):
            out.add(b)
            b *= 2
        out.add(min(max_num_tokens, AUTO_BUCKET_LIMIT))
        if max_batch_size <= max_num_tokens:
            out.add(max_batch_size)
        return sorted(out)
    too_big = [b for b in buckets if b > max_num_tokens]
    if too_big:
        raise ValueError(
            f"piecewise.buckets {too_big} exceed runtime.max_num_tokens={max_num_tokens}: a step never has "
            "more tokens; drop them or raise max_num_tokens."
        )
    return sorted({int(b) for b in buckets})


def bucket_for(buckets: Sequence[int], num_tokens: int, decode_only: bool, max_batch_size: int,
               max_num_tokens: int) -> Optional[int]:
    """The token count a step of `num_tokens` is padded to: the smallest bucket that holds it (a
    decode-only step prefers one <= max_batch_size, so its padding is dummy decode sequences);
    None when no bucket fits (the step runs unpadded)."""
    fits = [b for b in buckets if num_tokens <= b <= max_num_tokens]
    if decode_only:
        seqs = [b for b in fits if b <= max_batch_size]
        if seqs:
            return min(seqs)
    return min(fits, default=None)


class _StaticPiece(nn.Module):
    """A static piece: eager/compiled callable, plus one CUDA graph per bucket once captured.

    Its collaborators are explicit constructor arguments: `capture` (the runner's capture of one
    piece at one bucket) and `stats` (the runner's counters). The bucket comes with each call
    (`run`), from the step's descriptor through `_PieceAt`: a piece never asks the runner which
    step it is in."""

    def __init__(self, index: int, name: str, fn: nn.Module, sources: list[str], capturable: Optional[str],
                 capture: Callable[["_StaticPiece", int, tuple], Optional[Any]], stats: Counter) -> None:
        super().__init__()
        self.fn = fn
        self.index, self.piece_name = index, name
        self.capture, self.stats = capture, stats
        self.modes = [BORROW if s == "input" else OWNED for s in sources]
        self.graphs: dict[int, Any] = {}
        self.not_capturable = capturable  # reason, or None

    def forward(self, *args: Any) -> Any:
        """Eagerly (the eager module's call)."""
        return self.fn(*args)

    def run(self, bucket: int, *args: Any) -> Any:
        """Replay this piece's CUDA graph of `bucket` (capturing it the first time), else eagerly."""
        cap = self.graphs.get(bucket)
        if cap is None:
            if bucket in self.graphs or self.not_capturable:
                return self.fn(*args)
            cap = self.capture(self, bucket, args)
            self.graphs[bucket] = cap
            if cap is None:
                return self.fn(*args)
        if not cap.bind(args):
            self.stats["piece_eager_fallback"] += 1
            return self.fn(*args)
        return cap.replay()


class _PieceAt(nn.Module):
    """A static piece bound to one token bucket: what the graph module of that bucket calls."""

    def __init__(self, piece: _StaticPiece, bucket: int) -> None:
        super().__init__()
        self.piece, self.bucket = piece, bucket

    def forward(self, *args: Any) -> Any:
        return self.piece.run(self.bucket, *args)


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    return copy.deepcopy(gm.graph)


def _fetch(mod: nn.Module, target: str) -> Any:
    mod_path, _, attr = target.rpartition(".")
    return getattr(mod.get_submodule(mod_path) if mod_path else mod, attr)


class PiecewiseRunner:
    def __init__(
        self,
        split: SplitGraph,
        device: torch.device,
        max_num_tokens: int,
        *,
        compile: str = "none",
        cuda_graphs: bool = True,
        buckets: Sequence[int] = (),
        decode_graph: bool = True,
        mixed_graph_max_tokens: int = 0,
        dynamic_tokens: bool = True,
    ) -> None:
        self.split = split
        self.device = torch.device(device)
        self.compile = compile
        #: per piece: what it is and which buckets were captured (the build report shows it)
        self.report = [p.to_dict() for p in split.pieces]
        why_not = cuda_graphs_available(self.device) if cuda_graphs else "cuda_graphs: false"
        self.graphs_off_reason = why_not
        self.use_graphs = why_not is None
        self.buckets: list[int] = sorted({b for b in buckets if 1 <= b <= max_num_tokens})
        self._bucket_set = frozenset(self.buckets) if self.use_graphs else frozenset()
        self.decode_graph = bool(decode_graph and split.decode_graph_safe and self.use_graphs)
        #: steps up to this many tokens (buckets only) replay whole-graph mixed graphs (0: off)
        self.mixed_graph_max_tokens = int(mixed_graph_max_tokens) \
            if (split.mixed_graph_safe and self.use_graphs and mixed_graph_max_tokens > 0) else 0
        self.stats: Counter[str] = Counter()
        self.failures: dict[str, str] = {}
        self._static_outputs: dict[int, set[tuple]] = {}
        self._decode_graphs: dict[int, Any] = {}
        self._mixed_graphs: dict[int, Any] = {}
        self._capturer = GraphCapturer(self.device) if self.use_graphs else None

        top = split.module
        direct = direct_calls()
        #: dynamic pieces whose cached ops run without the dispatcher (their backend's direct_call)
        self.direct_pieces: list[str] = []
        eager_attrs: dict[str, Any] = {}
        #: piece name -> its dynamic piece, or the static piece a bucket's module binds (`_module_for`)
        self._piece_attrs: dict[str, Any] = {}
        graph_attrs = self._piece_attrs
        self.static_pieces: list[_StaticPiece] = []
        groups = assign_compile_groups(split)
        group_of = {i: g for g in groups for i in g.pieces}
        for g in groups:
            for i in g.pieces:
                if i < len(self.report):
                    self.report[i]["compile_group"] = g.index
        #: one compiled callable per compile group (empty with compile: none)
        self.compiled: list[CompiledGroup] = [] if compile == "none" else \
            [CompiledGroup(g, split.canonical[g.pieces[0]], compile) for g in groups]
        #: how the token-dependent inputs of the static pieces were found (set at the first step of >= 2 tokens)
        self.token_dims_note = "not derived yet" if self.compiled else "no compiled pieces"
        if self.compiled and not dynamic_tokens:
            self.token_dims_note = "dynamic_tokens: false (Dynamo's automatic dynamic shapes decide)"
        self._token_dims_pending = bool(self.compiled) and dynamic_tokens
        #: CUDA graphs captured per kind: count, seconds (compiles during a capture excluded), failures
        self.capture_stats: dict[str, dict[str, float]] = {
            k: {"count": 0, "seconds": 0.0, "failed": 0} for k in ("decode_graph", "mixed_graph", "piecewise")}
        for piece in split.pieces:
            sub = top.get_submodule(piece.name)
            fn: nn.Module = sub
            if piece.kind == STATIC and self.compiled:
                g = group_of[piece.index]
                fn = GroupMember(self.compiled[g.index], split.canonical[piece.index].params, g.keep(piece.index))
            eager_attrs[piece.name] = fn
            if piece.kind == STATIC:
                why = _mutation_reason(sub)
                sp = _StaticPiece(piece.index, piece.name, fn, piece.arg_sources, why, self._capture_piece, self.stats)
                if why and piece.index < len(self.report):
                    self.report[piece.index]["not_capturable"] = why
                self.static_pieces.append(sp)
                graph_attrs[piece.name] = sp
            else:
                fn = _with_direct_calls(sub, direct)
                if fn is not sub:
                    self.direct_pieces.append(piece.name)
                eager_attrs[piece.name] = graph_attrs[piece.name] = fn
        for node in top.graph.nodes:  # leftover top-level attributes (normally none)
            if node.op == "get_attr":
                eager_attrs[node.target] = graph_attrs[node.target] = _fetch(top, node.target)
        self.eager_module = torch.fx.GraphModule(eager_attrs, _copy_graph(top), "PiecewiseEager")
        #: per bucket: the graph module whose static pieces replay that bucket's CUDA graphs
        self._bucket_modules: dict[int, torch.fx.GraphModule] = {}

    @property
    def capture_buckets(self) -> tuple[int, ...]:
        """Token counts this runner replays from CUDA graphs (empty when graphs are off)."""
        return tuple(self.buckets) if self.use_graphs else ()

    # ------------------------------------------------------------------ stepping
    def __call__(self, step: StepDescriptor, *args: Any) -> Any:
        """Run one step as its descriptor says (`step.mode`, `step.bucket`: decided by the model runner):
        (input_ids [1,T], position_ids [1,T], *metadata, *caches) -> outputs. Without CUDA graphs every
        step runs eagerly; a whole graph whose capture failed runs the step on its bucket's pieces."""
        if self._token_dims_pending and int(args[0].shape[-1]) >= 2:
            self._derive_token_dims(args)
        if not self.use_graphs or step.mode == "eager":
            self.stats["eager"] += 1
            return self.eager_module(*args)
        t = step.bucket
        if t != int(args[0].shape[-1]) or t not in self._bucket_set:
            raise ValueError(f"PiecewiseRunner: the step is described for bucket {t} ({step.mode}) but its graph "
                             f"inputs hold {int(args[0].shape[-1])} tokens (buckets: {self.buckets}); describe "
                             "steps with ModelRunner.describe_step after building their metadata")
        # (what this runner can run: a descriptor made for decode or mixed graphs it has off runs on pieces)
        if step.mode == "decode_graph" and self.decode_graph:
            out = self._run_whole_graph(self._decode_graphs, "decode_graph", f"decode graph (batch {t})", t, args)
            if out is not None:
                self.stats["decode_graph"] += 1
                return out
        elif step.mode == "mixed_graph" and t <= self.mixed_graph_max_tokens:
            out = self._run_whole_graph(self._mixed_graphs, "mixed_graph", f"mixed graph ({t} tokens)", t, args)
            if out is not None:
                self.stats["mixed_graph"] += 1
                return out
        out = self._module_for(t)(*args)
        self.stats["piecewise"] += 1
        return out

    def _module_for(self, bucket: int) -> torch.fx.GraphModule:
        """The graph module of `bucket`: its static pieces bound to the bucket (made at first use)."""
        gm = self._bucket_modules.get(bucket)
        if gm is None:
            attrs = {name: _PieceAt(v, bucket) if isinstance(v, _StaticPiece) else v
                     for name, v in self._piece_attrs.items()}
            gm = self._bucket_modules[bucket] = torch.fx.GraphModule(attrs, _copy_graph(self.split.module),
                                                                     f"PiecewiseGraphs{bucket}")
        return gm

    def _derive_token_dims(self, args: tuple) -> None:
        """Tell every compile group which of its inputs vary with the token count (piece_shapes), from
        this step's graph inputs: before any group compiles at a token count >= 2."""
        self._token_dims_pending = False
        static = {p.name: p.index for p in self.split.pieces if p.kind == STATIC}
        try:
            dims, self.token_dims_note = static_token_dims(self.split.module, static, args)
        except Exception as exc:  # noqa: BLE001 - Dynamo's automatic dynamic shapes still work, one compile more
            dims, self.token_dims_note = {}, f"not derived ({type(exc).__name__}: {exc}); Dynamo decides dynamism"
        for cg in self.compiled:
            cg.token_dims = dims.get(cg.group.pieces[0])

    def compile_seconds(self) -> float:
        return sum(cg.stats.seconds for cg in self.compiled)

    def _timed_capture(self, kind: str, capture: Any) -> Any:
        """Run `capture()` and add its seconds, less the compiles it triggered, to `capture_stats[kind]`."""
        c0, t0 = self.compile_seconds(), time.perf_counter()
        stat = self.capture_stats[kind]
        try:
            cap = capture()
        except CaptureError:
            stat["failed"] += 1
            raise
        finally:
            stat["seconds"] += time.perf_counter() - t0 - (self.compile_seconds() - c0)
        stat["count"] += 1
        return cap

    # ------------------------------------------------------------------ capture
    def _run_whole_graph(self, graphs: dict[int, Any], kind: str, label: str, t: int, args: tuple) -> Optional[Any]:
        """Replay (capturing it the first time) the whole-graph graph of `kind` for T = t; None when
        it cannot run (its capture failed, or the arguments are not the captured buffers)."""
        cap = graphs.get(t)
        if cap is None:
            if t in graphs:
                return None  # capture failed before
            try:
                cap = self._timed_capture(kind, lambda: self._capturer.capture(self.eager_module, args,
                                                                                [BORROW] * len(args), label))
            except CaptureError as exc:
                self.failures[label] = str(exc)
                graphs[t] = None
                return None
            graphs[t] = cap
            for entry in self.report:
                entry["captured"][kind].append(t)
        if not cap.bind(args):
            self.stats[f"{kind}_bind_miss"] += 1
            return None
        return cap.replay()

    def _capture_piece(self, piece: _StaticPiece, t: int, args: tuple) -> Optional[Any]:
        label = f"piece {piece.index} ({piece.piece_name}, {t} tokens)"
        owned = self._static_outputs.setdefault(t, set())
        try:
            cap = self._timed_capture("piecewise", lambda: self._capturer.capture(
                piece.fn, args, piece.modes, label, owned_ok=lambda x: tensor_key(x) in owned))
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
            "mixed_graph": sorted(t for t, c in self._mixed_graphs.items() if c is not None),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "pieces": len(self.split.pieces),
            "cuda_graphs": self.use_graphs,
            "cuda_graphs_off_reason": self.graphs_off_reason,
            "buckets": self.buckets,
            "decode_graph": self.decode_graph,
            "decode_graph_reason": self.split.decode_graph_reason,
            "mixed_graph_max_tokens": self.mixed_graph_max_tokens,
            "mixed_graph_reason": self.split.mixed_graph_reason,
            "captured": self.captured(),
            "stats": dict(self.stats),
            "failures": dict(self.failures),
            "direct_call_pieces": len(self.direct_pieces),
            "compile_groups": self.compile_groups(),
            "token_dims": self.token_dims_note,
            "captures": {k: {**v, "seconds": round(v["seconds"], 4)} for k, v in self.capture_stats.items()},
        }

    def compile_groups(self) -> list[dict[str, Any]]:
        """Which static pieces share which compiled graph, and (compiled) what compiling it cost."""
        if self.compiled:
            return [cg.to_dict() for cg in self.compiled]
        return [g.to_dict() for g in self.split.groups]


def _with_direct_calls(sub: torch.fx.GraphModule, direct: dict[Any, Any]) -> torch.fx.GraphModule:
    """A copy of dynamic piece `sub` (sharing its parameters) whose cached ops call their backend's
    implementation directly: eager attention pieces run once per layer per non-graph step, and the
    dispatcher's argument handling for a 19-argument mutating op is a large share of their host time
    (docs/benchmarks/op_host_cost.md). Same function, same arguments; `sub` itself keeps the op."""
    nodes = [n for n in sub.graph.nodes if n.op == "call_function" and n.target in direct]
    if not nodes:
        return sub
    graph = copy.deepcopy(sub.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in direct:
            node.target = direct[node.target]
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
