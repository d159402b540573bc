"""`piecewise`: split the cached graph around its dynamic (attention) ops (DESIGN §9).

Split points are found by op identity, from the backend registry: every op a descriptor declares
(`MLABackend.split_ops()`: its cached op when `is_dynamic`, and its declared `sparse_ops`). No
op-name matching and no undeclared attributes: a new backend is a split point as soon as it is
registered.

The graph is partitioned in node order: a static piece collects nodes until the next dynamic op,
which gets a piece of its own. The partition DAG is built with networkx and must be acyclic;
`torch.fx.passes.split_module` then produces one submodule per piece, called in topological order
from a small top-level graph. Parameters that split_module would pass between pieces as inputs are
moved back into the submodules that use them (fewer arguments per call, constant addresses for
CUDA graphs and torch.compile).

The pass only plans: it leaves `ctx.gm` (the flat graph) unchanged and hands the runtime a
`SplitGraph` and `RunnerOptions` (types of runtime/piecewise.py, where the `PiecewiseRunner` runs
static pieces eager or torch.compile'd, captured as CUDA graphs per token-count bucket on CUDA,
dynamic ops eager in between, and a whole-graph decode CUDA graph where every op is
decode-graph-safe). Its stage (COMPILE) is the last: nothing rewrites the graph after it.
See docs/piecewise.md.
"""

from __future__ import annotations

import operator
from typing import Any, Literal, Optional, Union

import networkx as nx
import torch
from pydantic import Field, field_validator
from torch.fx.passes.split_module import split_module

from ..custom_ops.attention.registry import MLABackend, all_backends
from ..runtime.artifacts import RunnerOptions
from ..runtime.piecewise import (AUTO_BUCKET_LIMIT, DYNAMIC, MIXED_GRAPH_MAX_TOKENS, STATIC, Piece, SplitGraph,
                                 assign_compile_groups, resolve_buckets)
from .context import BuildContext
from .fx_utils import module_tensor
from .registry import PassOptions, PassResult, Stage, register_pass


class PiecewiseOptions(PassOptions):
    enabled: bool = True
    on_cpu: bool = Field(
        False, description="split on CPU too (pieces run eagerly there: no CUDA graphs); for tests and debugging"
    )
    compile: Literal["auto", "none", "inductor", "aot_eager"] = Field(
        "auto", description="torch.compile backend for static pieces: auto = inductor on CUDA, none elsewhere "
        "('aot_eager': tracing only, for tests)"
    )
    cuda_graphs: bool = Field(True, description="capture static pieces per token bucket (CUDA only)")
    buckets: Union[Literal["auto"], list[int]] = Field(
        "auto",
        description="token counts to capture; steps are padded up to the next bucket. "
        f"auto: 1, 2, 4, ... up to min(max_num_tokens, {AUTO_BUCKET_LIMIT}), plus max_batch_size",
    )
    decode_graph: Literal["auto", "off"] = Field(
        "auto", description="one whole-graph CUDA graph per decode batch bucket when every op is decode_graph_safe"
    )
    mixed_graph: Literal["auto", "off"] = Field(
        "auto", description="one whole-graph CUDA graph per token bucket <= mixed_graph_max_tokens for prefill and "
        "mixed steps when every dynamic op is mixed_graph_safe (their attention then runs on static bounds)"
    )
    mixed_graph_max_tokens: int = Field(
        MIXED_GRAPH_MAX_TOKENS, ge=1,
        description="largest bucket replayed as a mixed whole-graph graph; bigger steps run piecewise",
    )
    dynamic_tokens: bool = Field(
        True, description="compile each group of static pieces dynamic in the token count from its first compile "
        "(one compile, plus one for 1 token); false: Dynamo's automatic dynamic shapes (the first count "
        "specialised, dynamic from the second: one compile more per group)",
    )

    @field_validator("decode_graph", "mixed_graph", mode="before")
    @classmethod
    def _yaml_switch(cls, v: object) -> object:
        """YAML reads a bare `off` / `no` as false and `on` / `yes` as true: take them as "off" / "auto"."""
        if isinstance(v, bool):
            return "auto" if v else "off"
        return v

    @field_validator("buckets")
    @classmethod
    def _buckets(cls, v: Union[str, list[int]]) -> Union[str, list[int]]:
        if isinstance(v, list):
            bad = [b for b in v if int(b) < 1]
            if bad:
                raise ValueError(f"buckets must be positive token counts, got {bad}")
            return sorted({int(b) for b in v})
        return v


