"""What passes share: the model, the graph being rewritten, the target, and the typed products of
passes (`BuildArtifacts`), which become the runtime's `CompiledModel`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..custom_ops.attention.registry import BackendDecision, Target
from ..models.checkpoint import ShardSpec
from ..runtime.artifacts import CompiledModel, GraphSignature, LogitsRows, RunnerOptions, TensorParallel
from ..runtime.piecewise import SplitGraph

if TYPE_CHECKING:
    from ..config.schema import AppConfig


@dataclass
class PassRecord:
    name: str
    enabled: bool
    seconds: float
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildArtifacts:
    """Typed products of the passes: each field is written by one pass and read by later passes,
    the runtime or the report — never a dict of strings."""

    vocab_size: Optional[int] = None  # export: the logits' last dim
    eos_token_ids: tuple[int, ...] = ()  # export: the model's end-of-sequence token(s)
    shard_specs: dict[str, ShardSpec] = field(default_factory=dict)  # shard: this rank's part of each weight
    tp: Optional[TensorParallel] = None  # shard
    decisions: list[BackendDecision] = field(default_factory=list)  # insert_cached_mla_attention
    signature: Optional[GraphSignature] = None  # insert_cached_mla_attention (+ gather_logits)
    logits: Optional[LogitsRows] = None  # gather_logits
    split: Optional[SplitGraph] = None  # piecewise
    runner: Optional[RunnerOptions] = None  # piecewise

    def compiled(self, gm: torch.fx.GraphModule) -> CompiledModel:
        """The runtime's view; an error naming the missing product when the pipeline was incomplete."""
        if self.signature is None:
            raise ValueError("the pipeline produced no cached graph: enable `insert_cached_mla_attention`")
        if self.vocab_size is None:
            raise ValueError("the pipeline did not record the vocabulary size: enable `export`")
        return CompiledModel(gm, self.signature, self.vocab_size, self.logits, self.split, self.runner, self.tp,
                             self.eos_token_ids)


@dataclass
class BuildContext:
    config: "AppConfig"
    model: Optional[nn.Module]
    device: torch.device
    dtype: torch.dtype
    target: Target
    #: the tensor-parallel group this build is for (resolved once by optimize()); None: one process
    world: Optional[TensorParallel] = None
    gm: Optional[torch.fx.GraphModule] = None
    artifacts: BuildArtifacts = field(default_factory=BuildArtifacts)
    history: list[PassRecord] = field(default_factory=list)
