"""`gather_logits`: apply the LM head only to the tokens whose logits are used.

The exported graph computes logits for every token of the step ([1, T, V]). Generation samples one
row per sequence, so for a prefill step of T tokens over a real vocabulary (DeepSeek: 129k) the
head does T/B times the needed work and materialises a [T, V] tensor (0.5-1 GB at T = 2048). This
pass gathers the hidden states at the `logits_index` metadata rows (fixed size max_batch_size, so
CUDA graphs keep static shapes) right before the final linear; the graph then returns
[1, max_batch_size, V], row b being sequence b's next-token logits (or token b's, when a step is
prepared with `logits_for="all"`).
"""

from __future__ import annotations

import torch

from ..runtime.artifacts import LogitsRows
from .context import BuildContext
from .fx_utils import aten, placeholders
from .registry import PassOptions, PassResult, Stage, register_pass

FIELD = "logits_index"
# Ops allowed between the LM head and the graph output (casts / copies that keep the token dim).
_PASSTHROUGH = {aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.clone.default}


def _find_lm_head(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node | None, str]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0]
    node = vals[0] if isinstance(vals, (tuple, list)) else vals
    if not (isinstance(vals, (tuple, list)) and len(vals) == 1):
        return None, "the graph has more than one output"
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _PASSTHROUGH:
        if len(node.users) != 1:
            return None, f"{node.name} feeds more than the output"
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == aten.linear.default):
        return None, "the output is not produced by a final linear (LM head)"
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if val is not None and val.dim() != 3:
        return None, f"the LM head input has {val.dim()} dims, expected [B, T, hidden]"
    return node, ""


@register_pass("gather_logits", stage=Stage.OUTPUT, requires=("insert_cached_mla_attention",))
def gather_logits(ctx: BuildContext, opts: PassOptions) -> PassResult:
    gm = ctx.gm
    assert gm is not None
    sig = ctx.artifacts.signature
    if sig is None:
        raise ValueError("gather_logits needs the cached graph's signature: insert_cached_mla_attention must run first")
    head, why = _find_lm_head(gm)
    if head is None:
        return PassResult(f"not applied: {why}; logits stay per token", {"applied": False, "reason": why})
    index = next((p for p in placeholders(gm) if p.target == FIELD), None)
    if index is None:  # a new graph input, declared in the signature (bound by name)
        with gm.graph.inserting_after(placeholders(gm)[-1]):
            index = gm.graph.placeholder(FIELD)
    hidden = head.args[0]
    with gm.graph.inserting_before(head):
        rows = gm.graph.call_function(aten.index_select.default, (hidden, 1, index))
    head.replace_input_with(hidden, rows)
    rows_n = ctx.config.runtime.max_batch_size
    ctx.artifacts.signature = sig.with_metadata(FIELD)
    ctx.artifacts.logits = LogitsRows(FIELD, rows_n)
    return PassResult(
        f"LM head on {rows_n} rows per step (one per sequence) instead of every token",
        {"applied": True, "rows": rows_n, "head": head.name},
    )
