"""`resolve_fp8_linear`: each block-FP8 linear (`fp8_block_linear` source node) -> the op of the
backend resolved for it, with the reason (like the attention backends, DESIGN §8).

Runs after the FUSE passes (so fused GEMMs are resolved at their fused N) and before cache insertion.
Per node: its N, K, block and activation dtype are read from the graph, every backend descriptor of
custom_ops/fp8/backends.py is asked in the device class's preference order, and the node's target
becomes `fp8_block_linear_<backend>` (same arguments, same output: nothing else in the graph
changes). The decision is kept in `node.meta["fp8_linear"]` and in the pass report, with the reason
each preferred backend was rejected.

Options: `backend` (auto | torch | triton | scaled_mm | cublas_triton | flashinfer) for every node; `layers` (a
layer-name glob or node index -> backend) per node; `allow_fallback` (an explicit backend that cannot
serve a node falls back to the auto order instead of failing); `preference` (auto order per device
class). The defaults are the class constants below; the sm90 order follows the H200 measurement of
`python -m benchmarks.kernels.fp8_gemm` (docs/benchmarks/fp8_weights_kernels.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal, Optional

import fnmatch

import torch
from pydantic import Field, field_validator
from torch.fx import GraphModule, Node

from ..custom_ops.fp8.backends import (FP8_LINEAR_BACKENDS, FP8LinearNode, fp8_linear_op,
                                       resolve_fp8_linear_backend)
from .backend_resolution import DEVICE_CLASSES, arch_key
from .context import BuildContext
from .fx_utils import is_op, module_path, module_tensor, val
from .registry import PassOptions, PassResult, Stage, register_pass

SOURCE = torch.ops.autodeploy.fp8_block_linear.default
FP8LinearBackendName = Literal["auto", "torch", "triton", "scaled_mm", "cublas_triton", "flashinfer"]
#: auto order per device class. cuBLAS block scaling and FlashInfer's block-scale GEMM are SM90-only.
#: sm90 (H200, docs/benchmarks/fp8_weights_kernels.md, 2026-11-29): cuBLAS up to 1.9x our Triton from
#: T = 128 (prefill T 2048/8192 included), Triton equal or faster at decode (T <= 64), so `cublas_triton`
#: (each by token count, from the shape: cuBLAS from linear_ops.CUBLAS_MIN_TOKENS = 65) first.
DEFAULT_PREFERENCE: dict[str, list[str]] = {
    "sm100": ["triton", "torch"],
    "sm90": ["cublas_triton", "scaled_mm", "triton", "flashinfer", "torch"],
    "sm80": ["triton", "torch"],
    "cuda": ["triton", "torch"],
    "cpu": ["torch"],
}
_ARGS = ("x", "weight", "weight_scale_inv", "bias", "block_n", "block_k")


class ResolveFP8LinearOptions(PassOptions):
    backend: FP8LinearBackendName = Field("auto", description="auto | torch | triton | scaled_mm | cublas_triton | "
                                                              "flashinfer")
    layers: dict[str, FP8LinearBackendName] = Field(
        default_factory=dict, description="per node: layer-name glob or node index -> backend")
    allow_fallback: bool = False
    preference: dict[str, list[str]] = Field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_PREFERENCE.items()},
                                             description="auto order per device class")

    @field_validator("preference")
    @classmethod
    def _preference(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for key, names in v.items():
            if key not in DEVICE_CLASSES:
                raise ValueError(f"unknown device class {key!r} under preference; valid: {', '.join(DEVICE_CLASSES)}")
            for b in names:
                if b not in FP8_LINEAR_BACKENDS:
                    raise ValueError(f"unknown FP8 linear backend {b!r} in preference.{key}; valid: "
                                     f"{', '.join(FP8_LINEAR_BACKENDS)}")
        return v


def source_arg(node: Node, name: str) -> Any:
    """Argument `name` of an fp8_block_linear node, passed positionally or by keyword."""
    i = _ARGS.index(name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _tensor(gm: GraphModule, arg: Any, what: str, node: Node) -> torch.Tensor:
    v = val(arg)
    if v is None and isinstance(arg, Node) and arg.op == "get_attr":
        v = module_tensor(gm, arg.target)
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{node.name} ({module_path(node)}): fp8_block_linear's {what} has no recorded tensor "
                         "value; the pass needs shapes (run it on an exported graph)")
    return v


def node_facts(gm: GraphModule, node: Node) -> FP8LinearNode:
    """The node's N, K, block, dtypes, as the backends' checks want them."""
    x = _tensor(gm, source_arg(node, "x"), "x", node)
    w = _tensor(gm, source_arg(node, "weight"), "weight", node)
    bias = source_arg(node, "bias")
    return FP8LinearNode(int(w.shape[0]), int(w.shape[1]), int(source_arg(node, "block_n")),
                         int(source_arg(node, "block_k")), x.dtype, w.dtype, bias is not None)


def requested_backends(layers: list[str], opts: ResolveFP8LinearOptions) -> list[str]:
    """Per node: the backend of the first `layers` pattern (node index or layer-name glob) matching it,
    else `opts.backend`. A pattern that matches no FP8 linear is an error listing the layer names."""
    used: set[str] = set()
    out = []
    for i, layer in enumerate(layers):
        chosen = opts.backend
        for pattern, backend in opts.layers.items():
            if pattern == str(i) or fnmatch.fnmatchcase(layer, pattern):
                chosen = backend
                used.add(pattern)
                break
        out.append(chosen)
    unused = [p for p in opts.layers if p not in used]
    if unused:
        raise ValueError(f"transforms.resolve_fp8_linear.layers: {', '.join(map(repr, unused))} match no FP8 linear; "
                         f"use a node index or a glob over these {len(layers)} layer names: "
                         + ", ".join(f"{i}: {n}" for i, n in enumerate(layers)))
    return out


def layer_name(node: Node) -> str:
    """The linear's name: its weight's attribute path without `.weight` (`model.layers.0.mlp.down_proj`),
    else the module that called it."""
    w = source_arg(node, "weight")
    if isinstance(w, Node) and w.op == "get_attr":
        return str(w.target).removesuffix(".weight")
    return module_path(node)


def find_fp8_linears(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if is_op(n, {SOURCE})]


@register_pass("resolve_fp8_linear", ResolveFP8LinearOptions, stage=Stage.KERNELS, requires=("export",))
def resolve_fp8_linear(ctx: BuildContext, opts: ResolveFP8LinearOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    nodes = find_fp8_linears(gm)
    if not nodes:
        return PassResult("no FP8 linears", {"layers": []})
    names = [layer_name(n) for n in nodes]
    requested = requested_backends(names, opts)
    key = arch_key(ctx.target.device)
    order: Optional[list[str]] = opts.preference.get(key)
    if order is None:
        raise ValueError(f"no FP8 linear backend preference for device class {key!r}; add "
                         f"transforms.resolve_fp8_linear.preference.{key} (backends: {', '.join(FP8_LINEAR_BACKENDS)})")
    decisions = []
    for node, layer, req in zip(nodes, names, requested):
        d = resolve_fp8_linear_backend(layer, node_facts(gm, node), ctx.target, req, order, opts.allow_fallback)
        node.target = fp8_linear_op(d.backend)
        node.meta["fp8_linear"] = d
        decisions.append(d)
    counts = Counter(d.backend for d in decisions)
    summary = f"{len(decisions)} FP8 linears: " + ", ".join(f"{c} {b}" for b, c in counts.most_common())
    return PassResult(summary, {"layers": [d.as_dict() for d in decisions]})


__all__ = ["DEFAULT_PREFERENCE", "ResolveFP8LinearOptions", "find_fp8_linears", "node_facts", "resolve_fp8_linear",
           "source_arg"]
