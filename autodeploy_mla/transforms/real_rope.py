"""`real_rope`: rotary embeddings written with complex numbers become real arithmetic (issue 13).

DeepSeek-V2's attention in transformers (DeepSeek-V2 and V2-Lite) rotates `q_pe` and `k_pe` as
complex numbers: `view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis)`.
Inductor has no complex dtype, so in a compiled static piece each of those products is an ATen
kernel of its own, and the float tensors on either side are materialised for it by kernels of their
own: per layer two complex multiplies plus the conversions around them (H200, V2-Lite batch-1
decode step: the two complex kernels alone 0.073 ms of 2.78, 54 launches,
docs/benchmarks/e2e_routing/v2_lite_profile_b1_triton_2026-11-26.md).

The pass rewrites each `view_as_real(mul(view_as_complex(a), f))`, f complex (either operand order),
into the same product on the real and imaginary parts,

    stack([a0 * f0 - a1 * f1, a0 * f1 + a1 * f0], -1),   a0, a1 = a[..., 0], a[..., 1]
                                                          f0, f1 = view_as_real(f)[..., 0], [..., 1]

which Inductor fuses into the kernel that splits `q_pe` / `k_pe` out of their projection. The
formula is the complex product's definition (the same four products and two sums in fp32); what
only the compiler can change is whether a multiply-add is fused, i.e. the last bit of a sum.

`when: auto` applies it only where the static pieces are compiled by Inductor (the `piecewise`
pass's compile setting, resolved for the device: CUDA by default), since eager graphs gain nothing
and CPU graphs keep the model's own ops; `always` applies it everywhere (tests).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, Optional

import torch
from torch.fx import Node

from .context import BuildContext
from .fx_utils import aten, is_op, module_path, val
from .registry import PassOptions, PassResult, Stage, register_pass


class RealRopeOptions(PassOptions):
    #: auto: where static pieces are Inductor-compiled (piecewise.compile resolves to inductor);
    #: always: in every graph
    when: Literal["auto", "always"] = "auto"


def _complex(node: Any) -> bool:
    v = val(node) if isinstance(node, Node) else None
    return isinstance(v, torch.Tensor) and v.is_complex()


def _match(node: Node) -> Optional[tuple[Node, Node, Node, Node]]:
    """(view_as_real node, complex mul, the rotated float tensor a, the complex factor f) or None."""
    if not is_op(node, {aten.view_as_real.default}):
        return None
    mul = node.args[0]
    if not (is_op(mul, {aten.mul.Tensor}) and len(mul.users) == 1 and _complex(mul)):
        return None
    x, f = mul.args[:2]
    if not is_op(x, {aten.view_as_complex.default}):
        x, f = f, x
    if not (is_op(x, {aten.view_as_complex.default}) and isinstance(f, Node) and _complex(f)):
        return None
    a = x.args[0]
    av = val(a)
    if not (isinstance(av, torch.Tensor) and av.dtype == torch.float32 and av.dim() >= 1 and av.shape[-1] == 2):
        return None
    return node, mul, a, f


def _compiled_by_inductor(ctx: BuildContext) -> tuple[bool, str]:
    from .piecewise import PiecewiseOptions, static_pieces_compile

    opts = PiecewiseOptions.model_validate(dict(ctx.config.transforms.get("piecewise") or {}))
    backend, why = static_pieces_compile(opts, ctx.device)
    return backend == "inductor", f"static pieces compile={backend} ({why})"


@register_pass("real_rope", RealRopeOptions, stage=Stage.FUSE, requires=("export",))
def real_rope(ctx: BuildContext, opts: RealRopeOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    found = [m for m in (_match(n) for n in gm.graph.nodes) if m is not None]
    if not found:
        return PassResult("no complex rotary products", {"rewritten": []})
    if opts.when == "auto":
        on, why = _compiled_by_inductor(ctx)
        if not on:
            return PassResult(f"{len(found)} complex rotary products kept: {why}",
                              {"kept": len(found), "reason": why})
    from torch._guards import detect_fake_mode

    g = gm.graph
    mode = detect_fake_mode([val(found[0][2])]) or contextlib.nullcontext()

    def call(op: Any, args: tuple) -> Node:
        """A new node of `op`, its fake value computed from its inputs' (no whole-graph re-propagation)."""
        node = g.call_function(op, args)
        with mode:
            node.meta["val"] = op(*[[val(x) for x in a] if isinstance(a, list) else val(a) if isinstance(a, Node)
                                    else a for a in args])
        return node

    real_of: dict[Node, tuple[Node, Node]] = {}  # complex factor -> (real part, imaginary part)
    rewritten = []
    for out, mul, a, f in found:
        with g.inserting_before(out):
            if f not in real_of:
                fr = call(aten.view_as_real.default, (f,))
                real_of[f] = (call(aten.select.int, (fr, -1, 0)), call(aten.select.int, (fr, -1, 1)))
            f0, f1 = real_of[f]
            a0 = call(aten.select.int, (a, -1, 0))
            a1 = call(aten.select.int, (a, -1, 1))
            re = call(aten.sub.Tensor, (call(aten.mul.Tensor, (a0, f0)), call(aten.mul.Tensor, (a1, f1))))
            im = call(aten.add.Tensor, (call(aten.mul.Tensor, (a0, f1)), call(aten.mul.Tensor, (a1, f0))))
            rot = call(aten.stack.default, ([re, im], -1))
        rot.meta.update({k: v for k, v in out.meta.items() if k in ("stack_trace", "nn_module_stack")})
        out.replace_all_uses_with(rot)
        rewritten.append(module_path(out))
        x = mul.args[0] if is_op(mul.args[0], {aten.view_as_complex.default}) else mul.args[1]
        g.erase_node(out)
        g.erase_node(mul)
        if not x.users:
            g.erase_node(x)
    return PassResult(f"{len(rewritten)} complex rotary products as real arithmetic",
                      {"rewritten": rewritten, "factors": len(real_of)})


__all__ = ["real_rope", "RealRopeOptions"]
