"""`shard`: tensor-parallel MLA over `world_size` ranks (runs after match_mla, before cache insertion).

Every rank runs the same pass on its own copy of the graph and keeps its own slice of the weights:

- MLA attention, split by heads (N -> N/W per rank):
  the query projection feeding `torch_mla` (q_proj, or q_b_proj after the q-LoRA path) is
  column-parallel by head blocks of Dn+Dr rows; the `kv_b_proj_weight` input of `torch_mla` keeps
  the rank's head blocks of Dn+Dv rows; o_proj is row-parallel (the rank's N/W*Dv input columns)
  and its output is summed over ranks. The latent path (kv_a_proj_with_mqa, kv_a_layernorm, the
  rope key) and the q-LoRA down projection stay replicated: each rank keeps the full latent cache
  [pages, page_size, R+Dr] and serves its heads from it. View/reshape nodes between the query
  projection and `torch_mla`, and between `torch_mla` and o_proj, are rewritten where they spell N
  (or N*width) out; `node.meta["mla_dims"]` gets N/W, so backend resolution sees the rank's heads.
- Gated MLPs (dense and shared experts): gate/up column-parallel, down row-parallel.
- MoE routed experts: tensor-parallel inside every expert (each rank keeps all E experts with
  I/W of the intermediate size; the router stays replicated). No all-to-all, no token-count
  imbalance between ranks, and the exported static `grouped_mm` graph stays as it is.
- Embedding, norms, router, lm_head: replicated.

`attention: data` (data-parallel attention, docs/parallel_layouts.md): the MLA blocks keep every head
and weight (each rank runs its own sequences over its own cache), no all-reduce; routed experts are
expert-parallel from each rank's own tokens (`ep_moe_experts`, tokens local, capacity 0: the lock-step
pads every rank's step to the size the ranks agreed on) and dense/shared MLPs replicated — other `experts` / `mlp` values are refused
(`check_data_parallel_options`). The runtime steps the ranks in lock-step (runtime/data_parallel.py).

Partial sums (outputs of the row-parallel matmuls) are followed through ops that are linear in
them (views, casts, gathers, routing-weight products, the sum over top-k experts, the sum of the
routed and shared experts) and all-reduced once where they meet a replicated value (the residual
add): one all-reduce per attention block and one per MLP/MoE block. The all-reduce is
`_c10d_functional.all_reduce` + `wait_tensor` on the default process group (`all_reduce: nccl`), or
`autodeploy::tp_all_reduce` (`all_reduce: one_shot`: a one-shot sum over symmetric memory for
messages up to `one_shot_max_bytes`, set up by the runner; the collective above that and on CPU).

Weights become this rank's slices in the graph: of the real tensors (random-weight models, or
`load: full`), or — when the model is a weightless skeleton — placeholders of the sliced shape that
the `load_weights` pass then reads from the checkpoint by slices (models/skeleton.py,
models/checkpoint.py). Every slice is recorded as a `ShardSpec` in the build artifacts.

The pass is graph-only: the world size, rank and process-group name come from the build context,
resolved once by `optimize()` (distributed/env.py); the pass reads neither the environment nor the
disk. The pass manager re-propagates shapes after it (declared `refresh_shapes`).

Block-FP8 weights (`fp8_block_linear` nodes, FP8 experts and kv_b_proj behind
`fp8_block_dequantize`) are sliced with their `weight_scale_inv` grids: the same dim, in blocks
(column-parallel: the weight's rows and the scale's block rows; row-parallel: columns of both;
experts: the stacked [E, ...] grids likewise). Every rank boundary must fall on a block multiple,
so each rank's weight is again whole [block_n, block_k] blocks and the nodes' block arguments stay
true; a boundary inside a block is refused, naming the tensor, the boundary and the block
(`_Plan.add_weight`). A kv_b_proj already dequantized (real weights: match_mla folded it) is a
16-bit parameter and is sliced like one; a skeleton's is dequantized from the rank's FP8 slice by
load_weights.

Head counts that world_size does not divide are refused (all layers are checked before anything
changes). An MLP whose intermediate size world_size does not divide stays replicated (reported).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from pydantic import Field, model_validator
from torch.fx import GraphModule, Node

from ..custom_ops.attention.mla_dims import MLADims
from ..custom_ops.tp_all_reduce import ALL_REDUCE, DEFAULT_ONE_SHOT_MAX_BYTES, TP_ALL_REDUCE, WAIT_TENSOR
from ..custom_ops.attention.torch_mla import source_arg
from ..custom_ops.fp8.linear import FP8_DEQUANTIZE, FP8_LINEAR
from .sparse_export import TORCH_MLA_SPARSE
from ..models.checkpoint import ShardSpec
from ..runtime.artifacts import TensorParallel
from .context import BuildContext
from .fp8_graph import fp8_linear_parts
from .fx_utils import (ASSERT_METADATA, CASTS, RESHAPES, TORCH_MLA, aten, grouped_mm_ops, is_op, module_path,
                       module_tensor, set_module_tensor)
from .fx_utils import shape as _shape
from .fx_utils import skip as _skip
from .fx_utils import val
from .registry import PassOptions, PassResult, Stage, register_pass
from ..custom_ops.moe.backends import resolve_moe_backend
from ..custom_ops.moe.expert_parallel import EP_MOE_EXPERTS

#: The collectives the sharded graph may hold (custom_ops/tp_all_reduce.py): the one-shot op, or the
#: functional all-reduce + wait; all name their process group by string (the graph holds no Python object).
COLLECTIVE_OPS = frozenset({ALL_REDUCE, WAIT_TENSOR, TP_ALL_REDUCE})


class ShardError(ValueError):
    """The graph cannot be sharded as asked; the message names the layer, the reason, what to do."""


class ShardOptions(PassOptions):
    enabled: bool = False
    world_size: Optional[int] = Field(
        None, ge=1, description="ranks; null: from torch.distributed or the WORLD_SIZE environment variable"
    )
    rank: Optional[int] = Field(None, ge=0, description="this rank; null: from torch.distributed or RANK")
    attention: Literal["tensor", "data"] = Field(
        "tensor", description="MLA attention: tensor (heads split over the ranks, an all-reduce after o_proj) or "
        "data (data-parallel: attention weights whole on every rank, each rank runs its own sequences with its own "
        "cache and page allocator, no all-reduce; needs experts: expert — routed experts dispatched from each rank's "
        "own tokens; mlp: replicate keeps dense and shared-expert MLPs whole on every rank, mlp: tensor splits them "
        "with an all-gather of the ranks' tokens before and a reduce-scatter after each; docs/parallel_layouts.md)"
    )
    mlp: Literal["tensor", "replicate"] = Field("tensor", description="dense and shared-expert MLPs")
    experts: Literal["tensor", "replicate", "expert"] = Field(
        "tensor", description="MoE routed experts: tensor-parallel inside each expert, replicated, or "
        "expert-parallel (each rank holds num_experts / world_size whole experts; tokens dispatched to them)"
    )
    ep_collective: Literal["auto", "all_to_all", "allgather_reducescatter"] = Field(
        "auto", description="experts: expert — how the (token, expert) pairs reach their experts: "
        "all-to-all dispatch + combine, or all-gather + reduce-scatter (custom_ops/moe/expert_parallel.py); "
        "auto: allgather_reducescatter under attention: data (measured faster), all_to_all otherwise"
    )
    expert_backend: Literal["auto", "triton", "torch"] = Field(
        "auto", description="experts: expert — the per-rank experts op: triton (the fused kernels), torch "
        "(the reference), auto: triton where fuse_moe's auto would pick it (CUDA), else torch"
    )
    load: Literal["slices", "full"] = Field(
        "slices",
        description="checkpoints: read only this rank's slices (safetensors), or load the full model and slice it",
    )
    all_reduce: Literal["nccl", "one_shot"] = Field(
        "one_shot",
        description="one_shot: autodeploy::tp_all_reduce, a one-shot sum over symmetric memory (NVLink peer reads) "
        "for messages up to one_shot_max_bytes, the collective above them and wherever the runner has no "
        "symmetric buffer (CPU, a failed set-up); nccl: functional all-reduce collectives only",
    )
    one_shot_max_bytes: int = Field(
        DEFAULT_ONE_SHOT_MAX_BYTES, ge=16, multiple_of=16,
        description="largest message (bytes) the one-shot path takes: the size of each rank's symmetric buffer",
    )

    @model_validator(mode="after")
    def _rank_in_world(self) -> "ShardOptions":
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} must be < world_size={self.world_size}")
        return self


# ----------------------------------------------------------------------------- graph helpers
_SHAPE_ARG_OPS = RESHAPES | {aten.expand.default}
# Ops that move/cast data without mixing elements of different heads or intermediate units.
_PASSTHROUGH = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.contiguous.default, aten.clone.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.alias.default, aten.detach.default, aten.t.default,
}
_CASTS = CASTS
_ACTIVATIONS = {aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default,
                aten.tanh.default}
_LINEAR = aten.linear.default
#: linears to the planner: 16-bit, and block-FP8 (weight [out, in] with its scale grid beside it)
_LINEARS = {_LINEAR, FP8_LINEAR}
_ASSERT = ASSERT_METADATA


def _is(node: Any, targets: Iterable[Any]) -> bool:
    return is_op(node, targets)


def _layer_of(node: Node) -> str:
    return module_path(node)


ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def _copy_meta(src: Node, new: Node, kind: str, same_shape: bool) -> None:
    for key in ("nn_module_stack", "stack_trace", *(("val",) if same_shape else ())):
        if key in src.meta:
            new.meta[key] = src.meta[key]
    new.meta["tp_collective"] = kind


def _collective(graph: torch.fx.Graph, after: Node, target: Any, args: tuple, kind: str,
                same_shape: bool = False) -> Node:
    """`wait_tensor(target(*args))` right after `after`; returns the wait node (`same_shape`: its
    output has `after`'s shape, whose `val` it takes; else the pass's shape refresh sets it)."""
    with graph.inserting_after(after):
        op = graph.call_function(target, args)
    with graph.inserting_after(op):
        wait = graph.call_function(WAIT_TENSOR, (op,))
    for new in (op, wait):
        _copy_meta(after, new, kind, same_shape)
    return wait


def insert_all_reduce(graph: torch.fx.Graph, node: Node, group_name: str, algorithm: str = "nccl") -> Node:
    """Insert the sum of `node` over the ranks right after `node`; returns the node holding the sum:
    `wait_tensor(all_reduce(node, "sum", group_name))` (nccl) or `tp_all_reduce(node, group_name)` (one_shot).

    The caller rewires the users it wants reduced; meta is copied from `node` (same shape/dtype)."""
    if algorithm != "one_shot":
        return _collective(graph, node, ALL_REDUCE, (node, "sum", group_name), "all_reduce", same_shape=True)
    with graph.inserting_after(node):
        new = graph.call_function(TP_ALL_REDUCE, (node, group_name))
    _copy_meta(node, new, "all_reduce", same_shape=True)
    return new


def count_all_reduces(gm: GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (ALL_REDUCE, TP_ALL_REDUCE))


@dataclass
class _WeightRef:
    """The get_attr behind a weight argument and how the argument's axes map onto the parameter's."""

    attr: Node
    axes: list[int]  # argument axis -> parameter axis
    #: an FP8 weight's block-scale grid (a get_attr) and (block_n, block_k): sliced with the weight
    scale: Optional[Node] = None
    block: Optional[tuple[int, int]] = None


def _trace_weight(arg: Any) -> Optional[_WeightRef]:
    """The parameter behind a matmul's weight argument, through casts, transposes and (FP8 weights)
    the block dequantization of a parameter and its scale grid."""
    chain: list[Node] = []
    node = arg
    scale: Optional[Node] = None
    block: Optional[tuple[int, int]] = None
    while isinstance(node, Node) and node.op == "call_function":
        if node.target in _CASTS or node.target in (aten.transpose.int, aten.permute.default, aten.t.default):
            chain.append(node)
            node = node.args[0]
        elif node.target is FP8_DEQUANTIZE and isinstance(node.args[1], Node) and node.args[1].op == "get_attr":
            scale, block = node.args[1], (int(node.args[2]), int(node.args[3]))  # same shape: axes unchanged
            node = node.args[0]
            break
        else:
            return None
    if not (isinstance(node, Node) and node.op == "get_attr"):
        return None
    ndim = len(_shape(node)) or len(_shape(arg))
    axes = list(range(ndim))  # parameter-axis order as seen through the chain (outermost op last)
    for op in reversed(chain):
        if op.target is aten.transpose.int:
            a, b = (int(x) % ndim for x in op.args[1:3])
            axes[a], axes[b] = axes[b], axes[a]
        elif op.target is aten.permute.default:
            axes = [axes[int(i) % ndim] for i in op.args[1]]
        elif op.target is aten.t.default:
            axes = axes[::-1]
    return _WeightRef(node, axes, scale, block)


@dataclass
class _Matmul:
    """A linear or grouped_mm node: which argument axis of its weight is 'out' and which is 'in'."""

    node: Node
    weight: _WeightRef
    out_axis: int  # parameter axis of the output features
    in_axis: int  # parameter axis of the input features
    out_size: int
    in_size: int
    bias: Optional[Node]

    @classmethod
    def of(cls, node: Node, grouped: set[Any]) -> Optional["_Matmul"]:
        if not (_is(node, _LINEARS) or _is(node, grouped)) or len(node.args) < 2:
            return None
        if node.target is FP8_LINEAR:  # weight [out, in] and its scale grid, both parameters
            parts = fp8_linear_parts(node)
            if not all(isinstance(a, Node) and a.op == "get_attr" for a in (parts.weight, parts.scale)):
                return None
            if parts.bias is not None and not (isinstance(parts.bias, Node) and parts.bias.op == "get_attr"):
                return None
            shp = _shape(parts.weight)
            ref = _WeightRef(parts.weight, [0, 1], parts.scale, (int(parts.block_n), int(parts.block_k)))
            return cls(node, ref, 0, 1, int(shp[0]), int(shp[1]), parts.bias)
        ref = _trace_weight(node.args[1])
        if ref is None:
            return None
        shp = _shape(node.args[1])
        if node.target is _LINEAR:  # weight [out, in]
            out_arg, in_arg = len(shp) - 2, len(shp) - 1
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        else:  # grouped mm: weight [E, in, out]
            out_arg, in_arg = len(shp) - 1, len(shp) - 2
            bias = node.kwargs.get("bias")
            if bias is None and node.target is aten._grouped_mm.default and len(node.args) > 3:
                bias = node.args[3]
        if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
            return None
        return cls(node, ref, ref.axes[out_arg], ref.axes[in_arg], int(shp[out_arg]), int(shp[in_arg]), bias)


# ----------------------------------------------------------------------------- planning
@dataclass
class _Plan:
    world: int
    rank: int
    specs: dict[str, ShardSpec] = field(default_factory=dict)  # get_attr target -> spec
    partial: list[Node] = field(default_factory=list)  # row-parallel outputs (partial sums)
    #: attention data + mlp tensor: (up projections, down projection) of each tensor-parallel MLP that
    #: gets every rank's tokens by an all-gather before it and its own rows back by a reduce-scatter
    gathered: list[tuple[list[Node], Node]] = field(default_factory=list)
    head_views: list[tuple[Node, int, int]] = field(default_factory=list)  # (node, arg index in shape list, new value)
    mla_nodes: list[tuple[Node, MLADims]] = field(default_factory=list)
    owners: dict[str, Node] = field(default_factory=dict)  # target -> the matmul it was planned for
    report: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"attention": [], "mlp": [], "replicated": [], "experts": []}
    )

    def rng(self, size: int, offset: int = 0) -> tuple[int, int]:
        part = size // self.world
        return (offset + self.rank * part, offset + (self.rank + 1) * part)

    def add(self, target: str, spec: ShardSpec, user: Node) -> None:
        for attr in user.graph.find_nodes(op="get_attr", target=target):
            other = _other_consumer(attr, user)
            if other is not None:
                raise ShardError(
                    f"shard: weight {target} feeds {user.name} (sharded: {spec.rule}) and also {other.name}; "
                    "a shared (tied) weight cannot be split for one consumer only. Untie it or set "
                    "transforms.shard.mlp/experts=replicate for that block."
                )
        prev = self.specs.get(target)
        if prev is not None and (prev.dim, prev.ranges, prev.zero) != (spec.dim, spec.ranges, spec.zero):
            raise ShardError(
                f"shard: weight {target} is used by {self.owners[target].name} and {user.name} with different "
                "sharding; untie the weights or set transforms.shard.enabled=false"
            )
        self.specs[target] = spec
        self.owners[target] = user

    def add_weight(self, ref: _WeightRef, spec: ShardSpec, user: Node, hint: str = "",
                   heads: Optional[int] = None) -> None:
        """`add` for a weight, and for an FP8 weight its block-scale grid too: the same dim, in blocks.

        A rank keeps whole scale blocks only: every boundary of its slice must be a multiple of the
        block along that dim (block_n for rows, block_k for columns), so that the rank's weight is
        again a grid of whole [block_n, block_k] blocks and `fp8_block_linear`'s block arguments still
        describe it. A boundary inside a block is refused (ShardError naming the tensor, the boundary
        and the block) — at planning time, before any weight is sliced or read. Published FP8 models
        (DeepSeek-V3/R1/V3.2, Kimi-K2: 128-blocks) split on block multiples at TP 2/4/8. `heads`: the
        head count a valid world size must also divide (attention weights), for the error's advice."""
        if ref.scale is not None and ref.block is not None:
            shape = [int(x) for x in _shape(ref.attr)]
            ndim = len(shape)
            d = spec.dim % ndim
            blk = ref.block[0] if d == ndim - 2 else ref.block[1] if d == ndim - 1 else 1
            what = "rows" if d == ndim - 2 else "columns" if d == ndim - 1 else f"dim {d}"
            for a, b in spec.ranges:
                bad = a if a % blk else b if (b - a) % blk else None
                if bad is None:
                    continue
                part, lo = b - a, bad // blk * blk
                total = part * self.world
                ok = [w for w in range(1, total + 1) if total % w == 0 and (total // w) % blk == 0
                      and (heads is None or heads % w == 0)]
                raise ShardError(
                    f"shard: FP8 weight {ref.attr.target} {shape} (scale blocks [{ref.block[0]}, {ref.block[1]}]): "
                    f"with world_size={self.world} rank {self.rank} would keep {what} [{a}, {b}) ({spec.rule}), and "
                    f"the boundary {bad} falls inside the block of {what} [{lo}, {lo + blk}), whose one scale would "
                    f"be split between two ranks. Tensor parallelism over block-FP8 weights needs every rank "
                    f"boundary on a multiple of the block ({blk}); world sizes that keep this tensor's slices "
                    f"block-aligned{' and divide the head count ' + str(heads) if heads else ''}: "
                    f"{', '.join(map(str, ok))}{hint}."
                )
            ranges = tuple((a // blk, -(-b // blk)) for a, b in spec.ranges)
            self.add(str(ref.scale.target), ShardSpec(spec.dim, ranges, f"{spec.rule} (block scales)", spec.zero),
                     user)
        self.add(str(ref.attr.target), spec, user)


def _other_consumer(attr: Node, owner: Node) -> Optional[Node]:
    """A node other than `owner` that consumes `attr` (through casts/transposes), if any."""
    stack = list(attr.users)
    seen: set[Node] = set()
    while stack:
        u = stack.pop()
        if u in seen or u is owner or _is(u, {_ASSERT}):
            continue
        seen.add(u)
        if _is(u, _CASTS | {aten.transpose.int, aten.permute.default, aten.t.default, FP8_DEQUANTIZE}):
            stack.extend(u.users)
            continue
        return u
    return None


def _walk_back_to_matmuls(starts: list[Node], grouped: set[Any]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable backwards from `starts`, stopping at matmuls (returned separately)."""
    seen: set[Node] = set()
    found: set[Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is(n, _LINEARS) or _is(n, grouped):
            found.add(n)
            continue
        if n.op in ("get_attr", "placeholder"):
            continue
        stack.extend(n.all_input_nodes)
    return seen - found, found


def _descendants_within(src: Node, allowed: set[Node]) -> set[Node]:
    out: set[Node] = set()
    stack = [u for u in src.users if u in allowed]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        stack.extend(u for u in n.users if u in allowed)
    return out


def _head_view_edits(nodes: Iterable[Node], n_heads: int, widths: set[int], world: int) -> list[tuple[Node, int, int]]:
    """Shape literals that carry the head count in reshape/expand nodes on a head path.

    The head axis is the outermost static axis whose size is N or N*w for a per-head width w (batch
    and sequence are symbolic after export, so they are never literals)."""
    edits = []
    for n in nodes:
        if not _is(n, _SHAPE_ARG_OPS):
            continue
        shape_arg = n.args[1]
        out = _shape(n)
        if not isinstance(shape_arg, (list, tuple)) or len(shape_arg) != len(out):
            continue
        carried = {n_heads} | {n_heads * w for w in widths}
        axis = next((i for i, size in enumerate(out) if isinstance(size, int) and size in carried), None)
        if axis is None:
            continue
        lit = shape_arg[axis]
        if isinstance(lit, int) and lit == out[axis]:  # -1 or a symbol: follows the new input by itself
            edits.append((n, axis, lit // world))
    return edits


def _plan_attention(gm: GraphModule, plan: _Plan, grouped: set[Any]) -> None:
    mla = [n for n in gm.graph.nodes if _is(n, {TORCH_MLA, TORCH_MLA_SPARSE})]  # sparse: same heads layout
    world = plan.world
    bad = []
    for m in mla:
        dims: MLADims = m.meta["mla_dims"]
        if dims.num_heads % world:
            bad.append(f"{m.meta.get('mla_layer', m.name)} (N={dims.num_heads})")
    if bad:
        n0 = mla[0].meta["mla_dims"].num_heads
        ok = [w for w in range(1, n0 + 1) if all(m.meta["mla_dims"].num_heads % w == 0 for m in mla)]
        raise ShardError(
            f"shard: world_size={world} does not divide the attention head count of {', '.join(bad)}. "
            f"Tensor parallelism splits MLA by heads, so world_size must divide N; valid world sizes for "
            f"this model: {', '.join(map(str, ok))}."
        )
    for m in mla:
        layer = m.meta.get("mla_layer", m.name)
        dims = m.meta["mla_dims"]
        n, dn, dr, dv = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
        local = n // world
        if m.target is not TORCH_MLA_SPARSE and source_arg(m, "layout") != "bsnd":
            raise ShardError(f"shard: {layer}: only bsnd torch_mla nodes are supported")

        # query projection: the one matmul behind q_nope and q_pe
        between, q_mms = _walk_back_to_matmuls([m.args[0], m.args[1]], grouped)
        if len(q_mms) != 1:
            raise ShardError(
                f"shard: {layer}: expected one query projection feeding q_nope/q_pe, found "
                f"{len(q_mms)} ({', '.join(x.name for x in q_mms) or 'none'}); cannot split the heads"
            )
        q = _Matmul.of(next(iter(q_mms)), grouped)
        if q is None or q.node.target not in _LINEARS or q.out_size != n * (dn + dr):
            raise ShardError(
                f"shard: {layer}: the query projection {next(iter(q_mms)).name} should be a linear with "
                f"N*(Dn+Dr)={n * (dn + dr)} outputs"
            )
        q_range = plan.rng(n * (dn + dr))
        plan.add_weight(q.weight, ShardSpec(q.out_axis, (q_range,), "heads: query rows"), q.node, heads=n)
        if q.bias is not None:
            plan.add(q.bias.target, ShardSpec(0, (q_range,), "heads: query bias"), q.node)
        q_path = _descendants_within(q.node, between)

        # kv_b_proj weight: rows per head [Dn | Dv]
        w = _trace_weight(m.args[4])
        if w is None:
            raise ShardError(f"shard: {layer}: kv_b_proj_weight of torch_mla is not a model weight")
        plan.add_weight(w, ShardSpec(w.axes[0], (plan.rng(n * (dn + dv)),), "heads: kv_b_proj rows"), m,
                        "; kv_b_proj is only used dequantized: with a checkpoint, transforms.shard.load=full "
                        "dequantizes it whole before slicing (any head boundary)", heads=n)

        # o_proj: the one linear reached forward from the attention output
        o_path: set[Node] = set()
        o_mm: list[Node] = []
        stack = list(m.users)
        while stack:
            u = stack.pop()
            if u in o_path or u in o_mm:
                continue
            if _is(u, _LINEARS):
                o_mm.append(u)
            elif _is(u, _PASSTHROUGH) or _is(u, {_ASSERT}):
                o_path.add(u)
                stack.extend(u.users)
            else:
                raise ShardError(
                    f"shard: {layer}: unsupported op {u.target} between the attention output and o_proj"
                )
        o = _Matmul.of(o_mm[0], grouped) if len(o_mm) == 1 else None
        if o is None or o.in_size != n * dv:
            raise ShardError(f"shard: {layer}: expected one o_proj linear with N*Dv={n * dv} inputs after torch_mla")
        plan.add_weight(o.weight, ShardSpec(o.in_axis, (plan.rng(n * dv),), "heads: o_proj columns"), o.node,
                        heads=n)
        if o.bias is not None:
            plan.add(o.bias.target, ShardSpec(0, ((0, int(_shape(o.bias)[0])),), "o_proj bias (rank 0)",
                                              zero=plan.rank != 0), o.node)
        plan.partial.append(o.node)

        widths = {dn + dr, dn, dr, dv, dn + dv} - {0}
        plan.head_views += _head_view_edits(q_path | o_path, n, widths, world)
        plan.mla_nodes.append((m, dataclasses.replace(dims, num_heads=local)))
        plan.report["attention"].append(
            {"layer": layer, "layout": "tensor", "heads": f"{n} -> {local}", "q": q.weight.attr.target,
             "kv_b": w.attr.target, "o": o.weight.attr.target,
             "why": f"configured (attention: tensor): {local} of {n} heads per rank, o_proj row-parallel + all-reduce"}
        )


def check_data_parallel_options(opts: "ShardOptions") -> None:
    """`attention: data` runs each rank's own tokens through every layer, so every layer after attention
    must take a rank's own tokens whole: routed experts expert-parallel (`ep_moe_experts`, tokens
    local); dense/shared MLPs replicated, or tensor-parallel over every rank's tokens (all-gather
    before, reduce-scatter after: `_insert_gather_scatter`). Anything else is refused here, at
    planning, naming the values and what to set."""
    if opts.attention != "data":
        return
    bad = []
    if opts.experts != "expert":
        bad.append(f"experts={opts.experts} (set transforms.shard.experts=expert: each rank dispatches its own "
                   "tokens to the experts' owners)")
    if bad:
        raise ShardError(
            "shard: attention=data (data-parallel attention: every rank runs its own sequences) cannot be combined "
            f"with {' and '.join(bad)}. Tensor-parallel experts under data-parallel attention are not built "
            "(dense and shared-expert MLPs are: mlp=tensor; docs/parallel_layouts.md); or set "
            "transforms.shard.attention=tensor."
        )


def _plan_data_attention(gm: GraphModule, plan: _Plan) -> None:
    """`attention: data`: every MLA node keeps all its heads and weights (replicated), no partial sum,
    no all-reduce; each rank attends over its own sequences, in its own cache. Report entries only."""
    for m in [n for n in gm.graph.nodes if _is(n, {TORCH_MLA, TORCH_MLA_SPARSE})]:
        n = m.meta["mla_dims"].num_heads
        plan.report["attention"].append(
            {"layer": m.meta.get("mla_layer", m.name), "layout": "data", "heads": f"{n} (whole)",
             "why": f"configured (attention: data): attention weights replicated on each of the {plan.world} "
                    "ranks; each rank runs its own sequences over its own paged cache and page allocator; "
                    "no all-reduce after o_proj"}
        )


def _family(node: Node) -> Any:
    """Matmuls that can form one MLP: every linear (16-bit or FP8) is one family, a grouped op its own."""
    return _LINEAR if node.target in _LINEARS else node.target


def _gated_inputs(down: Node, grouped: set[Any]) -> Optional[tuple[str, list[Node]]]:
    """The up-projection side of an MLP down projection: ('separate', [gate, up]),
    ('fused', [gate_up]) or ('plain', [up]); None when `down` is not an MLP down projection."""
    x = _skip(down.args[0], _CASTS)
    if _is(x, {aten.mul.Tensor}) and all(isinstance(a, Node) for a in x.args[:2]):
        a, b = (_skip(v, _CASTS) for v in x.args[:2])
        if not _is(a, _ACTIVATIONS):
            a, b = b, a
        if not _is(a, _ACTIVATIONS):
            return None
        g = _skip(a.args[0], _CASTS)
        if (_is(g, _LINEARS) or _is(g, grouped)) and (_is(b, _LINEARS) or _is(b, grouped)):
            if _skip(g.args[0], _CASTS) is _skip(b.args[0], _CASTS) and _family(g) == _family(b) == _family(down):
                return "separate", [g, b]
            return None
        if _is(g, {operator.getitem}) and _is(b, {operator.getitem}) and g.args[0] is b.args[0]:
            ch = g.args[0]
            if {g.args[1], b.args[1]} != {0, 1}:
                return None
            if _is(ch, {aten.chunk.default}) and ch.args[1] == 2 and ch.args[2] in (-1, len(_shape(ch.args[0])) - 1):
                z = ch.args[0]
            elif _is(ch, {aten.split_with_sizes.default}) and len(ch.args[1]) == 2 and ch.args[1][0] == ch.args[1][1] \
                    and (ch.args[2] if len(ch.args) > 2 else 0) in (-1, len(_shape(ch.args[0])) - 1):
                z = ch.args[0]
            else:
                return None
            z = _skip(z, _CASTS)
            if (_is(z, _LINEARS) or _is(z, grouped)) and _family(z) == _family(down):
                return "fused", [z]
        return None
    if _is(x, _ACTIVATIONS):
        u = _skip(x.args[0], _CASTS)
        if _is(u, _LINEARS) and down.target in _LINEARS:
            return "plain", [u]
    return None


def _plan_mlps(gm: GraphModule, plan: _Plan, opts: "ShardOptions", grouped: set[Any], taken: set[Node],
               unmatched: Optional[dict[str, str]] = None) -> None:
    unmatched = unmatched or {}
    for node in list(gm.graph.nodes):
        if node in taken or not (_is(node, _LINEARS) or _is(node, grouped)):
            continue
        found = _gated_inputs(node, grouped)
        if found is None:
            continue
        kind, ups = found
        down = _Matmul.of(node, grouped)
        up_mms = [_Matmul.of(u, grouped) for u in ups]
        if down is None or any(u is None for u in up_mms):
            continue
        experts = node.target not in _LINEARS
        layer = _layer_of(node)
        inter = down.in_size
        mode = opts.experts if experts else opts.mlp
        what = "experts" if experts else "mlp"
        fallback = ""
        if mode == "expert":  # a region the expert-parallel planner did not recognise (its reason kept)
            # under data-parallel attention the ranks hold different tokens: a tensor-parallel split
            # (partial sums) would be wrong there, the whole experts on every rank are right
            mode = "replicate" if opts.attention == "data" else "tensor"
            fallback = f"; experts=expert but not an experts region it recognises ({unmatched.get(layer, '?')})"
        sizes = [u.out_size for u in up_mms]  # type: ignore[union-attr]
        if (kind == "fused" and sizes != [2 * inter]) or (kind != "fused" and any(s != inter for s in sizes)):
            plan.report["replicated"].append({"layer": layer, "what": what, "why": "projection sizes do not match"})
            continue
        if mode == "replicate" or inter % plan.world:
            why = "configured" if mode == "replicate" else f"intermediate size {inter} not divisible by {plan.world}"
            plan.report["replicated"].append({"layer": layer, "what": what, "why": why + fallback})
            if experts:
                plan.report["experts"].append({"layer": layer, "layout": "replicate", "why": why + fallback})
            taken.update([node, *ups])
            continue
        r = plan.rng(inter)
        hint = (f"; or keep these {what} replicated: transforms.shard."
                f"{'experts' if experts else 'mlp'}=replicate")
        for u in up_mms:
            assert u is not None
            ranges = (r, plan.rng(inter, inter)) if kind == "fused" else (r,)
            plan.add_weight(u.weight, ShardSpec(u.out_axis, ranges, f"{what}: column-parallel"), u.node, hint)
            if u.bias is not None:
                plan.add(u.bias.target, ShardSpec(0, ranges, f"{what}: column bias"), u.node)
        plan.add_weight(down.weight, ShardSpec(down.in_axis, (r,), f"{what}: row-parallel"), node, hint)
        if down.bias is not None:
            plan.add(down.bias.target, ShardSpec(0, ((0, int(_shape(down.bias)[0])),), f"{what}: row bias (rank 0)",
                                                 zero=plan.rank != 0), node)
        gather = opts.attention == "data" and not experts
        if gather:  # the ranks hold different tokens: all of them through the split MLP, each rank's rows back
            plan.gathered.append((ups, node))
        else:
            plan.partial.append(node)
        taken.update([node, *ups])
        plan.report["mlp"].append(
            {"layer": layer, "what": what, "kind": kind, "intermediate": f"{inter} -> {inter // plan.world}",
             "down": down.weight.attr.target,
             "layout": ("tensor over every rank's tokens: all-gather before, reduce-scatter after (attention: data)"
                        if gather else "tensor: all-reduce after")}
        )
        if experts:
            plan.report["experts"].append(
                {"layer": layer, "layout": "tensor", "intermediate": f"{inter} -> {inter // plan.world}",
                 "why": ("configured (experts: tensor)" if not fallback else "tensor-parallel instead" + fallback)
                 + ": every rank holds every expert's 1/world of the intermediate size; one all-reduce"})


# ----------------------------------------------------------------------------- expert parallelism
@dataclass
class _EPLayer:
    """One MoE layer planned expert-parallel: its matched experts region and how the op will run."""

    match: Any  # fuse_moe.ExpertsMatch
    fp8: Optional[tuple]  # fuse_moe.fp8_experts(match): (w_up, w_up_scale, w_down, w_down_scale, bn, bk) get_attrs
    backend: str
    entry: dict[str, Any]
    #: ep_moe_experts' token mode: replicated (tensor-parallel attention) or local (data-parallel)
    tokens: str = "replicated"


def _plan_expert_parallel(gm: GraphModule, plan: _Plan, opts: "ShardOptions", grouped: set[Any], taken: set[Node],
                          ctx: BuildContext) -> tuple[list[_EPLayer], dict[str, str]]:
    """`experts: expert`: every routed-experts region (transformers' grouped_mm forward, matched as
    fuse_moe matches it) keeps this rank's contiguous block of E/W experts — weights and FP8 scale
    grids sliced along the expert dim, so checkpoints and `init: hashed` give only those experts —
    and will become one `ep_moe_experts` node. The router stays as it is (replicated: every rank
    routes the same tokens). Returns the layers and, per layer not recognised, why (those stay
    tensor-parallel). Raises before any change when W does not divide E."""
    from .fuse_moe import _NoMatch, fp8_experts, match_experts

    layers: list[_EPLayer] = []
    unmatched: dict[str, str] = {}
    bad: list[str] = []
    for sort in [n for n in gm.graph.nodes if _is(n, {aten.sort.default, aten.sort.stable})]:
        try:
            m = match_experts(sort, grouped)
        except _NoMatch as exc:
            unmatched[_layer_of(sort)] = str(exc)
            continue
        if m.num_experts % plan.world:
            bad.append(f"{_layer_of(m.out)} (E={m.num_experts})")
        layers.append(_EPLayer(m, fp8_experts(m), "", {}))
    if bad:
        counts = sorted({lay.match.num_experts for lay in layers})
        heads = [d.num_heads for _, d in plan.mla_nodes]  # data-parallel attention: none (heads stay whole)
        ok = [w for w in range(1, max(counts) + 1)
              if all(e % w == 0 for e in counts) and all((h * plan.world) % w == 0 for h in heads)]
        raise ShardError(
            f"shard: experts=expert with world_size={plan.world}: the routed expert count of {', '.join(bad)} is "
            f"not divisible by {plan.world}; expert parallelism gives each rank E / world_size whole experts. "
            f"World sizes that divide the experts and the heads: {', '.join(map(str, ok))}; or set "
            "transforms.shard.experts=tensor (each expert split by its intermediate size)."
        )
    for lay in layers:
        m = lay.match
        local = m.num_experts // plan.world
        lo, hi = plan.rank * local, (plan.rank + 1) * local
        users = {}
        for w_arg in (m.w_up, m.w_down):
            user = next(n for n in m.region if _is(n, grouped) and n.args[1] is w_arg)
            ref = _trace_weight(w_arg)
            if ref is None:
                raise ShardError(f"shard: {_layer_of(m.out)}: the experts' weight {w_arg.name} is not a model weight; "
                                 "set transforms.shard.experts=tensor or replicate")
            plan.add_weight(ref, ShardSpec(ref.axes[0], ((lo, hi),), f"experts: expert-parallel [{lo}, {hi})"), user)
            users[user] = ref
        taken.update(users)
        wv = val(m.w_up)
        dtype = wv.dtype if wv is not None else None
        if opts.expert_backend == "torch":
            backend, why = "torch", "expert_backend: torch (the reference op)"
        else:
            found, why = resolve_moe_backend("experts", opts.expert_backend, ctx.target.device, dtype=dtype)
            backend = found or "torch"
            if found is None:  # fuse_moe would keep the model's experts here; EP needs an op: the reference
                why = "torch reference (auto takes the Triton kernels on CUDA only)"
        lay.backend = backend
        coll, coll_why = ep_collective_of(opts)
        if opts.attention == "data":
            lay.tokens = "local"
            routing = (f"routing local (attention is data-parallel: each rank routes its own tokens), each rank "
                       f"dispatches its own tokens by {coll}; every rank runs each step padded to the "
                       "size the ranks agreed on before it (the busiest rank's step, runtime/data_parallel.py), so "
                       "all pass the same token count (capacity=0) and an idle rank still takes part")
        else:
            routing = (f"routing replicated (every rank routes the same tokens: attention is tensor-parallel), each "
                       f"rank dispatches its 1/{plan.world} of the tokens by {coll} and all-gathers "
                       "the outputs")
        lay.entry = {
            "layer": _layer_of(m.out), "layout": "expert", "experts": f"{m.num_experts} -> {local} per rank",
            "local_experts": [lo, hi], "collective": coll, "collective_why": coll_why, "tokens": lay.tokens,
            "capacity": 0,  # every rank passes the same token count (tokens local: the lock-step pads steps)
            "backend": backend, "weights": f"fp8 blocks [{lay.fp8[4]}, {lay.fp8[5]}]" if lay.fp8 else "16-bit",
            "why": (f"configured (experts: expert); {m.num_experts} experts / {plan.world} ranks; {routing}; "
                    f"per-rank experts op: {why}"),
        }
        plan.report["experts"].append(lay.entry)
    return layers, unmatched


def ep_collective_of(opts: "ShardOptions") -> tuple[str, str]:
    """(the collective the EP layers use, why). auto under data-parallel attention takes the all-gather +
    reduce-scatter: with static per-rank capacity both schemes move the same rows (every rank pair
    exchanges `capacity` rows either way) and the all-to-all adds its packing kernels; measured on 2
    H200s (GLM-4.7-Flash, batch 64 x 1k decode): 14.2 ms per step vs 16.6 ms
    (docs/benchmarks/parallel_layouts.md). Under tensor-parallel attention it is unmeasured: all_to_all."""
    if opts.ep_collective != "auto":
        return opts.ep_collective, f"ep_collective: {opts.ep_collective} (configured)"
    if opts.attention == "data":
        return "allgather_reducescatter", ("ep_collective auto: allgather_reducescatter under data-parallel attention "
                                           "(same rows moved as the all-to-all, fewer kernels; measured faster)")
    return "all_to_all", "ep_collective auto: all_to_all (tensor-parallel attention: the two schemes unmeasured)"


def _rewrite_expert_parallel(gm: GraphModule, plan: _Plan, layers: list[_EPLayer], group: str,
                             collective: str) -> None:
    """Each planned region -> ep_moe_experts(x, ids, weights, w_up, w_down, scales?, E, rank, W, group, ...)
    on this rank's (already sliced) expert weights; the region's ops go."""
    from .fuse_moe import _weight_out_in
    from .fx_utils import erase_dead_region

    g = gm.graph
    for lay in layers:
        m = lay.match
        x = m.x
        if lay.fp8 is not None:
            wu, su, wd, sd, bn, bk = lay.fp8
            wdtype = val(x).dtype if val(x) is not None else None
        else:
            wu, wd = _weight_out_in(g, m.w_up), _weight_out_in(g, m.w_down)
            su = sd = None
            bn = bk = 0
            wdtype = val(m.w_up).dtype if val(m.w_up) is not None else None
        with g.inserting_before(m.out):
            if wdtype is not None and val(x) is not None and val(x).dtype != wdtype:
                x = g.call_function(aten.to.dtype, (x, wdtype))
            node = g.call_function(EP_MOE_EXPERTS, (x, m.topk_ids, m.topk_weights, wu, wd, su, sd, m.num_experts,
                                                    plan.rank, plan.world, group, collective, lay.tokens,
                                                    0, lay.backend, bn, bk, "silu"))
            result = node
            out_dtype = val(m.out).dtype if val(m.out) is not None else None
            if out_dtype is not None and wdtype is not None and out_dtype != wdtype:
                result = g.call_function(aten.to.dtype, (node, out_dtype))
        node.meta["nn_module_stack"] = m.out.meta.get("nn_module_stack", {})
        node.meta["ep_layout"] = dict(lay.entry)
        m.out.replace_all_uses_with(result)
        erase_dead_region(g, m.region)
    if layers:
        g.eliminate_dead_code()  # the regions' index arithmetic and the FP8 dequantize nodes


# ----------------------------------------------------------------------------- rewriting
def _insert_gather_scatter(gm: GraphModule, regions: list[tuple[list[Node], Node]], world: int, group: str) -> int:
    """Data-parallel attention + a tensor-parallel MLP: its up projections read every rank's tokens
    (all-gather along the token-leading dim 0, in rank order; every rank's step has the agreed size,
    runtime/data_parallel.py) and its down projection's partial sums go back summed, each rank its
    own rows (reduce-scatter along dim 0). Returns the number of collectives inserted."""
    graph, count = gm.graph, 0
    for ups, down in regions:
        gathered: dict[Node, Node] = {}
        for u in ups:
            x = u.args[0]
            if x not in gathered:  # right after its input: before every up projection that reads it
                gathered[x] = _collective(graph, x, ALL_GATHER, (x, world, group), "all_gather")
                count += 1
            u.replace_input_with(x, gathered[x])
        users = list(down.users)
        mine = _collective(graph, down, REDUCE_SCATTER, (down, "sum", world, group), "reduce_scatter")
        count += 1
        for user in users:
            user.replace_input_with(down, mine)
    return count


def _linear_in(user: Node, partial: set[Node]) -> bool:
    """Is `user` linear in its partial-sum inputs (so its output is a partial sum too)?"""
    if user.op != "call_function":
        return False
    t = user.target
    tensor_args = [a for a in user.args if isinstance(a, Node)]
    flat = [a for a in user.args if isinstance(a, (list, tuple))]
    if any(isinstance(x, Node) and x in partial for lst in flat for x in lst):
        return False  # a partial sum inside a list argument (indices, cat): reduce it first
    p_args = [a for a in tensor_args if a in partial]
    if t in _PASSTHROUGH or t in (aten.sum.dim_IntList, aten.sum.default, aten.neg.default, aten.index.Tensor,
                                   aten.index_select.default, aten.gather.default):
        return bool(user.args) and user.args[0] in partial and len(p_args) == 1
    if t in (aten.mul.Tensor, aten.mul_.Tensor):
        return len(p_args) == 1
    if t in (aten.div.Tensor, aten.div_.Tensor):
        return len(p_args) == 1 and user.args[0] in partial
    if t in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor):
        others = [a for a in user.args[:2] if not (isinstance(a, Node) and a in partial)]
        return not others
    return False


def _insert_all_reduces(gm: GraphModule, sources: list[Node], group: str, algorithm: str) -> int:
    partial: set[Node] = set(sources)
    reduced: dict[Node, Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "output":
            needs = [a for a in node.all_input_nodes if a in partial]
        elif node in partial or not any(a in partial for a in node.all_input_nodes):
            continue
        elif _is(node, {_ASSERT}):
            continue
        elif _linear_in(node, partial):
            partial.add(node)
            continue
        else:
            needs = [a for a in node.all_input_nodes if a in partial]
        for p in needs:
            if p not in reduced:
                reduced[p] = insert_all_reduce(gm.graph, p, group, algorithm)
                count += 1
            node.replace_input_with(p, reduced[p])
    return count


def _slice_weights(gm: GraphModule, plan: _Plan) -> dict[str, Any]:
    """Replace every planned weight of the graph by this rank's slice (placeholders stay placeholders)."""
    full = kept = 0
    for target, spec in plan.specs.items():
        t = module_tensor(gm, target)
        full += t.numel() * t.element_size()
        s = spec.slice(t.detach())
        kept += s.numel() * s.element_size()
        set_module_tensor(gm, target, s)
    return {"sharded_bytes_before": full, "sharded_bytes_after": kept}


@register_pass("shard", ShardOptions, stage=Stage.SHARD, requires=("export",), refresh_shapes=True)
def shard(ctx: BuildContext, opts: ShardOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    check_data_parallel_options(opts)  # refused combinations: at any world size, before anything changes
    world = ctx.world
    if world is None or world.world_size == 1:
        return PassResult("world_size 1: nothing to shard", {"world_size": 1})
    if not any(_is(n, {TORCH_MLA, TORCH_MLA_SPARSE}) for n in gm.graph.nodes):
        raise ShardError("shard: the graph has no torch_mla node; run match_mla first (shard goes between "
                         "match_mla and insert_cached_mla_attention)")
    grouped = grouped_mm_ops()
    plan = _Plan(world.world_size, world.rank)
    data = opts.attention == "data"
    if data:
        _plan_data_attention(gm, plan)
    else:
        _plan_attention(gm, plan, grouped)  # raises before any change on a bad world size
    taken = {x for x in plan.owners.values()}
    ep_layers: list[_EPLayer] = []
    unmatched: dict[str, str] = {}
    if opts.experts == "expert":  # raises before any change when world_size does not divide E
        ep_layers, unmatched = _plan_expert_parallel(gm, plan, opts, grouped, taken, ctx)
    _plan_mlps(gm, plan, opts, grouped, taken, unmatched)
    if data and plan.partial:  # the options check makes this unreachable; a partial sum here would be wrong
        raise ShardError(f"shard: attention=data but {', '.join(n.name for n in plan.partial)} would be split "
                         "tensor-parallel over ranks that hold different tokens")

    # 1. weights -> this rank's slices (or placeholders of that shape, for load_weights to fill)
    weights = _slice_weights(gm, plan)
    # 2. head-count literals
    for node, idx, value in plan.head_views:
        shape = list(node.args[1])
        shape[idx] = value
        node.args = (node.args[0], shape, *node.args[2:])
    # 3. expert-parallel MoE regions -> ep_moe_experts (complete outputs: no all-reduce after them)
    _rewrite_expert_parallel(gm, plan, ep_layers, world.group, ep_collective_of(opts)[0])
    # 4. all-reduce where partial sums meet replicated values; under attention: data, all-gather /
    #    reduce-scatter around each tensor-parallel MLP instead
    n_ar = _insert_all_reduces(gm, plan.partial, world.group, opts.all_reduce)
    n_gs = _insert_gather_scatter(gm, plan.gathered, world.world_size, world.group)
    # 5. per-node dims (the manager re-propagates shapes after the pass; cache insertion checks both agree)
    for m, dims in plan.mla_nodes:
        m.meta["mla_dims"] = dims
    ctx.artifacts.shard_specs = dict(plan.specs)
    ctx.artifacts.tp = TensorParallel(world.world_size, world.rank, world.group, n_ar, opts.all_reduce,
                                      opts.one_shot_max_bytes if opts.all_reduce == "one_shot" else 0,
                                      attention=opts.attention)
    rep = plan.report
    n_att, n_mlp = len(rep["attention"]), len(rep["mlp"])
    heads = rep["attention"][0]["heads"] if rep["attention"] else "-"
    summary = (f"world {world.world_size} rank {world.rank}: "
               + (f"{n_att} MLA layers data-parallel (heads {heads}), " if data else f"{n_att} MLA layers (heads {heads}), ")
               + f"{n_mlp} MLP/expert "
               f"blocks split, {len(rep['replicated'])} replicated, "
               + (f"{len(ep_layers)} MoE layers expert-parallel ({ep_collective_of(opts)[0]}), " if ep_layers else "")
               + f"{n_ar} all-reduces"
               + (f", {n_gs} all-gathers / reduce-scatters around {len(plan.gathered)} tensor-parallel MLPs"
                  if plan.gathered else "")
               + (f" (one-shot up to {opts.one_shot_max_bytes} B)" if opts.all_reduce == "one_shot" else ""))
    details = {"world_size": world.world_size, "rank": world.rank, "attention_layout": opts.attention,
               "all_reduces": n_ar, "gather_scatter": n_gs,
               "all_reduce": opts.all_reduce, "weights": weights, **rep,
               "rules": {t: {"dim": s.dim, "ranges": s.ranges, "rule": s.rule, "zero": s.zero}
                         for t, s in plan.specs.items()}}
    return PassResult(summary, details)


__all__ = ["ShardError", "ShardOptions", "check_data_parallel_options", "shard", "insert_all_reduce", "count_all_reduces", "ALL_REDUCE",
           "COLLECTIVE_OPS"]
