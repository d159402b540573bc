"""`fuse_routing`: each MoE router's post-GEMM op soup -> one routing op (issue 13, fused MoE).

transformers' MLA routers (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, GLM-5, Mistral-Small-4) turn the gate
GEMM's logits into (top-k weights, top-k expert ids) with 3-15 ATen ops per MoE layer: softmax or
sigmoid, a correction bias, group scores (view, topk(2), sum or max), a group top-k, a scattered
mask, masked_fill, the expert top-k, gather, normalisation, scaling. On an H200 the grouped routers
cost GLM-4.7-Flash ~7 kernels (three of them sort-based `topk`s) per layer, >1 ms of a decode step
(docs/benchmarks/e2e_profile.md). `autodeploy::<backend>_moe_route` does it in one op
(custom_ops/moe/routing.py).

How a router is found and proven equal, per layer:
1. Its nodes are the ones export attributed to one module (`nn_module_stack`) holding a softmax or
   sigmoid and a `topk`; the logits are the score function's input.
2. What leaves the module must be exactly one float [T, k] tensor (weights) and one int64 [T, k]
   tensor (ids), besides the logits; an in-place op inside may only touch the module's own tensors.
3. The routing's kinds come from the graph (score function, bias add, masked_fill value, group
   max or top-2 sum, gather or top-k values, normalisation), its numbers from the module's
   attributes (top_k, num_group / n_group, topk_group, routed_scaling_factor), cross-checked.
4. A self-check runs the module's own `forward` on random fp32 weights and tokens (CPU, at build
   time) and compares its weights and ids with the routing op's reference: any difference keeps the
   model's routing, with the reason in the report.
5. Option `gate_gemm` (on): a bias-free fp32 gate GEMM whose logits feed only the score function goes
   into the op too (`<backend>_moe_gate_route`). The Triton op computes it from the bf16 / fp16
   operands on tensor cores with fp32 sums: the same exact products, summed in another order than
   the SIMT sgemm the fp32 linear runs (~20 µs per layer of a 2048-token step on an H200), and no
   fp32 copy of the hidden states. A gate GEMM in the model dtype (Mistral-Small-4) stays the model's.

Backends: `auto` (default): the Triton kernel compiled on CUDA, the reference elsewhere and under
TRITON_INTERPRET=1 (an interpreted kernel is for tests that ask for it); `triton`; `torch`: the reference, HF's own calls in one op, so on
CPU a fused model computes bitwise what the HF model does (every CPU family test runs through it).
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Literal, Optional

import torch
from pydantic import Field
from torch.fx import GraphModule, Node

from ..custom_ops.moe.backends import resolve_moe_backend
from ..custom_ops.moe.routing import HALF_DTYPES, RoutingSpec, route_reference
from .context import BuildContext
from .fx_utils import ASSERT_METADATA, CASTS, aten, erase_dead_region, is_op, module_stack, shape, val
from .registry import PassOptions, PassResult, Stage, register_pass

RoutingBackendName = Literal["auto", "triton", "torch"]
_OPS = {"torch": torch.ops.autodeploy.torch_moe_route.default, "triton": torch.ops.autodeploy.triton_moe_route.default}
_GATE_OPS = {"torch": torch.ops.autodeploy.torch_moe_gate_route.default,
             "triton": torch.ops.autodeploy.triton_moe_gate_route.default}
_SCORES = {aten.sigmoid.default, aten.softmax.int, aten._softmax.default}
_TOPK = {aten.topk.default}
_MASKED_FILL = {aten.masked_fill.Scalar}
_GROUP_MAX = {aten.max.dim, aten.amax.default}
_DIVS = {aten.div.Tensor, aten.div_.Tensor}
_GATHER = {aten.gather.default}
_ADD = {aten.add.Tensor}
SELF_CHECK_TOKENS = 13


class _NoMatch(Exception):
    """The module is not a router this pass can replace; the message says why."""


def _paths(node: Node) -> list[str]:
    return [p for p, _ in module_stack(node)]


def router_regions(gm: GraphModule) -> dict[str, list[Node]]:
    """Router module path -> its nodes in graph order (every node export attributed to it), for the
    modules whose own nodes hold a score function and a top-k. Two passes over the graph in all, not
    one per router."""
    seen: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        if is_op(n, _SCORES) or is_op(n, _TOPK):
            stack = _paths(n)
            if stack:
                seen.setdefault(stack[-1], set()).add("score" if is_op(n, _SCORES) else "topk")
    regions: dict[str, list[Node]] = {p: [] for p, kinds in seen.items() if kinds == {"score", "topk"}}
    if regions:
        for n in gm.graph.nodes:
            for p in _paths(n):
                if p in regions:
                    regions[p].append(n)
    return regions


def router_paths(gm: GraphModule) -> list[str]:
    """The routers' module paths, in graph order."""
    return list(router_regions(gm))


