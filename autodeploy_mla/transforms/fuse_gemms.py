"""`fuse_gemms`: linears that read the same input become one GEMM (issue 13, item 3).

An MLA layer projects its normed hidden state twice — `q_a_proj` (or `q_proj` without a query
LoRA) and `kv_a_proj_with_mqa` — and every gated MLP (dense layers, shared experts) twice more,
`gate_proj` and `up_proj`. Each is a separate GEMM launch that re-reads the same activations; at
decode they are small-M GEMMs where the launch and the ramp cost as much as the bytes. The pass
finds every group of `aten.linear` nodes with the same input tensor, whatever the family or the
dims (AutoDeploy's version matches DeepSeek-V3's exact shapes), concatenates their weights along
the output features and rewrites the group into one linear whose output is sliced back per member.

Memory: the fused weight is one new tensor, and each member's parameter becomes a row-range view
of it (contiguous), so the HF model that shares those parameters keeps working and no weight is
held twice.

A group is refused, with the reason in the report, when a member's weight is reached through a
cast (the MoE router's fp32 gate), is used elsewhere (tied), differs in dtype/device/in-features, or
mixes bias and no bias, or when a view downstream of a member would not accept the sliced output's
strides (checked on the graph's fake values before anything is rewritten).

Block-FP8 linears (`fp8_block_linear`) that share an input fuse the same way into one
`fp8_block_linear`: weights and `weight_scale_inv` grids concatenated along the rows, with the
members' common (block_n, block_k). That is exact when every member but the last ends on a
block_n boundary — a member's rows then never share a scale block with the next member's — so the
members whose N is a multiple of block_n go first and at most one other (DeepSeek-V3's
kv_a_proj_with_mqa: 576 rows) goes last; a group with two such members, or with different block
sizes, is kept and the report says which members and why. FP8 and 16-bit linears never fuse
together.

Runs in FUSE, after `shard` and `load_weights`: it sees each rank's real slices.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_map

from .context import BuildContext
from .fp8_graph import FP8_LINEAR, fp8_linear_parts, is_fp8_linear
from .fx_utils import ASSERT_METADATA, aten, is_op, module_path, module_tensor, val
from .registry import PassOptions, PassResult, Stage, register_pass

_LINEAR = aten.linear.default
#: ops that return a view of their input: a sliced (row-strided) output must still be viewable
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
                    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
                    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.select.int,
                    aten.t.default, aten.alias.default, aten.detach.default, aten.view_as_complex.default,
                    aten.view_as_real.default, aten.view.dtype, aten.unflatten.int, aten.movedim.int})
_REFUSED_VIEWS = frozenset({aten.as_strided.default})  # absolute strides: would read the wrong columns


class _Refused(Exception):
    """The group cannot be fused; the message says why."""


@dataclass
class _Member:
    node: Node
    weight: Node  # get_attr
    bias: Optional[Node]  # get_attr or None
    out_features: int
    scale: Optional[Node] = None  # FP8: the weight_scale_inv get_attr
    block: Optional[tuple[int, int]] = None  # FP8: (block_n, block_k)


def _member(node: Node) -> _Member:
    scale, block = None, None
    if is_fp8_linear(node):
        parts = fp8_linear_parts(node)
        w, b, scale, block = parts.weight, parts.bias, parts.scale, (int(parts.block_n), int(parts.block_k))
    else:
        w = node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    name = module_path(node)
    if not (isinstance(w, Node) and w.op == "get_attr"):
        raise _Refused(f"{name}: its weight is computed ({getattr(w, 'target', w)}), not a parameter")
    if b is not None and not (isinstance(b, Node) and b.op == "get_attr"):
        raise _Refused(f"{name}: its bias is computed, not a parameter")
    if scale is not None and not (isinstance(scale, Node) and scale.op == "get_attr"):
        raise _Refused(f"{name}: its weight_scale_inv is computed, not a parameter")
    for p in (w, b, scale):
        if p is None:
            continue
        uses = [u for n in p.graph.find_nodes(op="get_attr", target=p.target) for u in n.users
                if not is_op(u, {ASSERT_METADATA})]
        if uses != [node]:
            raise _Refused(f"{name}: parameter {p.target} is also used by "
                           f"{', '.join(u.name for u in uses if u is not node)} (tied)")
    wv = val(w)
    if wv is None or wv.dim() != 2 or not all(isinstance(s, int) for s in wv.shape):
        raise _Refused(f"{name}: weight has no static 2-D shape")
    return _Member(node, w, b, int(wv.shape[0]), scale, block)


def _fp8_order(members: list[_Member]) -> list[_Member]:
    """FP8 members in an order whose concatenated scale grid is exact (module doc): those whose N is
    a multiple of block_n first, at most one other last; _Refused otherwise."""
    blocks = {m.block for m in members}
    if len(blocks) != 1:
        raise _Refused("FP8 linears with different block sizes: "
                       + ", ".join(f"{module_path(m.node)} {list(m.block or ())}" for m in members))
    bn = members[0].block[0]  # type: ignore[index]
    whole = [m for m in members if m.out_features % bn == 0]
    partial = [m for m in members if m.out_features % bn]
    if len(partial) > 1:
        raise _Refused(
            "FP8 linears " + ", ".join(f"{module_path(m.node)} (N {m.out_features})" for m in partial)
            + f" do not end on a block_n ({bn}) boundary: concatenated, their last scale block would also cover "
            "the next member's rows; at most one such member (placed last) can join")
    return whole + partial


def _check_views(start: Node, value: torch.Tensor, mode: Any) -> None:
    """Re-run every view that (transitively) reads `start` on `value` (the sliced output's fake
    value): raises _Refused naming the first one that needs other strides."""
    stack: list[tuple[Node, Any]] = [(start, value)]
    while stack:
        node, v = stack.pop()
        for u in node.users:
            if is_op(u, _REFUSED_VIEWS):
                raise _Refused(f"{u.name} ({u.target}) reads the output with absolute strides")
            if u.op == "call_function" and u.target is operator.getitem and isinstance(v, (list, tuple)):
                stack.append((u, v[u.args[1]]))
                continue
            if not is_op(u, _VIEWS):
                continue  # a compute op: takes any strides and makes a new tensor
            args, kwargs = tree_map(lambda a: v if a is node else (val(a) if isinstance(a, Node) else a),
                                    (u.args, u.kwargs))
            try:
                with mode:
                    out = u.target(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any failure means "cannot view"
                raise _Refused(f"{u.name} ({u.target}) cannot view the sliced output: {exc}") from None
            stack.append((u, out))


def _fused_name(members: list[_Member]) -> tuple[str, str]:
    """(parent module path, attribute stem) for the fused parameters."""
    paths = [str(m.weight.target).rsplit(".", 1)[0] for m in members]
    parts = [p.split(".") for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    parent = ".".join(common)
    return parent, "fused_" + "__".join("_".join(p[len(common):]) for p in parts)


def _concat_params(gm: GraphModule, members: list[_Member], attr: str, parent: str, name: str) -> str:
    """Register cat(member params) on `parent` as `name`; make each member's parameter a view of it."""
    tensors = [module_tensor(gm, str(getattr(m, attr).target)) for m in members]  # parameters or buffers
    fused = torch.cat([t.detach() for t in tensors], 0)
    start = 0
    for t in tensors:
        t.data = fused[start:start + t.shape[0]]  # the HF model's parameter: same values, shared storage
        start += t.shape[0]
    owner = gm.get_submodule(parent) if parent else gm
    owner.register_parameter(name, torch.nn.Parameter(fused, requires_grad=False))
    return f"{parent}.{name}" if parent else name


