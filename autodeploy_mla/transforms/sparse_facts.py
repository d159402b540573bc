"""What `sparse_forward` must know about a sparse attention module, and the candidates tried to learn it.

DSA families agree on the design (an MLA attention plus a lightning indexer: index queries from the
query latent, one index key per token, a weighted sum over index heads of relu(q . k), the top-k)
and differ in details that change which tokens are selected: the RoPE layout of the index queries
and keys, the index-key normalisation, the weighting of the heads' scores, the RoPE layout of the
attention itself, and whether a layer without an indexer reuses an earlier layer's selection. Each
detail is a small, closed set of candidates here; transforms/sparse_export.py proves, per kind of
layer, which candidate reproduces the module's own forward, so no table of family names is needed
and a new family that only recombines known details works unchanged. A module that no candidate
reproduces is refused, naming what was tried.

Only what the DSA source ops can express is a candidate: `torch_dsa_indexer` computes
sum_h w_h * relu(q_h . k * scale) and keeps the top-k, so a candidate may change how q, k and w are
made, never the score formula. Positive constant factors (scale, H^-1/2) cannot change a top-k, so
candidates that differ only by such a factor would be indistinguishable and are not listed twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["RopeLayout", "KeyNorm", "ScoreWeighting", "IndexerFacts", "LayerFacts", "indexer_rope_candidates",
           "ATTENTION_ROPE_CANDIDATES", "SCORE_WEIGHTINGS", "key_norm_candidates"]


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE pairing dim i with dim i + r/2 (`rotate_half`); cos/sin are `cat(freqs, freqs)`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rotate_adjacent(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE pairing dims 2i and 2i+1. The rotated pairs come out de-interleaved (evens' results, then
    odds'): the same permutation on queries and keys, so every dot product equals the interleaved one."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.cat([xe * c - xo * s, xo * c + xe * s], dim=-1)


@dataclass(frozen=True)
class RopeLayout:
    """Which dims of a vector are rotated (`where`: the first or last r, r = the RoPE width) and how
    they are paired (`pairs`: "halves", "adjacent" or "none")."""

    pairs: str
    where: str = "first"

    @property
    def name(self) -> str:
        if self.pairs == "none":
            return "none"
        kind = "half-split" if self.pairs == "halves" else "interleaved"
        return f"{kind} on the {self.where} r dims"

    def fits(self, dim: int, width: int) -> bool:
        """Whether this layout can rotate `width` of a `dim`-wide vector (and is not the same as another
        candidate there: with width == dim the first and the last r dims coincide)."""
        if self.pairs == "none":
            return True
        return width % 2 == 0 and 0 < width <= dim and not (self.where == "last" and width == dim)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., D]; cos/sin broadcastable to [..., r]."""
        r = cos.shape[-1]
        if self.pairs == "none" or r == 0:
            return x
        rotate = _rotate_halves if self.pairs == "halves" else _rotate_adjacent
        if self.where == "first":
            rot, rest = x[..., :r], x[..., r:]
            return torch.cat([rotate(rot, cos, sin), rest], dim=-1) if rest.shape[-1] else rotate(rot, cos, sin)
        rest, rot = x[..., :-r], x[..., -r:]
        return torch.cat([rest, rotate(rot, cos, sin)], dim=-1)


#: the indexer's RoPE, most common first (DeepSeek-V3.2 ropes half-split, GLM-5 interleaved, both on the
#: first r dims of the index vectors; docs/sparse_mla.md)
_INDEXER_ROPES = (RopeLayout("halves", "first"), RopeLayout("adjacent", "first"), RopeLayout("halves", "last"),
                  RopeLayout("adjacent", "last"), RopeLayout("none"))

#: the attention's own RoPE on q_pe / k_pe (exactly r dims): interleaved in every DeepSeek-derived MLA
ATTENTION_ROPE_CANDIDATES = (RopeLayout("adjacent"), RopeLayout("halves"))


