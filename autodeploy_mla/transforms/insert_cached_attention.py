"""`insert_cached_mla_attention`: rewrite each `torch_mla` node into its backend's cached op.

For every node: resolve the backend (per node: layers may differ), record the decision with its
reasons in node.meta and the build report, then replace the node by
`<backend>_mla_with_cache(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, *metadata, cache, *constants)`
and add graph inputs for the metadata fields the chosen backends consume and one cache per layer.
Each layer's cache dtype comes from `runtime.kv_cache_dtype` / `runtime.kv_cache_layers`; an FP8
layer's scales (`runtime.kv_cache_scales`) become the op's `latent_scale` / `rope_scale` constants,
and resolution only picks backends whose `check_cache` accepts that dtype for the node.
The pass declares those inputs by name in a `GraphSignature`; the runtime binds them by name, so
their position among the graph's inputs carries no meaning.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TypeVar

import torch
from pydantic import Field, field_validator

from ..custom_ops.attention.registry import all_backends, get_backend
from ..custom_ops.attention.cache_format import UNIT_SCALES, CacheScales, cache_dtype_name, is_fp8, resolve_cache_dtype
from ..custom_ops.attention.mla_dims import MLADims
from ..custom_ops.attention.torch_mla import source_arg
from .fx_utils import module_path
from ..custom_ops.attention.sparse_mla import INDEXER_METADATA
from .insert_cached_sparse import INDEX_CACHE_PREFIX, LATENT_CACHE_PREFIX, rewrite_sparse, sparse_decision
from .sparse_export import sparse_mla_nodes, sparse_node_dims
from ..runtime.artifacts import CacheInput, GraphSignature
from .backend_resolution import DEVICE_CLASSES, resolve_backend
from .context import BuildContext
from .fx_utils import TORCH_MLA, aten, placeholders
from .fx_utils import shape as node_shape
from .registry import PassOptions, PassResult, Stage, register_pass

CACHE_PREFIX = LATENT_CACHE_PREFIX  # one name scheme for dense and sparse layers


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
        unknown = [k for k in v if k not in DEVICE_CLASSES]
        if unknown:
            raise ValueError(f"unknown device class {unknown[0]!r} under preference; valid device classes: "
                             f"{', '.join(DEVICE_CLASSES)}")
        for names in v.values():
            for b in names:
                _known_backend(b, False)
        return v


def find_mla_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == TORCH_MLA]


def node_dims(node: torch.fx.Node) -> MLADims:
    """The node's MLA dims: as the matcher (or shard) recorded them, else from its input shapes."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:5]]
    if "mla_dims" in node.meta:
        dims: MLADims = node.meta["mla_dims"]
        out = node_shape(node)
        heads = out[2] if source_arg(node, "layout") == "bsnd" and len(out) == 4 else (out[1] if len(out) == 4 else None)
        if isinstance(heads, int) and heads != dims.num_heads:
            raise ValueError(f"{node.meta.get('mla_layer', node.name)}: the node's output has {heads} heads but its "
                             f"recorded MLA dims say N={dims.num_heads}; a pass changed one without the other")
        return dims
    if any(v is None for v in vals):
        raise ValueError(f"{node.name}: cannot read MLA dims (no shape metadata on its inputs)")
    q_nope, q_pe, ckv, _, w = vals
    layout = source_arg(node, "layout")
    n, dn = (q_nope.shape[2], q_nope.shape[3]) if layout == "bsnd" else (q_nope.shape[1], q_nope.shape[3])
    return MLADims(int(n), int(dn), int(q_pe.shape[-1]), int(w.shape[0]) // int(n) - int(dn), int(ckv.shape[-1]))


def node_dtype(node: torch.fx.Node, default: torch.dtype) -> torch.dtype:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return val.dtype if val is not None else default


V = TypeVar("V")


def per_layer(layers: list[str], overrides: Mapping[str, V], default: V, key: str) -> list[V]:
    """Per node: the value of the first override whose pattern (layer index or name glob) matches it,
    else `default`. Every pattern must match at least one layer: a typo would otherwise silently
    change nothing (`key` names the config entry in that error)."""
    used: set[str] = set()
    out = []
    for i, layer in enumerate(layers):
        val = default
        for pattern, v in overrides.items():
            if pattern == str(i) or fnmatch.fnmatchcase(layer, pattern):
                val = v
                used.add(pattern)
                break
        out.append(val)
    unused = [p for p in overrides if p not in used]
    if unused:
        names = ", ".join(f"{i}: {name}" for i, name in enumerate(layers))
        raise ValueError(
            f"{key}: {', '.join(repr(p) for p in unused)} match no MLA layer. "
            f"Use a layer index or a glob over these layer names ({len(layers)} layers) — {names}"
        )
    return out


def _layer_requests(layers: list[str], opts: InsertCachedMLAOptions) -> list[str]:
    return per_layer(layers, opts.layers, opts.backend, "insert_cached_mla_attention.layers")


def layer_cache_formats(layers: list[str], ctx: BuildContext, dtypes: list[torch.dtype]) -> list[tuple[torch.dtype, CacheScales]]:
    """Per node: its paged-cache dtype and FP8 scales, from the runtime config (activations' dtype for `auto`)."""
    rt = ctx.config.runtime
    names = per_layer(layers, rt.kv_cache_layers, rt.kv_cache_dtype, "runtime.kv_cache_layers")
    scales = per_layer(layers, rt.kv_cache_scales, None, "runtime.kv_cache_scales")
    out = []
    for name, sc, dt in zip(names, scales, dtypes):
        cache_dtype = resolve_cache_dtype(name, dt)
        fp8_scales = sc is not None and is_fp8(cache_dtype)
        out.append((cache_dtype, CacheScales(sc.latent, sc.rope) if fp8_scales else UNIT_SCALES))
    return out


@register_pass("insert_cached_mla_attention", InsertCachedMLAOptions, stage=Stage.CACHE, requires=("export",))
def insert_cached_mla_attention(ctx: BuildContext, opts: InsertCachedMLAOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    nodes = find_mla_nodes(gm)
    sparse = sparse_mla_nodes(gm)
    if not nodes and not sparse:
        raise ValueError(
            "insert_cached_mla_attention: the graph has no torch_mla node. Enable match_mla (HF models) "
            "or call torch.ops.autodeploy.torch_mla in the model's attention."
        )
    tokens = tuple(p.target for p in placeholders(gm))
    if len(tokens) != 2:
        raise ValueError(f"insert_cached_mla_attention: expected the exported graph's two inputs (input_ids, "
                         f"position_ids), found {list(tokens)}")
    layers = [n.meta.get("mla_layer", n.name) for n in nodes]
    sparse_layers = [module_path(n) for n in sparse]
    # Per-layer options (backend, cache dtype) address dense and sparse layers in one numbering.
    n_dense = len(layers)
    all_requests = _layer_requests(layers + sparse_layers, opts)
    requests, sparse_requests = all_requests[:n_dense], all_requests[n_dense:]
    all_formats = layer_cache_formats(layers + sparse_layers, ctx,
                                      [node_dtype(n, ctx.dtype) for n in nodes] + [ctx.dtype] * len(sparse))
    formats, sparse_formats = all_formats[:n_dense], all_formats[n_dense:]
    dtypes = [node_dtype(n, ctx.dtype) for n in nodes]
    decisions = []
    for node, layer, req, dt, (cache_dtype, _) in zip(nodes, layers, requests, dtypes, formats):
        if source_arg(node, "is_causal") is not True:
            raise ValueError(f"{layer}: non-causal MLA cannot be served from a KV cache (is_causal=False).")
        decisions.append(resolve_backend(layer, node_dims(node), dt, ctx.target, req,
                                         opts.preference, opts.allow_fallback, cache_dtype))

    # Graph inputs: metadata (union over the chosen backends), then one cache per layer.
    sparse_decisions = [sparse_decision(layer, sparse_node_dims(n), ctx.dtype, req, ctx.target, opts.allow_fallback)
                        for n, layer, req in
                        zip(sparse, sparse_layers, sparse_requests)]
    meta_fields: list[str] = []
    for fields in [*(get_backend(d.backend).metadata for d in decisions), *([INDEXER_METADATA] if sparse else [])]:
        for f in fields:
            if f not in meta_fields:
                meta_fields.append(f)
    last = placeholders(gm)[-1]
    meta_nodes: dict[str, torch.fx.Node] = {}
    for f in meta_fields:
        with gm.graph.inserting_after(last):
            last = meta_nodes[f] = gm.graph.placeholder(f)
    caches: list[CacheInput] = []
    for i, (node, d, dt, (cache_dtype, scales)) in enumerate(zip(nodes, decisions, dtypes, formats)):
        be = get_backend(d.backend)
        fp8 = (scales.latent, scales.rope) if is_fp8(cache_dtype) else ()
        cache_name = f"{CACHE_PREFIX}{i}"
        with gm.graph.inserting_after(last):
            cache_node = last = gm.graph.placeholder(cache_name)
        layout = source_arg(node, "layout")
        ins = list(node.args[:5])
        with gm.graph.inserting_before(node):
            if layout == "bnsd":  # cached ops take bsnd
                for k in (0, 1, 3):
                    ins[k] = gm.graph.call_function(aten.transpose.int, (ins[k], 1, 2))
            new = gm.graph.call_function(
                be.cached_op.default,
                (*ins, *(meta_nodes[f] for f in be.metadata), cache_node, *be.constants(node), *fp8),
            )
            result = new
            if layout == "bnsd":
                result = gm.graph.call_function(aten.transpose.int, (new, 1, 2))
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["mla_backend"] = d
        caches.append(CacheInput(cache_name, d.layer, d.backend, d.dims, be.cache_spec(d.dims, dt, cache_dtype, scales)))
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)

    if sparse:
        last, sparse_caches = rewrite_sparse(gm, sparse, sparse_decisions, sparse_formats, meta_nodes, last,
                                             len(caches), ctx.dtype)
        caches += sparse_caches
        decisions = [*decisions, *sparse_decisions]
    ctx.artifacts.decisions = decisions
    ctx.artifacts.signature = GraphSignature(tuple(meta_fields), tuple(caches), tokens)
    used = sorted({d.backend for d in decisions})
    cache_kinds = sorted({cache_dtype_name(c.spec.dtype) for c in caches})
    layer_rows = []
    index_caches = {c.layer: c for c in caches if c.name.startswith(INDEX_CACHE_PREFIX)}
    for d, c in zip(decisions, [c for c in caches if not c.name.startswith(INDEX_CACHE_PREFIX)]):
        row = d.to_dict()
        row["cache"] = {"dtype": cache_dtype_name(c.spec.dtype), "bytes_per_token": c.spec.bytes_per_token}
        if d.layer in index_caches:  # DSA: the indexer's keys, paged with the latent
            row["cache"]["index_key_bytes_per_token"] = index_caches[d.layer].spec.bytes_per_token
        if is_fp8(c.spec.dtype):
            row["cache"]["scales"] = {"latent": c.spec.scales.latent, "rope": c.spec.scales.rope}
        layer_rows.append(row)
    return PassResult(
        f"{len(nodes)} MLA nodes -> {', '.join(used)}; cache {', '.join(cache_kinds)}"
        + (f"; {len(sparse)} sparse MLA nodes -> {', '.join(sorted({d.backend for d in sparse_decisions}))} "
           "(index keys paged next to the latent)" if sparse else ""),
        {"layers": layer_rows, "metadata_inputs": meta_fields},
    )