# ----------------------------------------------------------------------------- split points
def split_point_ops() -> dict[Any, MLABackend]:
    """op (packet and overload) -> the descriptor it belongs to, for every split-point op."""
    out: dict[Any, MLABackend] = {}
    for be in all_backends().values():
        for op in be.split_ops():
            out[op] = be
            default = getattr(op, "default", None)
            if default is not None:
                out[default] = be
    return out


def is_split_point(node: torch.fx.Node, ops: dict[Any, MLABackend]) -> bool:
    return node.op == "call_function" and node.target in ops


# ----------------------------------------------------------------------------- plan + split
class PiecewiseError(RuntimeError):
    """The graph cannot be split into a valid piece sequence; the message says why."""


def plan_partitions(gm: torch.fx.GraphModule, ops: dict[Any, MLABackend]) -> tuple[dict[torch.fx.Node, int], dict[int, str]]:
    """Assign every call node a partition id (in node order); returns (node -> id, id -> kind)."""
    part: dict[torch.fx.Node, int] = {}
    kinds: dict[int, str] = {}
    pid, open_static = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_split_point(node, ops):
            if open_static:
                pid += 1
            part[node], kinds[pid] = pid, DYNAMIC
            pid += 1
            open_static = False
        else:
            part[node], kinds[pid] = pid, STATIC
            open_static = True
    return part, kinds


def partition_dag(part: dict[torch.fx.Node, int], kinds: dict[int, str]) -> "nx.DiGraph":
    """Data-flow DAG between partitions; raises PiecewiseError if it has a cycle."""
    dag = nx.DiGraph()
    dag.add_nodes_from(kinds)
    for node, p in part.items():
        for user in node.users:
            q = part.get(user)
            if q is not None and q != p:
                dag.add_edge(p, q)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        raise PiecewiseError(
            f"piecewise: the partition graph has a cycle {cycle}; the flat graph is not in topological order. "
            "Run graph.lint() after the last rewriting pass, or disable `piecewise`."
        )
    return dag


def _inline_params(top: torch.fx.GraphModule) -> None:
    """Turn submodule inputs fed by top-level tensor get_attrs (parameters) into get_attrs inside."""
    for call in [n for n in top.graph.nodes if n.op == "call_module"]:
        sub = top.get_submodule(call.target)
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(phs) != len(call.args) or call.kwargs:
            continue  # unexpected calling convention: leave it alone
        body = next(n for n in sub.graph.nodes if n.op != "placeholder")  # get_attrs go after the inputs
        keep_args = []
        for ph, arg in zip(phs, call.args):
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                value = module_tensor(top, arg.target)
                if isinstance(value, torch.Tensor):
                    name = "p_" + arg.target.replace(".", "_")
                    if isinstance(value, torch.nn.Parameter):
                        sub.register_parameter(name, value)
                    else:
                        sub.register_buffer(name, value)
                    with sub.graph.inserting_before(body):
                        ga = sub.graph.get_attr(name)
                    ga.meta = dict(ph.meta)
                    ph.replace_all_uses_with(ga)
                    sub.graph.erase_node(ph)
                    continue
            keep_args.append(arg)
        if len(keep_args) != len(call.args):
            call.args = tuple(keep_args)
            sub.recompile()
    top.graph.eliminate_dead_code()
    for node in [n for n in top.graph.nodes if n.op == "get_attr" and not n.users]:
        top.graph.erase_node(node)
    top.graph.lint()
    top.recompile()


