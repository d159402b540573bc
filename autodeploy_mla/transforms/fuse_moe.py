"""`fuse_moe`: HF experts subgraphs -> one fused experts op per MoE layer (issue 13).

transformers' `grouped_mm` experts forward (every MoE family of transformers 5: DeepSeek V2/V3,
GLM-4.7-Flash, Mistral-Small-4, ...) exports as ~30 ATen ops per layer: flatten the top-k ids,
sort them, gather the tokens by `perm // k`, histc + cumsum into offsets, a grouped GEMM into
[gate; up], chunk, silu(gate) * up, a second grouped GEMM, multiply by the permuted routing weights,
un-permute through an `index_put_`-built inverse, view [T, k, H] and sum over k. On an H200 that
region is half the kernels of a decode step besides the GEMMs (docs/benchmarks/e2e_profile.md).

The pass finds each such region structurally, from the `sort` of the flattened ids to the sum over
k, checking every link (shapes, top-k, the shared offsets, gate layout, routing-weight product,
un-permutation) and rewrites it into `autodeploy::<backend>_moe_experts(x, topk_ids, topk_weights,
w_up [E, 2I, H], w_down [E, H, I])`. The router (gate GEMM, softmax/sigmoid, group-limited top-k,
normalisation) stays the model's own code. A region that differs in any link is left alone, with
the reason in the report.

Runs after `shard` (which splits each expert's intermediate size on the grouped GEMM graph; the
op then gets the rank's slices, and the all-reduce after the sum stays where it was).

Shared experts (`shared_experts`: auto | always | never): DeepSeek-V3, GLM-4.7-Flash, Kimi-K2 add a shared
expert MLP to the routed sum (`routed.view(shape) + down(silu(gate(x)) * up(x))`). When its
intermediate size equals the experts' (one shared expert), the pass appends its weights to the
stacked expert weights as expert E and every token's top-k with (E, weight 1): the fused op then
computes it with the routed experts, in the same two GEMM launches, and the shared MLP's own GEMMs,
activation and add disappear (H200, GLM-4.7-Flash shape: 53 -> 44 us per layer at one token, 0.503
-> 0.499 ms at 2048; docs/moe.md). `auto` does it where the shared expert's weights are small
(SHARED_AUTO_MAX_BYTES): DeepSeek-V3's large one ran 1-3% slower in the fused op. Memory: the
stacked weights are one new tensor of E + 1 experts; the experts' and the shared MLP's parameters
become views of it (the HF model keeps working). Two or more shared experts' worth (DeepSeek-V2-Lite)
would need copies (their rows interleave differently), so those stay the model's MLP, with the
reason in the report.
FP8 experts stack an FP8 shared expert the same way, its scale rows with its weights (same block
size, gate/up rows on block_n boundaries; `fuse_shared`).

Backends: `triton` (custom_ops/moe: fused layout + two GEMM kernels), `torch` (the dense reference,
for tests), `auto`: triton where it runs (CUDA SM80+ for 16-bit, or the interpreter), otherwise the
model's own subgraph is kept.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from pydantic import Field
from torch.fx import GraphModule, Node

from ..custom_ops.moe.backends import resolve_moe_backend
from .context import BuildContext
from .fp8_graph import FP8_LINEAR, fp8_linear_parts, fp8_weight_source
from .fx_utils import (ASSERT_METADATA, CASTS, RESHAPES, aten, erase_dead_region, grouped_mm_ops, is_op,
                       module_path, module_tensor, shape, skip, val)
from .registry import PassOptions, PassResult, Stage, register_pass

MoEBackendName = Literal["auto", "triton", "torch"]
SharedMode = Literal["auto", "always", "never"]
#: `shared_experts: auto` fuses a shared expert whose three weight matrices take at most this many bytes.
#: H200, whole MoE layer in a CUDA graph (docs/moe.md, 2026-11-26): GLM-4.7-Flash's 18 MiB shared
#: expert as expert E 0.83x / 0.98x / 0.99x the separate MLP's time at 1 / 64 / 2048 tokens (its GEMM
#: launches and activation were most of a one-token layer); DeepSeek-V3's 84 MiB one 1.02x / 1.01x /
#: 1.03x (cuBLAS streams its large dense weights a little faster than the grouped kernels). Two
#: measured points: the bound sits between them.
SHARED_AUTO_MAX_BYTES = 48 << 20
_OPS = {"triton": torch.ops.autodeploy.triton_moe_experts.default,
        "torch": torch.ops.autodeploy.torch_moe_experts.default}
_SORTS = {aten.sort.default, aten.sort.stable}
_INDEX = aten.index.Tensor
_TRANSPOSE = aten.transpose.int


class _NoMatch(Exception):
    """The region differs from the grouped_mm experts forward; the message says where."""


@dataclass
class ExpertsMatch:
    """One matched experts region: its inputs and the node whose value it computes."""

    x: Node  # [T, H] tokens (before the gather)
    topk_ids: Node  # [T, k]
    topk_weights: Node  # [T, k]
    w_up: Node  # the grouped GEMM's [E, H, 2I] weight argument
    w_down: Node  # [E, I, H]
    out: Node  # the sum over k ([T, H])
    region: set[Node]
    top_k: int
    num_experts: int
    hidden: int
    inter: int


def _users(node: Node) -> list[Node]:
    return [u for u in node.users if not is_op(u, {ASSERT_METADATA})]


def _one_user(node: Node, what: str) -> Node:
    us = _users(node)
    if len(us) != 1:
        raise _NoMatch(f"{what} ({node.name}) has {len(us)} users, expected 1")
    return us[0]


def _through_casts(node: Node, region: set[Node]) -> Node:
    """Follow single-user casts forward from `node`."""
    while True:
        us = _users(node)
        if len(us) == 1 and is_op(us[0], CASTS):
            node = us[0]
            region.add(node)
        else:
            return node


def _back_casts(node: Any, region: set[Node]) -> Any:
    while is_op(node, CASTS):
        region.add(node)
        node = node.args[0]
    return node


def _flatten_source(node: Any) -> Node:
    """X of `X.reshape(-1)` where X is 2-d."""
    if not is_op(node, RESHAPES) or list(node.args[1]) != [-1] or len(shape(node.args[0])) != 2:
        raise _NoMatch(f"{getattr(node, 'name', node)} is not a [T, k] tensor flattened to [-1]")
    return node.args[0]


def _getitem(node: Node, idx: int) -> Optional[Node]:
    for u in node.users:
        if u.target is operator.getitem and u.args[1] == idx:
            return u
    return None


def match_experts(sort: Node, grouped: set[Any]) -> ExpertsMatch:
    """The experts region that starts at `sort` (of the flattened top-k ids); _NoMatch otherwise."""
    region: set[Node] = {sort}
    flat_ids = sort.args[0]
    ids = _flatten_source(flat_ids)
    region.add(flat_ids)
    t, k = shape(ids)
    if not isinstance(k, int):
        raise _NoMatch(f"top-k of {ids.name} is not static")
    perm = _getitem(sort, 1)
    sorted_ids = _getitem(sort, 0)
    if perm is None or sorted_ids is None:
        raise _NoMatch("sort results are not both used")
    region.update([perm, sorted_ids])

    # users of perm: perm // k (token gather), w_flat[perm] (weights), the inverse permutation
    gather = weights_g = inv = None
    for u in _users(perm):
        if is_op(u, {aten.floor_divide.default, aten.div.Tensor_mode}) and u.args[1] == k:
            g = _one_user(u, "perm // k")
            if not (is_op(g, {_INDEX}) and list(g.args[1]) == [u]):
                raise _NoMatch("perm // k does not index the tokens")
            region.update([u, g])
            gather = g
        elif is_op(u, {_INDEX}) and list(u.args[1]) == [perm] and u.args[0] is not None:
            weights_g = u
            region.add(u)
        elif is_op(u, {aten.empty_like.default}):
            inv = u
            region.add(u)
        elif is_op(u, {aten.index_put_.default, aten.index_put.default}):
            region.add(u)
        else:
            raise _NoMatch(f"unexpected use of the sort permutation: {u.name} ({u.target})")
    if gather is None or weights_g is None or inv is None:
        raise _NoMatch("the sort permutation does not gather tokens, weights and an inverse")
    x = gather.args[0]
    if len(shape(x)) != 2:
        raise _NoMatch(f"gathered tokens {x.name} are not [T, H]")
    w_flat = weights_g.args[0]
    topk_w = _flatten_source(w_flat)
    region.add(w_flat)
    if shape(topk_w) != (t, k):
        raise _NoMatch(f"routing weights {topk_w.name} are {shape(topk_w)}, ids are {(t, k)}")
    put = [u for u in inv.users if is_op(u, {aten.index_put_.default, aten.index_put.default})]
    if len(put) != 1 or list(put[0].args[1]) != [perm]:
        raise _NoMatch("the inverse permutation is not empty_like(perm)[perm] = arange")
    region.add(put[0])
    if isinstance(put[0].args[2], Node):
        region.add(put[0].args[2])  # the arange

    # up GEMM -> chunk -> silu(gate) * up -> down GEMM (same offsets)
    up = _one_user(_through_casts(gather, region), "the gathered tokens")
    if not is_op(up, grouped):
        raise _NoMatch(f"the gathered tokens feed {up.target}, not a grouped GEMM")
    region.add(up)
    offs = up.args[2] if len(up.args) > 2 else up.kwargs.get("offs")
    chunk = _one_user(_through_casts(up, region), "the up GEMM")
    if not (is_op(chunk, {aten.chunk.default}) and chunk.args[1] == 2 and chunk.args[2] in (-1, 1)):
        raise _NoMatch(f"the up GEMM is not split in [gate; up] halves ({chunk.target})")
    region.add(chunk)
    gate, upv = _getitem(chunk, 0), _getitem(chunk, 1)
    if gate is None or upv is None:
        raise _NoMatch("gate/up halves not both used")
    region.update([gate, upv])
    act = _one_user(gate, "the gate half")
    if not is_op(act, {aten.silu.default}):
        raise _NoMatch(f"gate activation {act.target} unsupported (silu only)")
    region.add(act)
    mul = _one_user(act, "silu(gate)")
    if not (is_op(mul, {aten.mul.Tensor}) and set(mul.args[:2]) == {act, upv}):
        raise _NoMatch("silu(gate) is not multiplied by the up half")
    region.add(mul)
    down = _one_user(_through_casts(mul, region), "silu(gate) * up")
    if not is_op(down, grouped):
        raise _NoMatch(f"silu(gate) * up feeds {down.target}, not a grouped GEMM")
    region.add(down)
    if (down.args[2] if len(down.args) > 2 else down.kwargs.get("offs")) is not offs:
        raise _NoMatch("the two grouped GEMMs do not share their offsets")
    region.add(offs)
    for hist in offs.all_input_nodes:  # cumsum(histc(cast(sorted ids)))
        if not is_op(hist, {aten.histc.default}):
            raise _NoMatch(f"the grouped GEMM offsets are not a cumsum of a histc ({hist.target})")
        region.add(hist)
        _back_casts(hist.args[0], region)

    # * weights[perm] -> [inverse] -> view [T, k, H] -> sum over k
    wmul = _one_user(_through_casts(down, region), "the down GEMM")
    if not is_op(wmul, {aten.mul.Tensor}):
        raise _NoMatch("the down GEMM output is not scaled by the routing weights")
    src = _back_casts_peek(down, wmul)
    other = [a for a in wmul.args[:2] if a is not src]
    if len(other) != 1:
        raise _NoMatch("the down GEMM output is not scaled by the routing weights")
    w_unsq = other[0]
    if not (is_op(w_unsq, {aten.unsqueeze.default}) and w_unsq.args[0] is weights_g):
        raise _NoMatch("the down GEMM output is scaled by something other than the permuted routing weights")
    region.update([wmul, w_unsq])
    unperm = _one_user(_through_casts(wmul, region), "the weighted output")
    if not (is_op(unperm, {_INDEX}) and len(unperm.args[1]) == 1
            and unperm.args[1][0] in (inv, put[0])):
        raise _NoMatch("the weighted output is not un-permuted by the inverse permutation")
    region.add(unperm)
    view = _one_user(unperm, "the un-permuted output")
    if not (is_op(view, RESHAPES) and len(view.args[1]) == 3 and view.args[1][1] == k):
        raise _NoMatch("the un-permuted output is not viewed as [T, k, H]")
    region.add(view)
    out = _one_user(view, "the [T, k, H] view")
    if not (is_op(out, {aten.sum.dim_IntList}) and list(out.args[1]) in ([1], [-2])):
        raise _NoMatch("the [T, k, H] view is not summed over k")
    region.add(out)

    e, h_in, two_i = shape(up.args[1])
    e2, i_in, h_out = shape(down.args[1])
    if not all(isinstance(v, int) for v in (e, h_in, two_i, e2, i_in, h_out)):
        raise _NoMatch("expert weights have symbolic shapes")
    if e != e2 or two_i != 2 * i_in or h_in != h_out or shape(x)[1] != h_in:
        raise _NoMatch(f"weight shapes disagree: up {shape(up.args[1])}, down {shape(down.args[1])}, "
                       f"tokens {shape(x)}")
    return ExpertsMatch(x, ids, topk_w, up.args[1], down.args[1], out, region, k, e, h_in, i_in)


def _back_casts_peek(down: Node, wmul: Node) -> Node:
    """The argument of `wmul` that comes from `down` (through casts)."""
    for a in wmul.args[:2]:
        node = a
        while is_op(node, CASTS):
            node = node.args[0]
        if node is down:
            return a
    raise _NoMatch("the weighted output does not come from the down GEMM")


# ----------------------------------------------------------------------------- rewriting
def _weight_out_in(graph: torch.fx.Graph, w: Node) -> Node:
    """The [E, out, in] form of a grouped GEMM's [E, in, out] weight argument."""
    if is_op(w, {_TRANSPOSE}) and sorted(a % 3 for a in w.args[1:3]) == [1, 2]:
        return w.args[0]
    with graph.inserting_after(w):
        return graph.call_function(_TRANSPOSE, (w, -2, -1))