def indexer_rope_candidates(dim: int, width: int) -> tuple[RopeLayout, ...]:
    return tuple(c for c in _INDEXER_ROPES if c.fits(dim, width))


@dataclass(frozen=True)
class KeyNorm:
    """The normalisation of the index keys: the indexer's child module `child` (applied in its own
    parameter dtype, as fp32-kept norms are), or none."""

    child: Optional[str]
    kind: str = ""

    @property
    def name(self) -> str:
        return "none" if self.child is None else f"indexer.{self.child} ({self.kind})"

    def apply(self, indexer: nn.Module, k: torch.Tensor) -> torch.Tensor:
        if self.child is None:
            return k
        norm = getattr(indexer, self.child)
        p = next(norm.parameters(), None)
        return norm(k if p is None else k.to(p.dtype)).to(k.dtype)


def key_norm_candidates(indexer: nn.Module, dim: int) -> tuple[KeyNorm, ...]:
    """The indexer's children shaped like a norm over the index-key width (every parameter a vector of
    `dim` values: LayerNorm, RMSNorm), then no norm."""
    found = []
    for name, child in indexer.named_children():
        params = list(child.parameters())
        if params and all(p.dim() == 1 and p.shape[0] == dim for p in params):
            found.append(KeyNorm(name, type(child).__name__))
    return (*found, KeyNorm(None))


@dataclass(frozen=True)
class ScoreWeighting:
    """How the per-head weights w [B, S, H] of the index score are made from the attention input x:
    "projected" (weights_proj(x) * H^-1/2), "softmax" (softmax over heads of weights_proj(x)), or
    "uniform" (every head H^-1/2; for an indexer without a weight projection)."""

    kind: str

    @property
    def name(self) -> str:
        return {"projected": "weights_proj(x) * H^-1/2", "softmax": "softmax over heads of weights_proj(x)",
                "uniform": "uniform H^-1/2"}[self.kind]

    def fits(self, indexer: nn.Module) -> bool:
        return (self.kind == "uniform") != isinstance(getattr(indexer, "weights_proj", None), nn.Module)

    def weights(self, indexer: nn.Module, x: torch.Tensor, heads: int) -> torch.Tensor:
        if self.kind == "uniform":
            return x.new_full((*x.shape[:-1], heads), heads ** -0.5, dtype=torch.float32)
        proj = indexer.weights_proj
        w = proj(x.to(proj.weight.dtype)).float()
        return w * heads ** -0.5 if self.kind == "projected" else torch.softmax(w, dim=-1)


SCORE_WEIGHTINGS = (ScoreWeighting("projected"), ScoreWeighting("softmax"), ScoreWeighting("uniform"))


@dataclass(frozen=True)
class IndexerFacts:
    rope: RopeLayout
    key_norm: KeyNorm
    weighting: ScoreWeighting

    def describe(self, dim: int, width: int) -> dict[str, str]:
        rope = self.rope.name.replace("r dims", f"{width} of {dim} dims")
        return {"indexer_rope": rope, "index_key_norm": self.key_norm.name, "score_weighting": self.weighting.name}


@dataclass(frozen=True)
class LayerFacts:
    """Everything `sparse_forward` needs for one kind of sparse attention layer."""

    #: the attribute holding the layer's indexer (None on layers without one)
    indexer_attr: str
    attention_rope: RopeLayout
    #: None: the layer takes an earlier layer's selection instead of running an indexer
    indexer: Optional[IndexerFacts]
    #: the forward parameter an earlier selection arrives in (None: the layer takes none)
    selection_param: Optional[str]
    #: length of the forward's output tuple (0: it returns a bare tensor)
    outputs: int
    #: the output position the layer passes its selection on at (None: it does not)
    selection_output: Optional[int]

    def describe(self) -> dict[str, Any]:
        return {"attention_rope": self.attention_rope.name.replace(" on the first r dims", ""),
                "takes_selection_from": self.selection_param,
                "passes_selection_on": None if self.selection_output is None else f"output {self.selection_output}"}