def _arg_sources(call: torch.fx.Node, kind_of: dict[str, str]) -> list[str]:
    out = []
    for a in call.args:
        src = a
        while isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target is operator.getitem:
            src = src.args[0]
        if not isinstance(src, torch.fx.Node) or src.op in ("placeholder", "get_attr"):
            out.append("input")
        elif src.op == "call_module":
            out.append(kind_of.get(src.target, DYNAMIC))
        else:
            out.append(DYNAMIC)  # unknown producer: treat as fresh every step
    return out


def split_graph(gm: torch.fx.GraphModule) -> SplitGraph:
    """Split `gm` around its split-point ops into static and dynamic pieces."""
    ops = split_point_ops()
    part, kinds = plan_partitions(gm, ops)
    if not any(k == DYNAMIC for k in kinds.values()):
        raise PiecewiseError(
            "piecewise: the graph has no cached attention op to split at (registered split points: "
            f"{', '.join(sorted({str(o) for o in ops if hasattr(o, '_schema')}))}). "
            "Run insert_cached_mla_attention first, or disable `piecewise`."
        )
    dag = partition_dag(part, kinds)
    order = list(nx.lexicographical_topological_sort(dag))
    rank = {p: i for i, p in enumerate(order)}
    top = split_module(gm, gm, lambda n: rank[part[n]], keep_original_order=True)
    _inline_params(top)

    by_rank = {rank[p]: p for p in kinds}
    kind_of = {f"submod_{r}": kinds[p] for r, p in by_rank.items()}
    counts: dict[int, int] = {}
    for node, p in part.items():
        counts[rank[p]] = counts.get(rank[p], 0) + 1

    pieces: list[Piece] = []
    unsafe: dict[str, list[str]] = {}
    mixed_unsafe: dict[str, list[str]] = {}
    for call in top.graph.nodes:
        if call.op != "call_module":
            continue
        r = int(call.target.rsplit("_", 1)[1])
        piece = Piece(len(pieces), call.target, kinds[by_rank[r]], counts.get(r, 0),
                      arg_sources=_arg_sources(call, kind_of))
        if piece.kind == DYNAMIC:
            sub = top.get_submodule(call.target)
            for n in sub.graph.nodes:
                if n.op == "call_function" and n.target in ops:
                    be = ops[n.target]
                    piece.ops.append(str(n.target))
                    piece.backends.append(be.name)
                    layer = getattr(n.meta.get("mla_backend"), "layer", None) or n.meta.get("mla_layer", n.name)
                    piece.layers.append(str(layer))
                    if not be.decode_graph_safe:
                        unsafe.setdefault(be.name, []).append(str(layer))
                    # the flag covers the backend's dense cached op; its other dynamic ops (sparse
                    # attention, DSA indexer) size launches from host counts
                    if not (be.mixed_graph_safe and n.target in (be.cached_op, getattr(be.cached_op, "default", None))):
                        what = be.name if not be.mixed_graph_safe else f"{be.name}: {n.target}"
                        mixed_unsafe.setdefault(what, []).append(str(layer))
        pieces.append(piece)
    if unsafe:
        reason = "; ".join(f"backend {b!r} is not decode_graph_safe (layers {', '.join(ls)})" for b, ls in unsafe.items())
    else:
        reason = "every dynamic op is decode_graph_safe"
    if mixed_unsafe:
        mixed_reason = "; ".join(f"{b!r} is not mixed_graph_safe (layers {', '.join(ls[:4])}"
                                 f"{', ...' if len(ls) > 4 else ''})" for b, ls in mixed_unsafe.items())
    elif not any(p.kind == DYNAMIC for p in pieces):
        mixed_reason, mixed_unsafe = "no dynamic op", {"": []}
    else:
        mixed_reason = "every dynamic op is mixed_graph_safe"
    return SplitGraph(gm, top, pieces, not unsafe, reason, not mixed_unsafe, mixed_reason)