def rewrite(gm: GraphModule, m: ExpertsMatch, backend: str) -> Node:
    g = gm.graph
    w_up = _weight_out_in(g, m.w_up)
    w_down = _weight_out_in(g, m.w_down)
    wdtype = val(m.w_up).dtype if val(m.w_up) is not None else None
    x = m.x
    with g.inserting_before(m.out):
        if wdtype is not None and val(x) is not None and val(x).dtype != wdtype:
            x = g.call_function(aten.to.dtype, (x, wdtype))
        fused = g.call_function(_OPS[backend], (x, m.topk_ids, m.topk_weights, w_up, w_down, "silu"))
        result = fused
        out_dtype = val(m.out).dtype if val(m.out) is not None else None
        if out_dtype is not None and wdtype is not None and out_dtype != wdtype:
            result = g.call_function(aten.to.dtype, (fused, out_dtype))
    fused.meta["nn_module_stack"] = m.out.meta.get("nn_module_stack", {})
    m.out.replace_all_uses_with(result)
    erase_dead_region(g, m.region)
    return fused


# ----------------------------------------------------------------------------- FP8 experts
def fp8_experts(m: ExpertsMatch) -> Optional[tuple[Node, Node, Node, Node, int, int]]:
    """(w_up, w_up_scale, w_down, w_down_scale, block_n, block_k) when both grouped GEMMs read
    dequantized FP8 expert weights (models/fp8_modules.py), else None."""
    srcs = [fp8_weight_source(skip(w, {_TRANSPOSE})) for w in (m.w_up, m.w_down)]
    if srcs[0] is None or srcs[1] is None or srcs[0][2:] != srcs[1][2:]:
        return None
    (wu, su, bn, bk), (wd, sd, _, _) = srcs
    return wu, su, wd, sd, bn, bk


