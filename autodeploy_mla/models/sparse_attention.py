"""Detect DeepSeek Sparse Attention (DSA) in a Hugging Face model before it is exported.

DeepSeek-V3.2 (`DeepseekV32ForCausalLM`), GLM-5 (`GlmMoeDsaForCausalLM`) and several newer families
put a "lightning indexer" next to MLA: it scores every cached token for each query and the attention
sees only the `index_topk` best. Compiling such a model as dense MLA would silently change its
outputs once a sequence is longer than `index_topk`, so the compiler must know before it starts.
docs/sparse_mla.md has the math and the plan for capturing it (issue 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

__all__ = ["SparseAttentionInfo", "find_sparse_attention"]


@dataclass(frozen=True)
class SparseAttentionInfo:
    """What a model's sparse attention looks like, for an error or a report."""

    model_class: str
    index_topk: int
    index_n_heads: Optional[int]
    index_head_dim: Optional[int]
    #: module paths of the indexers (one per layer that scores its own top-k)
    indexer_paths: tuple[str, ...]
    #: layer indices that reuse an earlier layer's top-k (GLM-5 `indexer_types` "shared")
    shared_layers: tuple[int, ...]

    def describe(self) -> str:
        paths = self.indexer_paths
        shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")
        shared = (f"; layers {list(self.shared_layers)} reuse an earlier layer's selection"
                  if self.shared_layers else "")
        return (f"{self.model_class} uses DeepSeek Sparse Attention: indexers at {shown} pick the "
                f"index_topk={self.index_topk} best cached tokens per query (index_n_heads="
                f"{self.index_n_heads}, index_head_dim={self.index_head_dim}){shared}")


def find_sparse_attention(model: nn.Module) -> Optional[SparseAttentionInfo]:
    """The model's DSA layout, or None for a dense model.

    A model counts as sparse when its config sets an integer `index_topk` and at least one submodule
    named `indexer` exists (configs that only carry the keys, with dense attention, stay dense)."""
    config = getattr(model, "config", None)
    topk = getattr(config, "index_topk", None)
    if not isinstance(topk, int) or isinstance(topk, bool):
        return None
    paths = tuple(name for name, mod in model.named_modules()
                  if name.rsplit(".", 1)[-1] == "indexer" and mod is not None)
    if not paths:
        return None
    kinds = getattr(config, "indexer_types", None) or ()
    shared = tuple(i for i, kind in enumerate(kinds) if kind == "shared")
    return SparseAttentionInfo(type(model).__name__, topk, getattr(config, "index_n_heads", None),
                               getattr(config, "index_head_dim", None), paths, shared)
