"""Cache insertion for sparse MLA (DeepSeek Sparse Attention), part of `insert_cached_mla_attention`.

Each `torch_mla_sparse` node becomes its backend's `*_mla_sparse_with_cache` over the layer's latent
cache (the dense MLA layout, [pages, page_size, R + Dr]); each `torch_dsa_indexer` becomes
`*_dsa_indexer_with_cache` over a second cache of the same layer, its index keys
([pages, page_size, D], `dsa_index_cache_<i>`), paged by the same page table so one allocation
covers both. Layers that reuse an earlier layer's selection (GLM-5 "shared") keep only the latent.
Backends, in `auto` order on CUDA: FlashInfer's MLA wrapper over one-token pages
(flashinfer/sparse.py), Triton (gather kernels, triton_mla/sparse.py), else the torch reference; the
decision says which and why, and why each faster one was passed over. The ops come from each
backend's descriptor (`sparse_ops`, resolved by `sparse_ops_of`): this pass imports no backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..custom_ops.attention.cache_format import CacheScales, is_fp8
from ..custom_ops.attention.mla_dims import MLADims
from ..custom_ops.attention.registry import BackendDecision, CacheSpec, Target, all_backends, get_backend, sparse_ops_of
from ..custom_ops.attention.sparse_mla import DSA_INDEXER, INDEXER_METADATA
from ..runtime.artifacts import CacheInput
from .backend_resolution import first_accepted


#: backends that serve sparse layers, in `auto` order (fastest first on the H200:
#: docs/benchmarks/sparse_mla.md)
SPARSE_BACKENDS = ("flashinfer_mla_sparse", "triton", "torch")


def sparse_sibling(requested: str) -> str:
    """A dense backend requested for every layer serves a model's sparse layers through the sparse
    sibling its descriptor declares (`MLABackend.sparse_sibling`); any other name stays as it is."""
    be = all_backends().get(requested)
    return be.sparse_sibling if be is not None and be.sparse_sibling else requested

LATENT_CACHE_PREFIX = "mla_cache_"
INDEX_CACHE_PREFIX = "dsa_index_cache_"
INDEXER = DSA_INDEXER.default


def sparse_decision(layer: str, dims: MLADims, dtype: torch.dtype, requested: str, target: Target,
                    allow_fallback: bool = False) -> BackendDecision:
    """Which backend serves a sparse layer: an explicit request (a dense backend with a sparse sibling
    maps to it) must be accepted by that backend's check, or with `allow_fallback` resolution goes on
    as for `auto`, which takes the first of SPARSE_BACKENDS whose check accepts the layer on a CUDA
    device, else the torch reference."""
    wanted = sparse_sibling(requested)
    if wanted not in ("auto", *SPARSE_BACKENDS):
        raise ValueError(f"{layer}: backend {requested!r} was requested, but {layer} is sparse MLA (DeepSeek Sparse "
                         f"Attention), which only {', '.join(map(repr, SPARSE_BACKENDS))} serve so far; request 'auto' "
                         "or one of those for it")
    rejected: list[tuple[str, str]] = []
    if wanted != "auto":
        res = get_backend(wanted).check(dims, dtype, target)
        how = "requested" if wanted == requested else f"{requested!r} requested: its sparse sibling"
        if res.ok:
            return BackendDecision(layer, dims, requested, wanted, f"sparse MLA (DSA): {how}; {res.reason}")
        if not allow_fallback:
            raise ValueError(f"{layer}: backend {wanted!r} was requested for sparse MLA but refuses: {res.reason}. "
                             "Choose another backend, use `auto`, or set insert_cached_mla_attention.allow_fallback: true.")
        rejected.append((wanted, res.reason))
    if target.device.type == "cuda":
        name, why = first_accepted(SPARSE_BACKENDS[:-1], wanted, lambda b: get_backend(b).check(dims, dtype, target),
                                   rejected)
        if name is not None:
            how = "fallback" if wanted != "auto" else "auto"
            return BackendDecision(layer, dims, requested, name,
                                   f"sparse MLA (DSA): {how}: first accepted in the sparse auto order; {why}",
                                   tuple(rejected))
    why = "not on CUDA" if target.device.type != "cuda" else "no faster sparse backend accepts the layer"
    return BackendDecision(layer, dims, requested, "torch", f"sparse MLA (DSA): torch reference ({why})",
                           tuple(rejected))


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
    caches: list[CacheInput] = []
    meta = [meta_nodes[f] for f in INDEXER_METADATA]
    for i, (node, d, (cache_dtype, scales)) in enumerate(zip(nodes, decisions, formats)):
        if is_fp8(cache_dtype):
            raise ValueError(f"{d.layer}: an FP8 cache is not supported for sparse MLA yet; use the model dtype")
        is_causal = node.args[6] if len(node.args) > 6 else node.kwargs.get("is_causal", True)
        if is_causal is not True:
            raise ValueError(f"{d.layer}: non-causal sparse MLA cannot be served from a KV cache (is_causal=False).")
        k = first_index + i
        with gm.graph.inserting_after(last):
            latent = last = gm.graph.placeholder(f"{LATENT_CACHE_PREFIX}{k}")
        ops = sparse_ops_of(d.backend)  # declared by the backend's descriptor
        indexer_op, sparse_op = ops.indexer, ops.attention
        topk_width = int(node.args[5].meta["val"].shape[-1])
        caches.append(CacheInput(latent.name, d.layer, d.backend, d.dims, get_backend(d.backend).cache_spec(d.dims, dtype),
                                 index_topk=topk_width))
        indexer = _own_indexer(node)
        if indexer is not None:
            q, key, w = indexer.args[:3]
            index_topk, scale = indexer.args[3], indexer.args[4]
            d_idx = int(key.meta["val"].shape[-1])
            with gm.graph.inserting_after(last):
                icache = last = gm.graph.placeholder(f"{INDEX_CACHE_PREFIX}{k}")
            caches.append(CacheInput(icache.name, d.layer, d.backend, d.dims, CacheSpec(width=d_idx, dtype=dtype)))
            with gm.graph.inserting_before(indexer):
                new_idx = gm.graph.call_function(indexer_op.default,
                                                 (q, key, w, *meta, icache, index_topk, scale))
            new_idx.meta.update({m: v for m, v in indexer.meta.items() if m != "val"})
            indexer.replace_all_uses_with(new_idx)
            gm.graph.erase_node(indexer)
        scale_arg: Any = node.args[7] if len(node.args) > 7 else node.kwargs.get("scale")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(sparse_op.default,
                                         (*node.args[:5], *meta, node.args[5], latent,
                                          None if scale_arg is None else float(scale_arg)))
        new.meta.update({m: v for m, v in node.meta.items() if m != "val"})
        new.meta["mla_backend"] = d
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return last, caches