def fp8_moe_op(backend: str) -> Any:
    """The FP8 MoE op of `backend` (`<backend>_moe_experts_fp8`, custom_ops/moe/fp8.py), None when this
    build does not register it."""
    try:
        return getattr(torch.ops.autodeploy, f"{backend}_moe_experts_fp8").default
    except (AttributeError, RuntimeError):
        return None


def rewrite_fp8(gm: GraphModule, m: ExpertsMatch, op: Any, fp8: tuple[Node, Node, Node, Node, int, int]) -> Node:
    """The region -> op(x, topk_ids, topk_weights, w_up, w_up_scale, w_down, w_down_scale, block_n,
    block_k, "silu") on the FP8 weights themselves (the per-step dequantize nodes go with the region)."""
    g = gm.graph
    wu, su, wd, sd, bn, bk = fp8
    with g.inserting_before(m.out):
        fused = g.call_function(op, (m.x, m.topk_ids, m.topk_weights, wu, su, wd, sd, bn, bk, "silu"))
        result = fused
        out_dtype = val(m.out).dtype if val(m.out) is not None else None
        if out_dtype is not None and val(m.x) is not None and out_dtype != val(m.x).dtype:
            result = g.call_function(aten.to.dtype, (fused, out_dtype))
    fused.meta["nn_module_stack"] = m.out.meta.get("nn_module_stack", {})
    m.out.replace_all_uses_with(result)
    erase_dead_region(g, m.region)
    return fused


