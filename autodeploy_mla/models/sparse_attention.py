"""Detect DeepSeek Sparse Attention (DSA) in a Hugging Face model before it is exported.

DeepSeek-V3.2, GLM-5 and the families derived from them put a "lightning indexer" next to MLA: it
scores every cached token for each query and the attention sees only the `index_topk` best.
Compiling such a model as dense MLA would silently change its outputs once a sequence is longer than
`index_topk`, so the compiler must know before it starts.

Detection is by structure, never by family or class name, so a family nobody listed is found too:
an *indexer* is a submodule that carries an integer `index_topk` of its own (the top-k width is the
one setting every DSA indexer needs); the module holding it as an attribute is a *sparse attention*;
a module of the same class that holds None under that attribute is a layer without an indexer of its
own (GLM-5's "shared" layers reuse an earlier selection). Whether the attention really uses the
indexer, and how, is proven later against the module's own forward (transforms/sparse_export.py).
docs/sparse_mla.md has the math and what is proven.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

__all__ = ["SparseAttentionInfo", "find_sparse_attention", "indexer_topk"]


@dataclass(frozen=True)
class SparseAttentionInfo:
    """What a model's sparse attention looks like, for an error or a report."""

    model_class: str
    #: the widest top-k of the model's indexers
    index_topk: int
    index_n_heads: Optional[int]
    index_head_dim: Optional[int]
    #: module paths of the indexers (one per layer that scores its own top-k)
    indexer_paths: tuple[str, ...]
    #: positions (in `attention_paths`) of the layers without an indexer of their own
    shared_layers: tuple[int, ...]
    #: module paths of every sparse attention module, with or without its own indexer, in model order
    attention_paths: tuple[str, ...] = ()
    #: the attribute under which an attention holds its indexer (None on layers without one)
    indexer_attr: str = "indexer"

    def describe(self) -> str:
        paths = self.indexer_paths
        shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")
        shared = (f"; layers {list(self.shared_layers)} have no indexer of their own"
                  if self.shared_layers else "")
        return (f"{self.model_class} uses DeepSeek Sparse Attention: indexers at {shown} pick the "
                f"index_topk={self.index_topk} best cached tokens per query (index_n_heads="
                f"{self.index_n_heads}, index_head_dim={self.index_head_dim}){shared}")


def indexer_topk(module: nn.Module) -> Optional[int]:
    """The module's own integer `index_topk` (not one read through a config), else None.

    Only an indexer stores the width itself; attention modules, decoder layers and the model reach
    it through `config`, which is why the attribute has to be the module's own."""
    value = module.__dict__.get("index_topk")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _index_dims(indexer: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """(heads, head dim) of an indexer: from its key projection's width and its query projection's,
    else from the attributes DSA indexers carry."""
    wk, wq = getattr(indexer, "wk", None), getattr(indexer, "wq_b", None)
    d = getattr(wk, "out_features", None) or getattr(indexer, "head_dim", None)
    h = getattr(indexer, "n_heads", None)
    if h is None and d and getattr(wq, "out_features", None):
        h = wq.out_features // d
    return h, d


def find_sparse_attention(model: nn.Module) -> Optional[SparseAttentionInfo]:
    """The model's DSA layout (module doc), or None for a dense model.

    Configs that carry DSA keys without any indexer module (dense attention) stay dense."""
    modules = dict(model.named_modules())
    indexers = [(name, m) for name, m in modules.items() if "." in name and indexer_topk(m) is not None]
    # an indexer nested in another indexer's subtree is not a second selection
    indexers = [(n, m) for n, m in indexers if not any(n.startswith(o + ".") for o, _ in indexers)]
    if not indexers:
        return None
    attrs = {n.rsplit(".", 1)[1] for n, _ in indexers}
    parents = {n.rsplit(".", 1)[0] for n, _ in indexers}
    classes = {type(modules[p]) for p in parents}
    attention = []
    for name, m in modules.items():
        if name in parents:
            attention.append(name)
        elif type(m) in classes and any(a in m.__dict__.get("_modules", {}) or a in m.__dict__ for a in attrs) \
                and all(getattr(m, a, None) is None for a in attrs):
            attention.append(name)
    shared = tuple(i for i, p in enumerate(attention) if p not in parents)
    heads, dim = _index_dims(indexers[0][1])
    attr = sorted(attrs)[0]
    return SparseAttentionInfo(type(model).__name__, max(indexer_topk(m) for _, m in indexers), heads, dim,
                               tuple(n for n, _ in indexers), shared, tuple(attention), attr)
