"""What the matcher works with: the public records and error, the normalised attention found in
the graph, the rewrite plan of one block, and the op tables the walks use."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

from torch.fx import Node

from ...custom_ops.attention.mla_dims import MLADims
from ..fx_utils import aten



# HF attention class → family key reported in MLAMatch.kind.
_FAMILY_BY_CLASS = {
    "DeepseekV2Attention": "deepseek_v2",
    "DeepseekV3Attention": "deepseek_v3",
    "Glm4MoeLiteAttention": "glm4_moe_lite",
    "MiniCPM3Attention": "minicpm3",
    "Mistral4Attention": "mistral4",
    "YoutuAttention": "youtu",
}

# Ops that only move/reshape data; used to find where key and value come from.
_MOVEMENT = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.transpose.int,
    aten.permute.default,
    aten.split_with_sizes.default,
    aten.split.Tensor,
    aten.slice.Tensor,
    aten.expand.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.cat.default,
    operator.getitem,
}
_ALLOCATIONS = {aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default, aten.zeros.default}
# Probe (batch, seq) sizes at which a mask must equal the causal mask.
_MASK_PROBES = ((2, 1), (2, 7), (1, 64), (1, 333))


class MLAMatchError(RuntimeError):
    """An attention block looks like MLA but cannot be proven equivalent to torch_mla."""


@dataclass
class MLAMatch:
    """One torch_mla node of the matched graph, for the build report and the later passes."""

    layer: str  # module path, e.g. "model.layers.3.self_attn"
    node: str  # name of the torch_mla node in the graph
    dims: MLADims
    scale: float  # softmax scale passed to torch_mla (YaRN mscale included)
    kind: str  # HF family whose pattern matched ("deepseek_v3", ...), "mla" if unknown, "native"
    source: str  # what was rewritten: "sdpa", "eager" (matmul-softmax-matmul) or "torch_mla"
    notes: list[str] = field(default_factory=list)


@dataclass
class _Attention:
    """One attention computation found in the graph, normalised across SDPA and eager."""

    anchor: Node  # node producing the attention output [B, N, S, Dv]
    source: str
    layer: str
    kind: str
    q: Optional[Node]  # None when an eager chain was found but not understood (see problems)
    k: Optional[Node]
    v: Node
    mask: Optional[Node]
    is_causal: bool
    scale: Optional[float]
    problems: list[str]  # structural deviations found while parsing (eager chain)


@dataclass
class _Plan:
    """Everything needed to rewrite one attention block; built before any mutation."""

    att: _Attention
    q_nope: Node  # [B, N, S, Dn], or [B, S, N, Dn] if q_bsnd
    q_pe: Node  # [B, N, S, Dr], or [B, S, N, Dr] if q_bsnd
    q_bsnd: bool  # the query was concatenated in [B, S, N, D] and then transposed
    q_factor: Optional[Any]  # Node or number multiplying the whole [B,N,S,D] query (Mistral4), or None
    latent: Node  # [B, S, R] or [B, 1, S, R]
    kpe: Node  # [B, 1, S, Dr]
    weight: Node  # get_attr of kv_b_proj weight [N*(Dn+Dv), R]
    dims: MLADims
    scale: float
    notes: list[str]
    kv_b_fp8: Optional[Any] = None  # FP8LinearParts of an FP8 kv_b_proj (weight is then its FP8 get_attr)


class _Refuse(Exception):
    """Internal: a check failed; turned into MLAMatchError (MLA-like) or a skip (plain attention)."""