# ----------------------------------------------------------------------------- the pass
class FuseMoEOptions(PassOptions):
    backend: MoEBackendName = Field("auto", description="triton | torch (reference) | auto")
    shared_experts: SharedMode = Field("auto", description="a shared expert MLP of the experts' intermediate "
                                        "size runs in the fused op as one more expert every token is routed to: "
                                        "always | never | auto (where its weights are at most "
                                        "SHARED_AUTO_MAX_BYTES)")


# ----------------------------------------------------------------------------- shared experts
_LINEAR = aten.linear.default
_SLICE = aten.slice.Tensor


@dataclass
class _Proj:
    """A bias-free projection's parameters: the weight get_attr, and for an FP8 linear its scale grid's
    get_attr and (block_n, block_k)."""

    weight: Node
    scale: Optional[Node] = None
    block: Optional[tuple[int, int]] = None


@dataclass
class SharedMatch:
    """A shared expert MLP added to a fused experts op's output."""

    add: Node  # routed.view(...) + shared
    routed: Node  # the add's argument that carries the fused op's output
    up_params: list[tuple[_Proj, int, int]]  # (projection, first row, rows) of [gate; up] in the shared MLP
    down: _Proj  # the [H, I] down projection


def _params(node: Any) -> Node:
    if not (isinstance(node, Node) and node.op == "get_attr"):
        raise _NoMatch(f"{getattr(node, 'name', node)} is not a parameter")
    return node