def _fuse(gm: GraphModule, members: list[_Member], order: dict[Node, int]) -> dict[str, Any]:
    graph = gm.graph
    fp8 = members[0].scale is not None
    if fp8:
        members = _fp8_order(members)
    x = members[0].node.args[0]
    first = min((m.node for m in members), key=order.__getitem__)
    wvals = [val(m.weight) for m in members]
    if len({(v.dtype, v.device, int(v.shape[1])) for v in wvals}) != 1:
        raise _Refused("weights differ in dtype, device or in-features: "
                       + ", ".join(f"{tuple(v.shape)} {v.dtype} {v.device}" for v in wvals))
    if len({m.bias is None for m in members}) != 1:
        raise _Refused("some members have a bias and some do not")
    out = val(first)
    bounds, start = [], 0
    for m in members:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([val(x)])
    with mode:
        fused_val = torch.empty((*out.shape[:-1], start), dtype=out.dtype, device=out.device)
        slices = [fused_val[..., a:b] for a, b in bounds]
    for m, s in zip(members, slices):
        _check_views(m.node, s, mode)

    parent, stem = _fused_name(members)
    w_target = _concat_params(gm, members, "weight", parent, stem + "_weight")
    b_target = _concat_params(gm, members, "bias", parent, stem + "_bias") if members[0].bias is not None else None
    s_target = _concat_params(gm, members, "scale", parent, stem + "_weight_scale_inv") if fp8 else None
    with graph.inserting_before(first):
        w = graph.get_attr(w_target)
        b = graph.get_attr(b_target) if b_target else None
        if fp8:
            sc = graph.get_attr(s_target)  # type: ignore[arg-type]
            fused = graph.call_function(FP8_LINEAR, (x, w, sc, b, *members[0].block))  # type: ignore[misc]
        else:
            fused = graph.call_function(_LINEAR, (x, w, b) if b is not None else (x, w))
    fused.meta.update({k: first.meta[k] for k in ("nn_module_stack", "stack_trace") if k in first.meta})
    fused.meta["val"] = fused_val
    for m, (a, e), s in zip(members, bounds, slices):
        with graph.inserting_after(fused):
            sl = graph.call_function(aten.slice.Tensor, (fused, -1, a, e))
        sl.meta.update({k: m.node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in m.node.meta})
        sl.meta["val"] = s
        m.node.replace_all_uses_with(sl)
        graph.erase_node(m.node)
        for p in (m.weight, m.bias, m.scale):
            if p is not None and not p.users:
                graph.erase_node(p)
    out = {"fused_weight": w_target, "out_features": [m.out_features for m in members],
           "in_features": int(wvals[0].shape[1]), "dtype": str(wvals[0].dtype).replace("torch.", "")}
    if fp8:
        out.update({"fused_scale": s_target, "block": list(members[0].block)})  # type: ignore[arg-type]
        out["members"] = [module_path(m.node) for m in members]  # the concatenation order
    return out


