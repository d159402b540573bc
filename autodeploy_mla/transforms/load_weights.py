"""`load_weights`: fill a weightless (skeleton) graph from its checkpoint, reading only this rank's slices.

A model built as a skeleton (tensor parallelism over a checkpoint with `shard.load: slices`) reaches
this pass with placeholder weights; the shard pass has already replaced each sharded weight by a
placeholder of this rank's shape and recorded its `ShardSpec`. This pass reads exactly those slices
(and every replicated weight whole) from the safetensors checkpoint (models/checkpoint.py). For a
model with real weights it does nothing.
"""

from __future__ import annotations

from ..models.checkpoint import load_graph_weights
from ..models.skeleton import is_skeleton
from .context import BuildContext
from .registry import PassOptions, PassResult, Stage, register_pass


@register_pass("load_weights", stage=Stage.WEIGHTS, requires=("export",))
def load_weights(ctx: BuildContext, opts: PassOptions) -> PassResult:
    assert ctx.gm is not None
    if not is_skeleton(ctx.model):
        return PassResult("the model has its weights: nothing to load", {"source": "model"})
    info = load_graph_weights(ctx.gm, ctx.model, ctx.artifacts.shard_specs, ctx.device)
    gib = info["bytes_read"] / 2**30
    return PassResult(f"{info['tensors']} tensors, {gib:.2f} GiB read from {info['checkpoint']} "
                      f"({len(ctx.artifacts.shard_specs)} as this rank's slices)",
                      {"source": "checkpoint slices", **info})