def _linear_weight(node: Any, x: Node, what: str) -> _Proj:
    """The parameters of `node` = linear(x, W) or fp8_block_linear(x, W, scale) without bias."""
    if is_op(node, {FP8_LINEAR}):
        parts = fp8_linear_parts(node)
        if parts.x is not x or parts.bias is not None:
            raise _NoMatch(f"the shared MLP's {what} is not a bias-free FP8 linear of the MoE input")
        return _Proj(_params(parts.weight), _params(parts.scale), (int(parts.block_n), int(parts.block_k)))
    if not (is_op(node, {_LINEAR}) and node.args[0] is x and (len(node.args) < 3 or node.args[2] is None)):
        raise _NoMatch(f"the shared MLP's {what} is not a bias-free linear of the MoE input")
    return _Proj(_params(node.args[1]))


def _wider(width: Any, i: int) -> str:
    return (f"the shared MLP's intermediate size is {width}, the experts' {i}: only a shared MLP of one expert's "
            "size runs as an expert (wider ones would need copies of their weights, as their gate and up rows "
            "interleave differently from the stacked experts')")


def _half(node: Any, x: Node, i: int, which: int) -> tuple[_Proj, int]:
    """(projection, first row) of the gate (which=0) or up (1) projection `node`: its own linear, or
    a slice of fuse_gemms' fused [gate; up] linear."""
    if is_op(node, {_SLICE}) and node.args[1] in (-1, 2) and len(node.args) >= 4:
        start, end = node.args[2], node.args[3]
        if end - start != i:
            raise _NoMatch(_wider(end - start, i))
        return _linear_weight(node.args[0], x, "fused gate/up projection"), start
    w = _linear_weight(node, x, ("gate", "up")[which] + " projection")
    if shape(w.weight)[0] != i:
        raise _NoMatch(_wider(shape(w.weight)[0], i))
    return w, 0


def match_shared(fused: Node, m: ExpertsMatch) -> SharedMatch:
    """The shared expert MLP whose output is added to the fused op's output (through views and
    casts); _NoMatch (with where it differs) otherwise."""
    routed = fused
    while True:
        us = _users(routed)
        if len(us) != 1:
            raise _NoMatch(f"the experts' output has {len(us)} users (no single add of a shared MLP)")
        if is_op(us[0], RESHAPES | CASTS):
            routed = us[0]
            continue
        add = us[0]
        break
    if not is_op(add, {aten.add.Tensor}) or len(add.args) != 2:
        raise _NoMatch(f"the experts' output feeds {add.target}, not an add of a shared MLP")
    other = add.args[1] if add.args[0] is routed else add.args[0]
    down_lin = skip(other, CASTS)
    x_in = skip(m.x, RESHAPES | CASTS)
    if not is_op(down_lin, {_LINEAR, FP8_LINEAR}):
        raise _NoMatch("what is added to the experts' output is not a linear (shared MLP down projection)")
    mul = down_lin.args[0]
    down_w = _linear_weight(down_lin, mul, "down projection")
    if not is_op(mul, {aten.mul.Tensor}):
        raise _NoMatch("the shared MLP's down projection does not take act(gate) * up")
    act = next((a for a in mul.args[:2] if is_op(a, {aten.silu.default})), None)
    if act is None:
        raise _NoMatch("the shared MLP's activation is not silu")
    up = mul.args[1] if mul.args[0] is act else mul.args[0]
    gate = act.args[0]
    x_sh = gate.args[0].args[0] if is_op(gate, {_SLICE}) else gate.args[0]
    if skip(x_sh, RESHAPES | CASTS) is not x_in:
        raise _NoMatch("the shared MLP reads another tensor than the experts")
    if val(x_sh) is not None and val(m.x) is not None and val(x_sh).dtype != val(m.x).dtype:
        raise _NoMatch("the shared MLP reads the tokens in another dtype than the experts")
    gw, g0 = _half(gate, x_sh, m.inter, 0)
    uw, u0 = _half(up, x_sh, m.inter, 1)
    if shape(down_w.weight) != (m.hidden, m.inter):
        raise _NoMatch(f"the shared MLP's down weight is {shape(down_w.weight)}, the experts' "
                       f"[{m.hidden}, {m.inter}]")
    for n in (act, mul, down_lin, *([other] if other is not down_lin else [])):
        if len(_users(n)) != 1:
            raise _NoMatch(f"a shared MLP node ({n.name}) is used outside the MLP")
    return SharedMatch(add, routed, [(gw, g0, m.inter), (uw, u0, m.inter)], down_w)