# ----------------------------------------------------------------------------- the pass
def resolve_compile(requested: str, device: torch.device) -> tuple[str, str]:
    """(torch.compile backend for the static pieces, why). `auto` compiles with Inductor on CUDA: on
    the H200 it cut decode steps by 10-35% (fewer, fused elementwise kernels; docs/benchmarks/
    e2e_roofline.md) at the price of a one-time compile in warm-up, which PyTorch's on-disk caches
    (FX graph, AOTAutograd, Triton) shorten for every later process on the machine. Elsewhere the
    pieces run eagerly (Inductor on CPU buys nothing our CPU tests need)."""
    if requested != "auto":
        return requested, "configured"
    if device.type == "cuda":
        return "inductor", "auto: CUDA"
    return "none", f"auto: {device.type}"


def static_pieces_compile(opts: PiecewiseOptions, device: torch.device) -> tuple[Optional[str], str]:
    """(torch.compile backend the static pieces will get, why), or (None, why) when this pass will not
    split the graph: what earlier passes ask when a rewrite only pays under a compiler (real_rope)."""
    if not opts.enabled:
        return None, "piecewise is off (no static pieces)"
    if device.type != "cuda" and not opts.on_cpu:
        return None, "skipped: not on CUDA (no CUDA graphs here; set on_cpu: true to split anyway)"
    return resolve_compile(opts.compile, device)


@register_pass("piecewise", PiecewiseOptions, stage=Stage.COMPILE, requires=("insert_cached_mla_attention",))
def piecewise(ctx: BuildContext, opts: PiecewiseOptions) -> PassResult:
    assert ctx.gm is not None
    compile_backend, compile_why = static_pieces_compile(opts, ctx.device)
    if compile_backend is None:
        return PassResult(compile_why, {"skipped": True})
    rt = ctx.config.runtime
    split = split_graph(ctx.gm)
    buckets = resolve_buckets(opts.buckets, rt.max_num_tokens, rt.max_batch_size)
    ctx.artifacts.split = split
    mixed_max = opts.mixed_graph_max_tokens if opts.mixed_graph == "auto" else 0
    ctx.artifacts.runner = RunnerOptions(compile_backend, opts.cuda_graphs, tuple(buckets), opts.decode_graph == "auto",
                                         mixed_max, opts.dynamic_tokens)

    graphs = opts.cuda_graphs and ctx.device.type == "cuda"
    decode = opts.decode_graph == "auto" and split.decode_graph_safe and graphs
    mixed = [b for b in buckets if b <= mixed_max] if (split.mixed_graph_safe and graphs) else []
    groups = assign_compile_groups(split)
    summary = (
        f"{len(split.pieces)} pieces ({split.num_static} static in {len(groups)} compile groups, "
        f"{split.num_dynamic} dynamic); compile={compile_backend} ({compile_why}); cuda graphs "
        + (f"on, buckets {buckets}" if graphs else "off")
        + (f"; decode whole-graph: {'on' if decode else 'off'} ({split.decode_graph_reason})" if graphs else "")
        + (f"; mixed whole-graph: {'buckets ' + str(mixed) if mixed else 'off'} ({split.mixed_graph_reason})"
           if graphs else "")
    )
    return PassResult(summary, {
        "pieces": [p.to_dict() for p in split.pieces],
        "buckets": buckets if graphs else [],
        "cuda_graphs": graphs,
        "compile": compile_backend,
        "compile_reason": compile_why,
        "compile_groups": [g.to_dict() for g in groups],
        "decode_graph": decode,
        "decode_graph_reason": split.decode_graph_reason,
        "mixed_graph_buckets": mixed,
        "mixed_graph_reason": split.mixed_graph_reason,
    })
