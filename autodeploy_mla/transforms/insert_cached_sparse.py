"""Cache insertion for sparse MLA (DeepSeek Sparse Attention), part of `insert_cached_mla_attention`.

Each `torch_mla_sparse` node becomes `torch_mla_sparse_with_cache` over the layer's latent cache (the
dense MLA layout, [pages, page_size, R + Dr]); each `torch_dsa_indexer` becomes
`torch_dsa_indexer_with_cache` over a second cache of the same layer, its index keys
([pages, page_size, D], `dsa_index_cache_<i>`), paged by the same page table so one allocation
covers both. Layers that reuse an earlier layer's selection (GLM-5 "shared") keep only the latent.
The torch reference backend is the only one that serves sparse MLA so far; the decision says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..custom_ops.backend_registry import BackendDecision, CacheSpec, get_backend
from ..custom_ops.cache_format import CacheScales, is_fp8
from ..custom_ops.mla_dims import MLADims, infer_dims
from ..custom_ops.sparse_mla import DSA_INDEXER, DSA_INDEXER_WITH_CACHE, SPARSE_OP
from ..custom_ops.torch_backend import torch_mla_sparse_with_cache
from ..runtime.artifacts import CacheInput
from .fx_utils import module_path

SPARSE_BACKEND = "torch"
LATENT_CACHE_PREFIX = "mla_cache_"
INDEX_CACHE_PREFIX = "dsa_index_cache_"
INDEXER = DSA_INDEXER.default


def sparse_node_dims(node: torch.fx.Node) -> MLADims:
    """MLA dims of a `torch_mla_sparse` node (bsnd, as sparse export emits it) from its input shapes."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:5]]
    if any(v is None for v in vals):
        raise ValueError(f"{module_path(node)}: cannot read the sparse MLA dims (no shape metadata on its inputs)")
    return infer_dims(SPARSE_OP, *vals, "bsnd")[0]


def sparse_decision(layer: str, dims: MLADims, requested: str) -> BackendDecision:
    """Sparse layers run on the torch reference (the only sparse backend so far); a request for
    another backend is refused rather than silently ignored."""
    if requested not in ("auto", SPARSE_BACKEND):
        raise ValueError(f"{layer}: backend {requested!r} was requested, but {layer} is sparse MLA (DeepSeek Sparse "
                         f"Attention), which only the {SPARSE_BACKEND!r} backend serves so far; request 'auto' or "
                         f"'{SPARSE_BACKEND}' for it")
    return BackendDecision(layer, dims, requested, SPARSE_BACKEND,
                           "sparse MLA (DSA): the torch reference is the only backend that serves it so far")


def _own_indexer(node: torch.fx.Node) -> torch.fx.Node | None:
    """The (not yet rewritten) `torch_dsa_indexer` node this sparse MLA node takes its selection
    from: its own layer's. None for a layer reusing an earlier layer's selection, whose indexer was
    rewritten together with that layer."""
    arg = node.args[5]
    return arg if isinstance(arg, torch.fx.Node) and arg.target is INDEXER else None


def rewrite_sparse(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    decisions: Sequence[BackendDecision],
    formats: Sequence[tuple[torch.dtype, CacheScales]],
    meta_nodes: dict[str, torch.fx.Node],
    last: torch.fx.Node,
    first_index: int,
    dtype: torch.dtype,
) -> tuple[torch.fx.Node, list[CacheInput]]:
    """Rewrite the sparse nodes in place; returns the last placeholder and the caches it added
    (per layer: its latent cache, then its index-key cache for layers that run an indexer)."""
    be = get_backend(SPARSE_BACKEND)
    caches: list[CacheInput] = []
    meta = [meta_nodes[f] for f in be.metadata]
    for i, (node, d, (cache_dtype, scales)) in enumerate(zip(nodes, decisions, formats)):
        if is_fp8(cache_dtype):
            raise ValueError(f"{d.layer}: an FP8 cache is not supported for sparse MLA yet; use the model dtype")
        is_causal = node.args[6] if len(node.args) > 6 else node.kwargs.get("is_causal", True)
        if is_causal is not True:
            raise ValueError(f"{d.layer}: non-causal sparse MLA cannot be served from a KV cache (is_causal=False).")
        k = first_index + i
        with gm.graph.inserting_after(last):
            latent = last = gm.graph.placeholder(f"{LATENT_CACHE_PREFIX}{k}")
        caches.append(CacheInput(latent.name, d.layer, SPARSE_BACKEND, d.dims, be.cache_spec(d.dims, dtype)))
        indexer = _own_indexer(node)
        if indexer is not None:
            q, key, w = indexer.args[:3]
            index_topk, scale = indexer.args[3], indexer.args[4]
            d_idx = int(key.meta["val"].shape[-1])
            with gm.graph.inserting_after(last):
                icache = last = gm.graph.placeholder(f"{INDEX_CACHE_PREFIX}{k}")
            caches.append(CacheInput(icache.name, d.layer, SPARSE_BACKEND, d.dims, CacheSpec(width=d_idx, dtype=dtype)))
            with gm.graph.inserting_before(indexer):
                new_idx = gm.graph.call_function(DSA_INDEXER_WITH_CACHE.default,
                                                 (q, key, w, *meta, icache, index_topk, scale))
            new_idx.meta.update({m: v for m, v in indexer.meta.items() if m != "val"})
            indexer.replace_all_uses_with(new_idx)
            gm.graph.erase_node(indexer)
        scale_arg: Any = node.args[7] if len(node.args) > 7 else node.kwargs.get("scale")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch_mla_sparse_with_cache.default,
                                         (*node.args[:5], *meta, node.args[5], latent,
                                          None if scale_arg is None else float(scale_arg)))
        new.meta.update({m: v for m, v in node.meta.items() if m != "val"})
        new.meta["mla_backend"] = d
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return last, caches