def _repoint(gm: GraphModule, old: torch.Tensor, new: torch.Tensor) -> None:
    """Every parameter/buffer of `gm` that views `old`'s storage within `old` (`old` itself,
    fuse_gemms' member views, the HF model's parameters) becomes the same view of `new`, which holds
    old's values in old's layout."""
    base, ptr, numel, es = old.untyped_storage().data_ptr(), old.data_ptr(), old.numel(), old.element_size()
    flat = new.reshape(-1)
    tensors = {id(t): t for _, t in [*gm.named_parameters(remove_duplicate=False),
                                     *gm.named_buffers(remove_duplicate=False)]}
    for t in tensors.values():
        if t.untyped_storage().data_ptr() != base or not t.is_contiguous():
            continue
        off = (t.data_ptr() - ptr) // es
        if 0 <= off and off + t.numel() <= numel:
            t.data = flat[off:off + t.numel()].view(t.shape)


def _shared_fp8_rows(sh: SharedMatch, block: tuple[int, int]) -> None:
    """_NoMatch unless the FP8 shared MLP's weights stack with FP8 experts of `block`: all three FP8 in
    that block size, and its gate and up rows starting on block_n boundaries (their scale rows are then
    whole rows of the grid, as the experts' [gate; up] grid has them)."""
    projs = [p for p, _, _ in sh.up_params] + [sh.down]
    if any(p.scale is None for p in projs):
        raise _NoMatch("the experts are FP8 and the shared MLP's weights are not: they do not stack")
    if any(p.block != block for p in projs):
        raise _NoMatch(f"the shared MLP's FP8 blocks {sorted({p.block for p in projs})} differ from the experts' "
                       f"{list(block)}: their scale grids do not stack")
    bn = block[0]
    for p, start, rows in sh.up_params:
        if start % bn or rows % bn:
            raise _NoMatch(f"the shared MLP's gate/up rows [{start}, {start + rows}) of {p.weight.target} do not "
                           f"start and end on block_n ({bn}) boundaries: their scale rows do not stack")


