"""What the compiler hands the runtime: typed, named, and complete.

The passes fill these in (transforms/context.BuildArtifacts); `ModelRunner` builds caches,
allocator, backend sessions and the step runner from them and binds graph inputs **by name**, so no
pass, runtime file or caller has to agree with another on a positional order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ..custom_ops.attention.registry import CacheSpec
from ..custom_ops.attention.mla_dims import MLADims
from .piecewise import SplitGraph

TOKEN_INPUTS: tuple[str, ...] = ("input_ids", "position_ids")


@dataclass(frozen=True)
class CacheInput:
    """One paged-cache graph input: which layer it serves, through which backend, in what layout."""

    name: str  # graph input name
    layer: str
    backend: str
    dims: MLADims
    spec: CacheSpec
    #: sparse (DSA) layers' latent caches: the top-k width their attention reads (0 otherwise)
    index_topk: int = 0


@dataclass(frozen=True)
class GraphSignature:
    """The cached graph's inputs by kind: tokens (`[1, T]` views), metadata fields (names of
    SequenceInfo fields, `<field>_host` for host mirrors), and one paged cache per MLA layer."""

    metadata: tuple[str, ...]
    caches: tuple[CacheInput, ...]
    tokens: tuple[str, ...] = TOKEN_INPUTS

    def names(self) -> tuple[str, ...]:
        return (*self.tokens, *self.metadata, *(c.name for c in self.caches))

    def with_metadata(self, field: str) -> "GraphSignature":
        """This signature plus one more metadata input (no-op when present)."""
        if field in self.metadata:
            return self
        return GraphSignature((*self.metadata, field), self.caches, self.tokens)

    def caches_by_backend(self) -> dict[str, tuple[CacheInput, ...]]:
        """Backend name -> the cache inputs of every layer it serves, in layer order."""
        out: dict[str, list[CacheInput]] = {}
        for c in self.caches:
            out.setdefault(c.backend, []).append(c)
        return {k: tuple(v) for k, v in out.items()}


@dataclass(frozen=True)
class LogitsRows:
    """gather_logits applied: the graph returns `[1, rows, V]`, row b being the logits of the token
    at `metadata[field][b]` (each sequence's last token, or every token of a `logits_for="all"` step)."""

    field: str
    rows: int


@dataclass(frozen=True)
class RunnerOptions:
    """How the piecewise runner runs static pieces (compile, CUDA graphs per token bucket)."""

    compile: str = "none"  # none | inductor | aot_eager
    cuda_graphs: bool = True
    buckets: tuple[int, ...] = ()
    decode_graph: bool = True
    #: whole-graph CUDA graphs of any step up to this many tokens (0: off); see PiecewiseRunner
    mixed_graph_max_tokens: int = 0
    #: compile groups dynamic in the token count from their first compile (False: Dynamo's automatic
    #: dynamic shapes, which specialise the first count and recompile at the second)
    dynamic_tokens: bool = True


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (the graph holds its all-reduces)."""

    world_size: int
    rank: int
    group: str  # process-group name, as functional collectives take it
    all_reduces: int = 0
    #: how the graph's all-reduces run: "nccl" (functional collectives) or "one_shot"
    #: (autodeploy::tp_all_reduce: symmetric memory up to one_shot_max_bytes, the collective above)
    all_reduce: Literal["nccl", "one_shot"] = "nccl"
    one_shot_max_bytes: int = 0
    #: "tensor": every rank holds the same tokens (heads split), so every rank samples rank 0's rows;
    #: "data": each rank runs its own sequences (shard attention: data) — it samples its own rows and
    #: steps in lock-step with the others (runtime/data_parallel.py)
    attention: Literal["tensor", "data"] = "tensor"

    @property
    def data_parallel(self) -> bool:
        return self.world_size > 1 and self.attention == "data"


@dataclass(frozen=True)
class CompiledModel:
    """Everything the runtime needs to run a compiled graph."""

    gm: torch.fx.GraphModule
    signature: GraphSignature
    vocab_size: int
    logits: Optional[LogitsRows] = None
    split: Optional[SplitGraph] = None
    runner: Optional[RunnerOptions] = None
    tp: Optional[TensorParallel] = None
    eos_token_ids: tuple[int, ...] = ()