def _outside_users(node: Node, region: set[Node]) -> list[Node]:
    return [u for u in node.users if u not in region and not is_op(u, {ASSERT_METADATA})]


def _const(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class RouterMatch:
    """One router's region in the graph and what replaces it."""

    def __init__(self, nodes: list[Node], path: str, module: torch.nn.Module):
        """`nodes`: the router's nodes in graph order (router_regions)."""
        self.path = path
        self.nodes = nodes
        self.region = set(nodes)
        scores = [n for n in nodes if is_op(n, _SCORES)]
        if len(scores) != 1:
            raise _NoMatch(f"{len(scores)} softmax/sigmoid nodes, expected 1")
        self.score_node = scores[0]
        self.logits: Node = self.score_node.args[0]
        if is_op(self.score_node, {aten.softmax.int, aten._softmax.default}) and self.score_node.args[1] not in (-1, 1):
            raise _NoMatch(f"softmax over dim {self.score_node.args[1]}, expected the experts' (-1)")
        lv, sv = val(self.logits), val(self.score_node)
        if lv is None or sv is None or lv.dim() != 2:
            raise _NoMatch("the logits are not a [T, E] tensor with a known shape")
        self.num_experts = int(lv.shape[1])
        self.score_dtype = sv.dtype

        # what leaves the module: the weights and the ids (the logits may be used outside too)
        weights = ids = None
        upstream = self._ancestors_in_region(self.logits)
        for n in nodes:
            if not _outside_users(n, self.region) or n in upstream or n is self.logits:
                continue
            v = val(n)
            if v is None or v.dim() != 2:
                raise _NoMatch(f"{n.name} leaves the router and is not a [T, k] tensor")
            if v.dtype == torch.int64 and ids is None:
                ids = n
            elif v.is_floating_point() and weights is None:
                weights = n
            else:
                raise _NoMatch(f"more leaves the router than its weights and ids ({n.name}, {v.dtype})")
        if weights is None or ids is None:
            raise _NoMatch("the router's weights and ids are not both used outside it")
        self.weights_out, self.ids_out = weights, ids
        if tuple(val(weights).shape)[1] != tuple(val(ids).shape)[1]:
            raise _NoMatch(f"weights {tuple(val(weights).shape)} and ids {tuple(val(ids).shape)} disagree")
        for n in nodes:  # an in-place op may only write tensors the router made itself
            if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
                target = n.args[0]
                if target not in self.region or target in upstream or target is self.logits:
                    raise _NoMatch(f"{n.name} ({n.target}) writes a tensor from outside the router")
        self.bias = self._bias()
        self.spec = self._spec(module, nodes)

    def gate_operands(self) -> tuple[Node, Node]:
        """(hidden states [T, H], gate weight [E, H]) of a bias-free fp32 gate GEMM whose logits feed
        only the score function: what `gate_gemm` folds into the routing op."""
        lin = self.logits
        if not is_op(lin, {aten.linear.default}) or (len(lin.args) > 2 and lin.args[2] is not None):
            raise _NoMatch("the logits are not a bias-free linear")
        if val(lin).dtype != torch.float32:
            raise _NoMatch(f"the gate GEMM computes in {val(lin).dtype}, not fp32")
        if [u for u in lin.users if not is_op(u, {ASSERT_METADATA})] != [self.score_node]:
            raise _NoMatch("the logits are used besides the score function")
        x, w = lin.args[:2]
        while is_op(x, CASTS):
            x = x.args[0]
        while is_op(w, CASTS):
            w = w.args[0]
        if len(shape(x)) != 2 or shape(w) != (self.num_experts, shape(x)[1]):
            raise _NoMatch(f"gate GEMM operands {shape(x)} x {shape(w)} are not [T, H] x [E, H]")
        return x, w

    def _ancestors_in_region(self, node: Node) -> set[Node]:
        out: set[Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a in self.region and a not in out:
                    out.add(a)
                    stack.append(a)
        return out

    def _bias(self) -> Optional[Node]:
        adds = [u for u in self.score_node.users if is_op(u, _ADD)]
        if not adds:
            return None
        if len(adds) != 1:
            raise _NoMatch("the scores are added to more than one tensor")
        other = [a for a in adds[0].args[:2] if a is not self.score_node]
        if len(other) != 1 or not isinstance(other[0], Node) or shape(other[0]) != (self.num_experts,):
            raise _NoMatch(f"the scores are added to something other than a [{self.num_experts}] bias")
        return other[0]

    def _spec(self, module: torch.nn.Module, nodes: list[Node]) -> RoutingSpec:
        topks = [n for n in nodes if is_op(n, _TOPK)]
        final = next((t for t in topks if any(u.target is operator.getitem and u.args[1] == 1 and
                                                   (u is self.ids_out) for u in t.users)), None)
        if final is None:
            raise _NoMatch("the ids do not come from a top-k")
        top_k = int(final.args[1])
        fills = [n for n in nodes if is_op(n, _MASKED_FILL)]
        if len(fills) > 1:
            raise _NoMatch(f"{len(fills)} masked_fill nodes, expected at most 1")
        n_group = int(getattr(module, "num_group", getattr(module, "n_group", 1)) or 1)
        topk_group = int(getattr(module, "topk_group", 1) or 1)
        fill, group_score = 0.0, "top2sum"
        if fills:
            f = _const(fills[0].args[2])
            if f is None:
                raise _NoMatch("masked_fill with a non-constant value")
            fill = f
            group_score = "max" if any(is_op(n, _GROUP_MAX) for n in nodes) else "top2sum"
            if group_score == "top2sum" and not any(is_op(t, _TOPK) and t.args[1] == 2 and len(shape(t.args[0])) == 3
                                                    for t in topks):
                raise _NoMatch("groups are scored neither by max nor by a top-2 sum")
            if not 1 <= topk_group <= n_group or self.num_experts % n_group:
                raise _NoMatch(f"module's n_group={n_group}, topk_group={topk_group} do not fit "
                               f"{self.num_experts} experts")
        else:
            n_group = topk_group = 1  # no mask: every expert competes (DeepSeek-V2 'greedy')
        gathers = [n for n in nodes if is_op(n, _GATHER)]
        if gathers:
            if len(gathers) != 1 or gathers[0].args[0] is not self.score_node:
                raise _NoMatch("the weights are gathered from something other than the scores")
            weights_from = "scores"
        else:
            weights_from = "choice"  # the top-k's own values (of the masked scores)
        renorm = any(is_op(n, _DIVS) for n in nodes)
        if renorm != bool(getattr(module, "norm_topk_prob", False)):
            raise _NoMatch(f"the graph {'does' if renorm else 'does not'} normalise the weights but the module's "
                           f"norm_topk_prob is {getattr(module, 'norm_topk_prob', None)}")
        if getattr(module, "top_k", top_k) != top_k:
            raise _NoMatch(f"the graph picks {top_k} experts, the module's top_k is {module.top_k}")
        scale = _const(getattr(module, "routed_scaling_factor", 1.0))
        if scale is None:
            raise _NoMatch("the module's routed_scaling_factor is not a number")
        score = "sigmoid" if is_op(self.score_node, {aten.sigmoid.default}) else "softmax"
        return RoutingSpec(top_k, n_group, topk_group, score, group_score, fill, weights_from, renorm, scale)


def self_check(module: torch.nn.Module, spec: RoutingSpec, has_bias: bool, num_experts: int) -> None:
    """Run the module's forward on random fp32 weights and tokens and compare with route_reference.

    Raises _NoMatch with what differed. The module is not modified (a shallow copy gets the weights)."""
    hidden = getattr(module, "hidden_dim", None) or getattr(getattr(module, "config", None), "hidden_size", None)
    weight = module._parameters.get("weight")
    if weight is None or not hidden:
        raise _NoMatch("self-check: the module has no `weight` parameter or hidden size")
    g = torch.Generator().manual_seed(num_experts * 31 + spec.top_k)
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    probe._buffers = dict(module._buffers)
    probe._parameters["weight"] = torch.nn.Parameter(torch.randn(num_experts, hidden, generator=g),
                                                     requires_grad=False)
    bias = None
    for name, b in module._buffers.items():
        if b is not None and tuple(b.shape) == (num_experts,):
            bias = torch.randn(num_experts, generator=g) * 0.5
            probe._buffers[name] = bias
    if (bias is not None) != has_bias:
        raise _NoMatch(f"self-check: the graph {'adds' if has_bias else 'adds no'} correction bias, the module "
                       f"{'has' if bias is not None else 'has no'} [E] buffer")
    x = torch.randn(SELF_CHECK_TOKENS, hidden, generator=g)
    try:
        with torch.no_grad():
            out = probe(x)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the model's routing
        raise _NoMatch(f"self-check: the module's forward failed on CPU fp32 ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(out, tuple) and len(out) == 3):
        raise _NoMatch("self-check: the module does not return (logits, weights, ids)")
    logits, w_ref, ids_ref = out
    w, ids = route_reference(logits, bias, spec)
    o_ref, o = ids_ref.argsort(-1), ids.argsort(-1)
    if not torch.equal(ids_ref.gather(1, o_ref), ids.gather(1, o)):
        raise _NoMatch(f"self-check: the routing op picks other experts than the module ({spec})")
    if not torch.allclose(w_ref.gather(1, o_ref).float(), w.gather(1, o).float(), rtol=1e-6, atol=1e-7):
        raise _NoMatch(f"self-check: the routing op's weights differ from the module's ({spec})")


def rewrite(gm: GraphModule, m: RouterMatch, backend: str, gate: Optional[tuple[Node, Node]] = None) -> Node:
    """Replace the router's routing by one op; with `gate` = RouterMatch.gate_operands(), the op also
    computes the gate GEMM (the linear and its casts go too)."""
    g = gm.graph
    anchor = max((m.weights_out, m.ids_out), key=m.nodes.index)  # the later one (graph order)
    meta_stack = m.score_node.meta.get("nn_module_stack", {})
    with g.inserting_before(anchor):
        logits = m.logits
        if gate is not None:
            op = g.call_function(_GATE_OPS[backend], (*gate, m.bias, *m.spec.args()))
        else:
            if val(logits).dtype != m.score_dtype:
                logits = g.call_function(aten.to.dtype, (logits, m.score_dtype))
            op = g.call_function(_OPS[backend], (logits, m.bias, *m.spec.args()))
        w = g.call_function(operator.getitem, (op, 0))
        ids = g.call_function(operator.getitem, (op, 1))
        if val(m.weights_out).dtype != m.score_dtype:
            w = g.call_function(aten.to.dtype, (w, val(m.weights_out).dtype))
    # the outputs' shapes are the replaced nodes' (no shape re-propagation over the whole graph)
    wv, iv = val(m.weights_out), val(m.ids_out)
    op_w = wv if wv.dtype == m.score_dtype else wv.to(m.score_dtype)
    op.meta["val"] = (op_w, iv)
    if logits is not m.logits:
        logits.meta["val"] = val(m.logits).to(m.score_dtype)
    w.meta["val"] = wv
    if w.args[0] is not op:  # the cast back to the weights' dtype
        w.args[0].meta["val"] = op_w
    ids.meta["val"] = iv
    for n in (op, w, ids, logits, w.args[0]):
        n.meta.setdefault("nn_module_stack", meta_stack)
    m.weights_out.replace_all_uses_with(w, delete_user_cb=lambda u: u not in m.region)
    m.ids_out.replace_all_uses_with(ids, delete_user_cb=lambda u: u not in m.region)
    dead = m.region - ({m.logits} if gate is None else set())  # the model's gate GEMM stays unless folded in
    erase_dead_region(g, dead)
    return op


# ----------------------------------------------------------------------------- the pass
class FuseRoutingOptions(PassOptions):
    backend: RoutingBackendName = Field("auto", description="auto (triton on CUDA) | triton | torch (reference)")
    self_check: bool = Field(True, description="prove each router equal on random inputs at build time")
    gate_gemm: bool = Field(True, description="take the fp32 gate GEMM into the op: the Triton backend runs it "
                                              "on tensor cores from bf16/fp16 operands with fp32 sums")


@register_pass("fuse_routing", FuseRoutingOptions, stage=Stage.FUSE, requires=("export",))
def fuse_routing(ctx: BuildContext, opts: FuseRoutingOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    layers: list[dict[str, Any]] = []
    fused = 0
    checked: dict[tuple, Optional[str]] = {}  # one self-check per distinct router (class, spec, dims)
    for path, nodes in router_regions(gm).items():
        try:
            if ctx.model is None:
                raise _NoMatch("no model module to read the router's attributes from")
            try:
                module = ctx.model.get_submodule(path)
            except AttributeError as exc:
                raise _NoMatch(f"module {path!r} not found in the model") from exc
            m = RouterMatch(nodes, path, module)
            if opts.self_check:
                key = (type(module), m.spec, m.bias is not None, m.num_experts, getattr(module, "hidden_dim", None))
                if key not in checked:
                    try:
                        self_check(module, m.spec, m.bias is not None, m.num_experts)
                        checked[key] = None
                    except _NoMatch as exc:
                        checked[key] = str(exc)
                if checked[key] is not None:
                    raise _NoMatch(checked[key])
        except _NoMatch as exc:
            layers.append({"layer": path, "backend": None, "reason": f"not replaced: {exc}"})
            continue
        backend, reason = resolve_moe_backend("routing", opts.backend, ctx.target.device,
                                              num_experts=m.num_experts)
        s = m.spec
        entry = {"layer": path, "experts": m.num_experts, "top_k": s.top_k, "score": s.score,
                 "groups": f"{s.topk_group}/{s.n_group} by {s.group_score}" if s.grouped else "none",
                 "bias": m.bias is not None, "renormalize": s.renormalize, "scale": s.scale,
                 "backend": backend, "reason": reason}
        if backend is not None:
            gate = None
            if opts.gate_gemm:
                try:
                    gate = m.gate_operands()
                    half = val(gate[0]).dtype in HALF_DTYPES and val(gate[1]).dtype == val(gate[0]).dtype
                    entry["gate"] = ("in the op: " + (f"{val(gate[0]).dtype} operands on tensor cores, fp32 sums"
                                                      if half and backend == "triton" else "the fp32 GEMM"))
                except _NoMatch as exc:
                    entry["gate"] = f"the model's GEMM: {exc}"
            rewrite(gm, m, backend, gate)
            fused += 1
        layers.append(entry)
    if not layers:
        return PassResult("no MoE routers", {"layers": []})
    kept = len(layers) - fused
    summary = f"{fused} MoE routers fused" + (f" ({next(e['backend'] for e in layers if e['backend'])})"
                                              if fused else "")
    if kept:
        summary += f", {kept} kept: {next(e['reason'] for e in layers if e['backend'] is None)}"
    return PassResult(summary, {"layers": layers})


__all__ = ["FuseRoutingOptions", "RouterMatch", "fuse_routing", "router_paths", "router_regions", "self_check"]