def fuse_shared(gm: GraphModule, m: ExpertsMatch, fused: Node, sh: SharedMatch) -> str:
    """Append the shared MLP's weights to the fused op's as expert E, route every token to it with
    weight 1, and drop the MLP and its add. Returns the stacked weights' parameter names.

    FP8 experts (`<backend>_moe_experts_fp8(x, ids, weights, w_up, w_up_scale, w_down, w_down_scale,
    block_n, block_k, act)`): the shared MLP's FP8 weights and their scale rows are stacked the same
    way (same block size; gate and up rows on block_n boundaries): exact, a block's scale travels with it."""
    g = gm.graph
    fp8 = fused.target not in _OPS.values()  # else one of the FP8 MoE ops (fp8_moe_op)
    # positions of the stacked parameters in the op's arguments: [w_up, w_down] or [w_up, scale, w_down, scale]
    pos = [3, 4, 5, 6] if fp8 else [3, 4]
    nodes = [fused.args[i] for i in pos]
    if not all(isinstance(n, Node) and n.op == "get_attr" for n in nodes):
        raise _NoMatch("the experts' weights are not plain [E, out, in] parameters")
    stacked = [module_tensor(gm, str(n.target)) for n in nodes]
    (gw, g0, i), (uw, u0, _) = sh.up_params
    if fp8:
        block = (int(fused.args[7]), int(fused.args[8]))
        _shared_fp8_rows(sh, block)
        bn = block[0]
        # (weight-or-scale tensor, row scale): weights by rows, scales by block rows
        groups = [(lambda p: p.weight, 1), (lambda p: p.scale, bn)]
    else:
        if any(p.scale is not None for p in (gw, uw, sh.down)):
            raise _NoMatch("the shared MLP's weights are FP8 and the experts' are not: they do not stack")
        groups = [(lambda p: p.weight, 1)]
    same_fused = gw.weight is uw.weight
    gate_rows = module_tensor(gm, str(gw.weight.target)).shape[0]
    if same_fused and not (g0 == 0 and u0 == i and gate_rows == 2 * i):
        raise _NoMatch(f"the shared MLP's fused projection is not [gate; up] ({gate_rows} rows, gate at "
                       f"{g0}, up at {u0})")
    # per group (weights, then FP8 scales): the experts' up and down stacks and the shared MLP's three parts
    parts = []
    for j, (get, rs) in enumerate(groups):
        up_t, down_t = stacked[j], stacked[len(groups) + j]
        gate_t, upw_t, sh_down = (module_tensor(gm, str(get(p).target)) for p in (gw, uw, sh.down))
        parts.append((up_t, down_t, gate_t, upw_t, sh_down, rs))
    every = [t for p in parts for t in p[:5]]
    if not all(t.is_contiguous() for t in every):
        raise _NoMatch("the experts' or the shared MLP's weights are not contiguous")
    for up_t, down_t, gate_t, upw_t, sh_down, _ in parts:
        if any(t.dtype != up_t.dtype or t.device != up_t.device for t in (gate_t, upw_t, sh_down)):
            raise _NoMatch("the shared MLP's weights differ in dtype or device from the experts'")
    e = stacked[0].shape[0]
    ext: list[torch.Tensor] = []  # [ext_up, ext_down] per group
    for up_t, down_t, gate_t, upw_t, sh_down, rs in parts:
        gi, ga, ua = i // rs, g0 // rs, u0 // rs
        sh_up = torch.cat([gate_t[ga:ga + gi].detach(), upw_t[ua:ua + gi].detach()], 0)
        if sh_up.shape != up_t.shape[1:] or sh_down.shape != down_t.shape[1:]:
            raise _NoMatch(f"the shared MLP's stacked shapes {list(sh_up.shape)}, {list(sh_down.shape)} differ from "
                           f"one expert's {list(up_t.shape[1:])}, {list(down_t.shape[1:])}")
        ext_up = torch.cat([up_t.detach(), sh_up.unsqueeze(0)], 0)
        ext_down = torch.cat([down_t.detach(), sh_down.detach().unsqueeze(0)], 0)
        # the old tensors and every view of them (HF parameters, fuse_gemms' members) now view the stack
        _repoint(gm, up_t, ext_up[:e])
        _repoint(gm, down_t, ext_down[:e])
        _repoint(gm, sh_down, ext_down[e])
        if same_fused:
            _repoint(gm, gate_t, ext_up[e])
        else:
            _repoint(gm, gate_t, ext_up[e, :gi])
            _repoint(gm, upw_t, ext_up[e, gi:])
        ext += [ext_up, ext_down]
    parent = str(nodes[0].target).rpartition(".")[0]
    owner = gm.get_submodule(parent) if parent else gm
    stems = (["w_up_with_shared", "w_down_with_shared"] if not fp8 else
             ["w_up_with_shared", "w_down_with_shared", "w_up_scale_with_shared", "w_down_scale_with_shared"])
    names = []
    for stem, t in zip(stems, ext):
        owner.register_parameter(stem, torch.nn.Parameter(t, requires_grad=False))
        names.append(f"{parent}.{stem}" if parent else stem)
    ids, wts = fused.args[1], fused.args[2]
    with g.inserting_before(fused):
        attrs = dict(zip(stems, (g.get_attr(n) for n in names)))
        col_i = g.call_function(_SLICE, (ids, 1, 0, 1))
        col_w = g.call_function(_SLICE, (wts, 1, 0, 1))
        ids_ext = g.call_function(aten.cat.default, ([ids, g.call_function(aten.full_like.default, (col_i, e))], 1))
        w_ext = g.call_function(aten.cat.default, ([wts, g.call_function(aten.full_like.default, (col_w, 1.0))], 1))
    if fp8:
        weights = (attrs["w_up_with_shared"], attrs["w_up_scale_with_shared"], attrs["w_down_with_shared"],
                   attrs["w_down_scale_with_shared"])
    else:
        weights = (attrs["w_up_with_shared"], attrs["w_down_with_shared"])
    fused.args = (fused.args[0], ids_ext, w_ext, *weights, *fused.args[pos[-1] + 1:])
    # the add's own metadata checks go with it (a check of [T, H] on the routed view would still hold,
    # but stays simpler erased)
    sh.add.replace_all_uses_with(sh.routed, delete_user_cb=lambda u: not is_op(u, {ASSERT_METADATA}))
    region = {sh.add}
    stack = [a for a in sh.add.all_input_nodes if a is not sh.routed]
    while stack:  # the shared MLP, back to the parameters (dead now)
        n = stack.pop()
        if n in region or n is m.x or n.op == "placeholder" or n is skip(m.x, RESHAPES | CASTS):
            continue
        region.add(n)
        stack.extend(n.all_input_nodes)
    erase_dead_region(g, region)  # the experts' old weight nodes go with the pass's dead-code sweep
    return ", ".join(names)


