"""`insert_cached_mla_attention`: rewrite each `torch_mla` node into its backend's cached op.

For every node: resolve the backend (per-node: layers may differ), record the decision with its
reasons in node.meta and the build report, then replace the node by
`<backend>_mla_with_cache(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, *metadata, cache, *constants)`
and add graph inputs for the metadata fields the chosen backends consume and one cache per layer.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

import torch
from pydantic import Field, field_validator

from ..custom_ops.backend_registry import DeviceInfo, all_backends, get_backend, library_versions, source_arg
from ..custom_ops.mla_dims import MLADims
from .backend_resolution import BackendDecision, resolve_backend
from .context import BuildContext
from .registry import PassOptions, PassResult, register_pass

SOURCE_OP = torch.ops.autodeploy.torch_mla.default
CACHE_PREFIX = "mla_cache_"


def _known_backend(name: str, allow_auto: bool) -> str:
    valid = sorted(all_backends())
    if (allow_auto and name == "auto") or name in valid:
        return name
    raise ValueError(f"unknown backend {name!r}; valid: {', '.join((['auto'] if allow_auto else []) + valid)}")


class InsertCachedMLAOptions(PassOptions):
    backend: str = Field("auto", description="'auto' or a backend name, for every layer")
    preference: dict[str, list[str]] = Field(default_factory=dict, description="auto order per device class")
    layers: dict[str, str] = Field(
        default_factory=dict, description="per-layer override: layer-name glob or layer index -> backend"
    )
    allow_fallback: bool = False

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        return _known_backend(v, True)

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: dict[str, str]) -> dict[str, str]:
        for b in v.values():
            _known_backend(b, True)
        return v

    @field_validator("preference")
    @classmethod
    def _preference(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for names in v.values():
            for b in names:
                _known_backend(b, False)
        return v


def find_mla_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == SOURCE_OP]


def node_dims(node: torch.fx.Node) -> MLADims:
    if "mla_dims" in node.meta:
        return node.meta["mla_dims"]
    vals = [a.meta.get("val") for a in node.args[:5]]
    if any(v is None for v in vals):
        raise ValueError(f"{node.name}: cannot read MLA dims (no shape metadata on its inputs)")
    q_nope, q_pe, ckv, _, w = vals
    layout = source_arg(node, "layout")
    n, dn = (q_nope.shape[2], q_nope.shape[3]) if layout == "bsnd" else (q_nope.shape[1], q_nope.shape[3])
    return MLADims(int(n), int(dn), int(q_pe.shape[-1]), int(w.shape[0]) // int(n) - int(dn), int(ckv.shape[-1]))


def node_dtype(node: torch.fx.Node, default: torch.dtype) -> torch.dtype:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return val.dtype if val is not None else default


def _layer_request(layer: str, index: int, opts: InsertCachedMLAOptions) -> str:
    for pattern, backend in opts.layers.items():
        if pattern == str(index) or fnmatch.fnmatchcase(layer, pattern):
            return backend
    return opts.backend


def _add_placeholder(gm: torch.fx.GraphModule, name: str, after: Optional[torch.fx.Node]) -> torch.fx.Node:
    graph = gm.graph
    ctx = graph.inserting_after(after) if after is not None else graph.inserting_before(next(iter(graph.nodes)))
    with ctx:
        node = graph.placeholder(name)
    return node


@register_pass("insert_cached_mla_attention", InsertCachedMLAOptions)
def insert_cached_mla_attention(ctx: BuildContext, opts: InsertCachedMLAOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    nodes = find_mla_nodes(gm)
    if not nodes:
        raise ValueError(
            "insert_cached_mla_attention: the graph has no torch_mla node. Enable match_mla (HF models) "
            "or call torch.ops.autodeploy.torch_mla in the model's attention."
        )
    device = DeviceInfo.of(ctx.device)
    versions = library_versions()
    page_size = ctx.config.runtime.page_size

    decisions: list[BackendDecision] = []
    for i, node in enumerate(nodes):
        layer = node.meta.get("mla_layer", node.name)
        if source_arg(node, "is_causal") is not True:
            raise ValueError(f"{layer}: non-causal MLA cannot be served from a KV cache (is_causal=False).")
        dims = node_dims(node)
        dtype = node_dtype(node, ctx.dtype)
        decisions.append(
            resolve_backend(layer, dims, dtype, device, versions, page_size,
                            _layer_request(layer, i, opts), opts.preference, opts.allow_fallback)
        )

    # Graph inputs: existing placeholders, then metadata (union over the chosen backends), then caches.
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    meta_fields: list[str] = []
    for d in decisions:
        for f in get_backend(d.backend).metadata:
            if f not in meta_fields:
                meta_fields.append(f)
    last = placeholders[-1] if placeholders else None
    meta_nodes: dict[str, torch.fx.Node] = {}
    for f in meta_fields:
        last = meta_nodes[f] = _add_placeholder(gm, f, last)
    cache_inputs: list[dict[str, Any]] = []
    for i, (node, d) in enumerate(zip(nodes, decisions)):
        be = get_backend(d.backend)
        cache_name = f"{CACHE_PREFIX}{i}"
        cache_node = last = _add_placeholder(gm, cache_name, last)
        layout = source_arg(node, "layout")
        ins = list(node.args[:5])
        with gm.graph.inserting_before(node):
            if layout == "bnsd":  # cached ops take bsnd
                for k in (0, 1, 3):
                    ins[k] = gm.graph.call_function(torch.ops.aten.transpose.int, (ins[k], 1, 2))
            new = gm.graph.call_function(
                be.cached_op.default,
                (*ins, *(meta_nodes[f] for f in be.metadata), cache_node, *be.constants(node)),
            )
            result = new
            if layout == "bnsd":
                result = gm.graph.call_function(torch.ops.aten.transpose.int, (new, 1, 2))
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["mla_backend"] = d
        spec = be.cache_spec(d.dims, node_dtype(node, ctx.dtype))
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        cache_inputs.append({"name": cache_name, "layer": d.layer, "backend": d.backend, "spec": spec, "dims": d.dims})

    ctx.state["backend_decisions"] = decisions
    ctx.state["metadata_inputs"] = meta_fields
    ctx.state["cache_inputs"] = cache_inputs
    ctx.state["graph_inputs"] = [p.target for p in placeholders] + meta_fields + [c["name"] for c in cache_inputs]
    used = sorted({d.backend for d in decisions})
    return PassResult(
        f"{len(nodes)} MLA nodes -> {', '.join(used)}",
        {"layers": [d.to_dict() for d in decisions], "metadata_inputs": meta_fields},
    )
