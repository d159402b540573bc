"""The built-in passes. Importing this module registers them (see registry.py).

`export` and `match_mla` wrap their modules' functions; the other passes live in their own modules.
"""

from __future__ import annotations

import torch
from pydantic import Field

from . import gather_logits  # noqa: F401  (registers gather_logits)
from . import insert_cached_attention  # noqa: F401  (registers insert_cached_mla_attention)
from . import piecewise  # noqa: F401  (registers piecewise)
from . import shard  # noqa: F401  (registers shard)
from .context import BuildContext
from .export import export_model
from .match_mla import match_mla as _match_mla
from .registry import PassOptions, PassResult, register_pass


class ExportOptions(PassOptions):
    example_batch: int = Field(2, ge=2)
    example_seq: int = Field(8, ge=2)


@register_pass("export", ExportOptions)
def export(ctx: BuildContext, opts: ExportOptions) -> PassResult:
    if ctx.model is None:
        raise ValueError("export: no model to export")
    exported = export_model(ctx.model, example_batch=opts.example_batch, example_seq=opts.example_seq)
    # A plain GraphModule: the exported module's pytree codegen and input-check hooks would reject
    # the metadata and cache inputs that cache insertion adds.
    exported.graph._codegen = torch.fx.graph.CodeGen()
    ctx.gm = torch.fx.GraphModule(exported, exported.graph)
    n = sum(1 for _ in ctx.gm.graph.nodes)
    return PassResult(f"{type(ctx.model).__name__} -> {n} nodes", {"nodes": n})


class MatchMLAOptions(PassOptions):
    require_match: bool = Field(True, description="error if the graph has no MLA attention at all")


@register_pass("match_mla", MatchMLAOptions)
def match_mla(ctx: BuildContext, opts: MatchMLAOptions) -> PassResult:
    assert ctx.gm is not None
    matches = _match_mla(ctx.gm)
    if opts.require_match and not matches:
        raise ValueError(
            "match_mla: no MLA attention found in the graph. Supported: DeepseekV2/V3, Kimi-K2, "
            "Moonlight, Glm4MoeLite, MiniCPM3, Mistral4 attention, or models calling torch_mla."
        )
    kinds = sorted({m.kind for m in matches})
    ctx.state["mla_matches"] = matches
    return PassResult(
        f"{len(matches)} attention blocks -> torch_mla ({', '.join(kinds)})",
        {"layers": [{"layer": m.layer, "kind": m.kind, "scale": m.scale, "dims": vars(m.dims)} for m in matches]},
    )
