"""Rewrite Hugging Face MLA attention blocks of an exported graph into `torch_mla` (DESIGN §4, §5).

HF MLA attention (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral-Small-4, MiniCPM3, ...) materialises the
per-head key and value from the latent: `kv_b_proj(latent)` → split [Dn | Dv]; the key is
`[k_nope | broadcast(k_rope)]` and the query `[q_nope | q_rope]`; then SDPA (or the eager
matmul-softmax-matmul) with the softmax scale baked in as a float and a causal mask.
Every later pass (cache insertion, backend resolution) needs the *latent* form instead, so this
pass anchors on each attention node, walks the data flow back to those five tensors and replaces
the block with one `torch.ops.autodeploy.torch_mla(q_nope, q_pe, compressed_kv, kpe,
kv_b_proj_weight, True, scale)` call.

By job: `find` (attention nodes, MLA or not), `plan` (one block proven equivalent before any
mutation), `causal_mask` (the dropped mask proven causal), `rewrite` (the graph change), `model`
(the records and plans they share); this module runs them and registers the pass.

Soundness rules:
- Everything is checked for every block before the graph is touched: a refusal never leaves a
  half-rewritten graph.
- The rewritten op is causal over the sequence, so the mask being dropped must be proven to be the
  plain causal mask: it may depend on the values of `position_ids` only (padding masks and other
  data-dependent masks are refused), and evaluating its subgraph on probe positions must give
  exactly the lower-triangular mask. SDPA with `is_causal=True` and no mask needs no probe.
- An attention whose key and value come from one projection that the query does not use (the MLA
  signature) but that fails any check raises MLAMatchError naming the layer and the reason.
  Attention without that signature (plain MHA/GQA) is left alone and listed in
  `gm.meta["match_mla_skipped"]`; pass `strict=True` to refuse such graphs instead.
"""

from __future__ import annotations

import logging

from pydantic import Field
from torch.fx import GraphModule, Node

from ..fp8_graph import fold_dequantize
from ..context import BuildContext
from ..fx_utils import TORCH_MLA, module_path
from ..sparse_export import sparse_mla_nodes, sparse_node_dims
from ..registry import PassOptions, PassResult, Stage, register_pass
from .find import _find_attention, _looks_like_mla
from .model import MLAMatch, MLAMatchError, _Plan, _Refuse
from .plan import _plan
from .rewrite import _erase_dead, _native_record, _rewrite

__all__ = ["MLAMatch", "MLAMatchError", "match_mla"]

logger = logging.getLogger(__name__)


def match_mla(gm: GraphModule, *, strict: bool = False) -> list[MLAMatch]:
    """Rewrite every HF MLA attention block of `gm` into one torch_mla node, in place.

    Returns one record per torch_mla node of the result (rewritten ones and ones the model already
    called natively, kind "native"), in graph order. Raises MLAMatchError, before changing the
    graph, if an MLA-looking block cannot be proven equivalent; with `strict=True` also if the
    graph has attention that is not MLA at all (otherwise that attention is left alone, logged and
    listed in `gm.meta["match_mla_skipped"]` as (layer, reason)).
    """
    graph = gm.graph
    records: dict[Node, MLAMatch] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is TORCH_MLA:
            records[node] = _native_record(node)
    plans: list[_Plan] = []
    skipped: list[tuple[str, str]] = []
    mask_cache: dict[Node, list[str]] = {}
    for att in _find_attention(gm):
        try:
            plans.append(_plan(gm, att, mask_cache))
        except _Refuse as why:
            if _looks_like_mla(att):
                raise MLAMatchError(
                    f"{att.layer}: attention looks like MLA ({att.kind}, {att.source}) but cannot be "
                    f"rewritten into torch_mla: {why}"
                ) from None
            if strict:
                raise MLAMatchError(f"{att.layer}: attention is not MLA ({att.source}): {why}") from None
            logger.warning("match_mla: left %s alone (not MLA): %s", att.layer, why)
            skipped.append((att.layer, str(why)))

    for plan in plans:
        node = _rewrite(gm, plan)
        att = plan.att
        records[node] = MLAMatch(att.layer, node.name, plan.dims, plan.scale, att.kind, att.source, plan.notes)
    _erase_dead(graph, [p.att.anchor for p in plans])
    graph.lint()
    gm.recompile()
    fold_dequantize(gm)  # FP8 kv_b_proj: its 16-bit copy, now if loaded (else load_weights does it)
    gm.meta["match_mla_skipped"] = skipped

    ordered = [records[n] for n in graph.nodes if n in records]
    for node, rec in records.items():
        node.meta["mla_dims"] = rec.dims
        node.meta["mla_layer"] = rec.layer
    return ordered


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


class MatchMLAOptions(PassOptions):
    require_match: bool = Field(True, description="error if the graph has no MLA attention at all")


@register_pass("match_mla", MatchMLAOptions, stage=Stage.PATTERN, requires=("export",), refresh_shapes="missing")
def match_mla_pass(ctx: BuildContext, opts: MatchMLAOptions) -> PassResult:
    assert ctx.gm is not None
    matches = match_mla(ctx.gm)
    sparse = []
    for n in sparse_mla_nodes(ctx.gm):  # exported as DSA source ops already: record them like torch_mla nodes
        n.meta["mla_layer"] = module_path(n)
        n.meta["mla_dims"] = sparse_node_dims(n)
        sparse.append(n.meta["mla_layer"])
    if opts.require_match and not matches and not sparse:
        raise ValueError(
            "match_mla: no MLA attention found in the graph. Supported: DeepseekV2/V3, Kimi-K2, "
            "Moonlight, Glm4MoeLite, MiniCPM3, Mistral4 attention, or models calling torch_mla."
        )
    kinds = sorted({m.kind for m in matches})
    return PassResult(
        f"{len(matches)} attention blocks -> torch_mla ({', '.join(kinds)})"
        + (f"; {len(sparse)} sparse MLA blocks (exported as torch_mla_sparse)" if sparse else ""),
        {"layers": [{"layer": m.layer, "kind": m.kind, "scale": m.scale, "dims": vars(m.dims)} for m in matches],
         "sparse_layers": sparse,
         "skipped": [{"layer": layer, "reason": why} for layer, why in ctx.gm.meta.get("match_mla_skipped", [])]},
    )