def _fuse_shared_entry(gm: GraphModule, m: ExpertsMatch, fused: Node, mode: SharedMode) -> str:
    """Report text of the shared-expert fusion of one layer (done or why not)."""
    if mode == "never":
        return "kept the model's shared MLP: fuse_moe.shared_experts is never"
    wv = val(fused.args[3])
    nbytes = 3 * m.hidden * m.inter * (wv.element_size() if wv is not None else 2)
    if mode == "auto" and nbytes > SHARED_AUTO_MAX_BYTES:
        return (f"kept the model's shared MLP: auto fuses a shared expert of at most "
                f"{SHARED_AUTO_MAX_BYTES >> 20} MiB of weights, this one has {nbytes / 2**20:.0f} MiB "
                "(large ones ran slower in the fused op on the H200)")
    try:
        sh = match_shared(fused, m)  # (through rewrite's cast back to the model's dtype, if any)
        names = fuse_shared(gm, m, fused, sh)
    except _NoMatch as exc:
        return f"kept the model's shared MLP: {exc}"
    return f"in the fused op as expert {m.num_experts} (weights {names})"


@register_pass("fuse_moe", FuseMoEOptions, stage=Stage.FUSE, requires=("export",), refresh_shapes="missing")
def fuse_moe(ctx: BuildContext, opts: FuseMoEOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    grouped = grouped_mm_ops()
    layers: list[dict[str, Any]] = []
    fused = 0
    for sort in [n for n in gm.graph.nodes if is_op(n, _SORTS)]:
        layer = module_path(sort)
        try:
            m = match_experts(sort, grouped)
        except _NoMatch as exc:
            layers.append({"layer": layer, "backend": None, "reason": f"not an experts region: {exc}"})
            continue
        wv = val(m.w_up)
        backend, reason = resolve_moe_backend("experts", opts.backend, ctx.target.device,
                                              dtype=wv.dtype if wv is not None else None)
        entry = {"layer": layer, "experts": m.num_experts, "top_k": m.top_k, "hidden": m.hidden,
                 "intermediate": m.inter, "backend": backend, "reason": reason}
        fp8 = fp8_experts(m)
        if backend is not None and fp8 is not None:
            entry["weights"] = f"fp8 blocks [{fp8[4]}, {fp8[5]}]"
            op = fp8_moe_op(backend)
            if op is None:
                entry["reason"] = (f"kept the model's experts: FP8 experts need torch.ops.autodeploy.{backend}"
                                   "_moe_experts_fp8, which this build does not register (the model's subgraph "
                                   "dequantizes the experts each step and runs the grouped GEMMs)")
                entry["backend"] = backend = None
            else:
                node = rewrite_fp8(gm, m, op, fp8)
                fused += 1
                entry["shared_experts"] = _fuse_shared_entry(gm, m, node, opts.shared_experts)
        elif backend is not None:
            node = rewrite(gm, m, backend)
            fused += 1
            entry["shared_experts"] = _fuse_shared_entry(gm, m, node, opts.shared_experts)
        layers.append(entry)
    if fused:
        gm.graph.eliminate_dead_code()  # the regions' index arithmetic (sym sizes, aranges): once, not per layer
    if not layers:
        return PassResult("no MoE experts regions", {"layers": []})
    kept = len(layers) - fused
    summary = f"{fused} MoE layers fused" + (f" ({layers[0]['backend'] or 'none'})" if fused else "")
    if kept:
        summary += f", {kept} kept: {next(e['reason'] for e in layers if e['backend'] is None)}"
    return PassResult(summary, {"layers": layers})


__all__ = ["SHARED_AUTO_MAX_BYTES", "ExpertsMatch", "fp8_experts", "fp8_moe_op", "rewrite_fp8", "FuseMoEOptions", "SharedMatch", "fuse_moe", "fuse_shared",
           "match_experts", "match_shared", "rewrite"]