@register_pass("fuse_gemms", PassOptions, stage=Stage.FUSE, requires=("export",), refresh_shapes="missing")
def fuse_gemms(ctx: BuildContext, opts: PassOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    groups: dict[tuple[Node, bool], list[Node]] = defaultdict(list)  # (input, FP8?) -> linears
    for n in gm.graph.nodes:
        if is_op(n, {_LINEAR, FP8_LINEAR}) and isinstance(n.args[0], Node):
            groups[(n.args[0], is_fp8_linear(n))].append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # original nodes keep their relative order
    report: list[dict[str, Any]] = []
    fused = 0
    for nodes in (g for g in groups.values() if len(g) > 1):
        entry: dict[str, Any] = {"members": [module_path(n) for n in nodes]}
        members, excluded = [], []
        for n in nodes:  # a member that cannot join (tied, cast weight) leaves the others to fuse
            try:
                members.append(_member(n))
            except _Refused as exc:
                excluded.append(str(exc))
        if excluded:
            entry["excluded"] = excluded
        try:
            if len(members) < 2:
                raise _Refused("; ".join(excluded))
            entry["members"] = [module_path(m.node) for m in members]
            entry.update(_fuse(gm, members, order))
            kind = " FP8 (weights and block scales concatenated)" if members[0].scale is not None else ""
            entry["reason"] = f"{len(members)}{kind} linears on one input -> one GEMM"
            fused += 1
        except _Refused as exc:
            entry["reason"] = f"kept: {exc}"
        report.append(entry)
    if not report:
        return PassResult("no linears share an input", {"groups": []})
    kept = len(report) - fused
    summary = f"{fused} groups of linears on one input fused"
    if kept:
        summary += f", {kept} kept: {next(e['reason'] for e in report if 'fused_weight' not in e)}"
    return PassResult(summary, {"groups": report})


__all__ = ["fuse_gemms"]
