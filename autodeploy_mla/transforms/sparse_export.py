"""Export DeepSeek Sparse Attention blocks as the DSA source ops, after proving how each block works.

Exporting the HF code as written fails (`topk(min(index_topk, T))` leaves torch.export an unprovable
`Min(K, s) <= s`), and if it did not, the attention would be a dense SDPA behind a data-dependent
mask that no MLA matcher may rewrite. So while the model is exported, each sparse attention module
runs `sparse_forward` instead: the module's own projections and norms, the RoPE and index details in
its `LayerFacts`, the indexer's score + top-k as `torch_dsa_indexer` and the attention as
`torch_mla_sparse` (custom_ops/attention/sparse_mla.py).

The facts are proven, not looked up (transforms/sparse_facts.py has the candidates). Once per kind of
layer (its class, and whether it runs an indexer) the module's own forward runs on a random sequence
longer than index_topk, so the selection matters:
- a layer with an indexer: the indexer's output is recorded (a forward hook: that the attention calls
  its indexer is part of the proof), and the first (RoPE layout x index-key norm x score weighting)
  under which that selection is a top-k of the candidate's scores, on every query that sees more
  than index_topk keys, gives the indexer facts;
- a layer without one: a valid earlier selection is passed through each optional forward parameter
  in turn; the first the module accepts is where the selection arrives;
- then the first attention RoPE layout for which `sparse_forward` reproduces the module's output
  within tolerance completes the facts, with where (if anywhere) the layer returns its selection.
What won, what it beat and the measured agreement go into the build report; when nothing matches, the
model is refused naming every candidate tried. No class or family name is consulted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..custom_ops.attention import sparse_mla
from ..custom_ops.attention.mla_dims import MLADims, infer_dims
from ..custom_ops.attention.sparse_mla import SPARSE_OP
from ..models.skeleton import is_placeholder, is_skeleton
from ..models.sparse_attention import SparseAttentionInfo, indexer_topk
from .fx_utils import module_path
from .sparse_facts import (ATTENTION_ROPE_CANDIDATES, SCORE_WEIGHTINGS, IndexerFacts, LayerFacts,
                           indexer_rope_candidates, key_norm_candidates)

#: relative max error allowed between the HF forward and `sparse_forward` (fp32: same math, other
#: summation order in the attention; bf16/fp16: one rounding more or less per product)
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
LOW_PRECISION_TOLERANCE = 3e-2
#: how far (relative to a query's largest |score|) a key HF selected may score below one it left out
#: under a candidate and still count as a tie broken by rounding
SELECTION_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
LOW_PRECISION_SELECTION_TOLERANCE = 1e-2
#: the proof's sequence is index_topk + this long: that many queries see more keys than they may select,
#: and only those tell candidates apart (a wrong candidate has to pick the same keys on all of them)
PROOF_EXTRA_TOKENS = 16


class SparseExportError(RuntimeError):
    """A sparse attention block cannot be exported as the DSA source ops (the message names it)."""


def _index_dims(indexer: nn.Module) -> tuple[int, int]:
    """(heads, head dim) from the index projections: the key projection's width is the head dim, the
    query projection's is heads x head dim."""
    d = int(indexer.wk.out_features)
    return int(indexer.wq_b.out_features) // d, d


def index_inputs(indexer: nn.Module, facts: IndexerFacts, x: torch.Tensor, q_resid: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,S,H,D], k [B,S,D] and w [B,S,H] of `torch_dsa_indexer`, made as `facts` say. Shared by the
    export and the proof, so what was proven is what is exported."""
    b, s = x.shape[:2]
    h, d = _index_dims(indexer)
    c, sn = cos.unsqueeze(2), sin.unsqueeze(2)
    q = facts.rope.apply(indexer.wq_b(q_resid).view(b, s, h, d), c, sn)
    k = facts.rope.apply(facts.key_norm.apply(indexer, indexer.wk(x)).unsqueeze(2), c, sn).squeeze(2)
    return q, k, facts.weighting.weights(indexer, x, h)


def sparse_forward(self: nn.Module, facts: LayerFacts, hidden_states: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Optional[torch.Tensor] = None,
                   *args: Any, **kwargs: Any) -> Any:
    """The module's sparse attention (uncached, causal) with the indexer's selection and the attention
    as DSA source ops, as `facts` describe it; returns what the module's forward returns (the
    output, and the selection where the module passes it on). Further positional arguments are named
    by the module's own signature, so an earlier selection is found however the caller passes it."""
    if args:
        names = [n for n in inspect.signature(type(self).forward).parameters if n != "self"][3:]
        kwargs = {**dict(zip(names, args)), **kwargs}
    b, s = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(b, s, -1, self.qk_nope_head_dim + self.qk_rope_head_dim)
    q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    ckv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_pe = torch.split(ckv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_pass = self.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    c, sn = cos.unsqueeze(2), sin.unsqueeze(2)
    q_pe = facts.attention_rope.apply(q_pe, c, sn)
    k_pe = facts.attention_rope.apply(k_pe.view(b, s, 1, self.qk_rope_head_dim), c, sn)

    if facts.indexer is not None:
        idx = getattr(self, facts.indexer_attr)
        qi, ki, w = index_inputs(idx, facts.indexer, hidden_states, q_resid, cos, sin)
        topk = torch.ops.autodeploy.torch_dsa_indexer(qi, ki, w, int(indexer_topk(idx)), float(qi.shape[-1] ** -0.5))
    else:
        prev = kwargs.get(facts.selection_param) if facts.selection_param else None
        if prev is None:
            raise SparseExportError(f"{type(self).__name__} layer {getattr(self, 'layer_idx', '?')}: a layer without "
                                    f"an indexer needs an earlier layer's top-k indices (as `{facts.selection_param}`); "
                                    "none were passed")
        topk = prev.to(torch.int32)
    out = torch.ops.autodeploy.torch_mla_sparse(q_nope, q_pe, kv_pass, k_pe, self.kv_b_proj.weight, topk, True,
                                                float(self.scaling), "bsnd")
    out = self.o_proj(out.reshape(b, s, -1))
    if facts.outputs == 0:
        return out
    res: list[Any] = [None] * facts.outputs
    res[0] = out
    if facts.selection_output is not None:
        res[facts.selection_output] = topk
    return tuple(res)


def sparse_attention_modules(model: nn.Module, info: SparseAttentionInfo) -> list[tuple[str, nn.Module]]:
    """Every sparse attention module (with or without its own indexer), in model order."""
    return [(p, model.get_submodule(p)) for p in info.attention_paths]


@contextlib.contextmanager
def sparse_forwards(plan: list[tuple[str, nn.Module, LayerFacts]]) -> Iterator[None]:
    """Run `sparse_forward` with each module's facts in place of its forward inside the block."""
    saved = []
    try:
        for _, m, facts in plan:
            saved.append((m, m.__dict__.get("forward")))
            m.forward = functools.partial(sparse_forward, m, facts)
        yield
    finally:
        for m, prev in saved:
            if prev is None:
                del m.forward
            else:
                m.forward = prev


def _causal_mask(t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    m = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return m.view(1, 1, t, t)


def _rotary(model: nn.Module) -> nn.Module:
    """The model's rotary embedding (a module with `inv_freq`, called as (x, position_ids) -> (cos, sin))."""
    base = getattr(model, "model", model)
    found = getattr(base, "rotary_emb", None)
    if found is None:
        found = next((m for m in model.modules() if "inv_freq" in getattr(m, "_buffers", {})), None)
    if found is None:
        raise SparseExportError(f"{type(model).__name__}: no rotary embedding module (one with an inv_freq buffer) "
                                "to make the cos/sin the sparse attention layers take")
    return found


def _weights_missing(model: nn.Module, module: nn.Module) -> bool:
    return is_skeleton(model) or any(p.device.type == "meta" or is_placeholder(p) for p in module.parameters())


def _random_copy(module: nn.Module, seed: int) -> nn.Module:
    """The module with random weights in place of its placeholders: the facts are properties of its
    code, not of the weights, so a weightless (skeleton) model is proven on a random copy. The memo
    keeps deepcopy from materialising the placeholders first."""
    memo = {id(p): None for p in module.parameters()}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
    work = copy.deepcopy(module, memo)
    g = torch.Generator().manual_seed(seed)
    device = next((b.device for b in module.buffers() if b.device.type != "meta"), None)
    for mod, orig in zip(work.modules(), module.modules()):
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            src = orig._parameters[name]
            dev = device or (src.device if src.device.type != "meta" else torch.device("cpu"))
            val = (torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 if p.dim() > 1
                   else 1 + 0.1 * torch.randn(p.shape, generator=g))
            mod._parameters[name] = nn.Parameter(val.to(dev, p.dtype), requires_grad=False)
    return work


def _call(module: nn.Module, x: torch.Tensor, cos_sin: tuple, mask: torch.Tensor, pos: torch.Tensor,
          **extra: Any) -> Any:
    """The module's own forward, called by keyword as decoder layers call it."""
    return module(hidden_states=x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos, **extra)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _same(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and (a is b or (a.shape == b.shape and torch.equal(a.long(), b.long())))


def _selection_disagreement(scores: torch.Tensor, chosen: torch.Tensor, first_row: int, topk: int,
                            tol: float) -> tuple[int, float]:
    """(rows where `chosen` is not a top-k of `scores`, smallest margin). scores [R, T] fp32 for query
    rows first_row.. (row j sees keys 0..first_row + j); chosen [R, W] the module's picks. Margin: the
    lowest chosen score minus the highest unchosen visible one, over the row's largest |score|; a
    margin above -tol is a top-k up to rounding."""
    bad, worst = 0, float("inf")
    for j in range(scores.shape[0]):
        seen = first_row + j + 1
        row, picks = scores[j, :seen], chosen[j].long()
        mask = torch.zeros(seen, dtype=torch.bool, device=row.device)
        if picks.numel() != topk or bool((picks < 0).any() or (picks >= seen).any()):
            bad += 1
            worst = min(worst, float("-inf"))
            continue
        mask[picks] = True
        if int(mask.sum()) != topk:  # a key picked twice
            bad += 1
            worst = float("-inf")
            continue
        margin = float((row[mask].min() - row[~mask].max()) / row.abs().max().clamp_min(1e-30))
        worst = min(worst, margin)
        bad += margin < -tol
    return bad, worst


def _prove_indexer(name: str, module: nn.Module, indexer: nn.Module, selected: torch.Tensor, x: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, tol: float) -> tuple[IndexerFacts, dict[str, Any], list[str]]:
    """The first candidate under which the module's own selection (`selected`, [1, T, W]) is a top-k of
    the candidate's scores on every query that sees more than index_topk keys."""
    topk = int(indexer_topk(indexer))
    t = x.shape[1]
    try:
        h, d = _index_dims(indexer)
        q_resid = module.q_a_layernorm(module.q_a_proj(x))
    except (AttributeError, RuntimeError) as exc:
        raise SparseExportError(f"{name} ({type(module).__name__}): not the DSA structure sparse export reads (index "
                                "projections wq_b / wk on the indexer, q_a_proj / q_a_layernorm on the attention): "
                                f"{type(exc).__name__}: {exc}") from exc
    ropes = indexer_rope_candidates(d, cos.shape[-1])
    norms = key_norm_candidates(indexer, d)
    weightings = tuple(w for w in SCORE_WEIGHTINGS if w.fits(indexer))
    rows = slice(topk, t)  # query i sees i + 1 keys
    chosen = selected[0, rows]
    rejected: list[str] = []
    misses: list[tuple[int, str]] = []  # (queries it got wrong, candidate): the closest are named on refusal
    for rope, norm, weighting in itertools.product(ropes, norms, weightings):
        cand = IndexerFacts(rope, norm, weighting)
        label = " / ".join(cand.describe(d, cos.shape[-1]).values())
        try:
            q, k, w = index_inputs(indexer, cand, x, q_resid, cos, sin)
            scores = sparse_mla.index_scores(q[:, rows], k, w[:, rows], 1.0)[0]
        except Exception as exc:  # noqa: BLE001 - a candidate that does not fit this module: next one
            rejected.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        bad, margin = _selection_disagreement(scores, chosen, topk, topk, tol)
        if bad == 0:
            n = t - topk
            evidence = (f"the module's top-{topk} is this candidate's top-{topk} on all {n} queries that see more than "
                        f"{topk} keys (smallest margin {margin:.2e} of a query's largest |score|, tolerance {tol:.0e})")
            return cand, {"selection": evidence}, rejected
        rejected.append(f"{label}: not the top-{topk} on {bad}/{t - topk} queries")
        misses.append((bad, rejected[-1]))
    tried = (f"indexer RoPE {[r.name for r in ropes]} (r = {cos.shape[-1]}, the RoPE width) x index-key norm "
             f"{[n.name for n in norms]} x score weighting {[w.name for w in weightings]}")
    closest = [why for _, why in sorted(misses, key=lambda m: m[0])[:3]]
    failed = [why for why in rejected if not why.endswith("queries")]
    raise SparseExportError(
        f"{name} ({type(module).__name__}): no candidate reproduces its indexer's selection on a random {t}-token "
        f"sequence (index_topk {topk}); tried {len(rejected)}: {tried}; closest: {'; '.join(closest) or 'none ran'}"
        f"{'; failed to run: ' + '; '.join(failed[:2]) if failed else ''}. Sparse export expresses index scores "
        "sum_h w_h * relu(q_h . k) with these variants only: a model whose indexer differs needs a new candidate in "
        "transforms/sparse_facts.py (and in the cached indexer ops if the score formula changes)")


def _selection_params(module: nn.Module) -> list[str]:
    """Optional forward parameters (default None) not already passed by the check: where an earlier
    layer's selection may arrive."""
    taken = {"self", "hidden_states", "position_embeddings", "attention_mask", "position_ids"}
    sig = inspect.signature(type(module).forward)
    return [p.name for p in sig.parameters.values()
            if p.name not in taken and p.default is None
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _prove_attention(name: str, module: nn.Module, base: dict[str, Any], ref: Any, run: Callable[[LayerFacts], Any],
                     tol: float, dtype: torch.dtype) -> tuple[LayerFacts, float, list[str]]:
    """The first attention RoPE layout under which `sparse_forward` (with the facts proven so far,
    `base`) gives the module's output within tol."""
    ref_out = _first(ref).float()
    tried = []
    for rope in ATTENTION_ROPE_CANDIDATES:
        facts = LayerFacts(attention_rope=rope, **base)
        try:
            ours = _first(run(facts)).float()
        except SparseExportError:
            raise
        except Exception as exc:  # noqa: BLE001 - an HF module this exporter does not fit: say which
            tried.append(f"{rope.name}: {type(exc).__name__}: {exc}")
            continue
        if ours.shape != ref_out.shape:
            tried.append(f"{rope.name}: output {tuple(ours.shape)}, the module's {tuple(ref_out.shape)}")
            continue
        err = float((ours - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-30))
        if err <= tol:
            return facts, err, tried
        tried.append(f"{rope.name}: differs by {err:.2e} of max |output|")
    raise SparseExportError(
        f"{name} ({type(module).__name__}): the DSA source-op forward does not reproduce the module's own forward "
        f"with any attention RoPE candidate (limit {tol:.0e} of max |output| in {dtype}): {'; '.join(tried)}. How "
        "it selects was proven; the attention around the selection is not the MLA that sparse export reads "
        "(q_a_proj -> q_a_layernorm -> q_b_proj, kv_a_proj_with_mqa -> kv_a_layernorm, kv_b_proj, o_proj; a gate "
        "or a fused projection is not captured), so it is refused")


def prove_layer(model: nn.Module, info: SparseAttentionInfo, name: str, module: nn.Module, *,
                seed: int = 0) -> tuple[LayerFacts, dict[str, Any]]:
    """The facts of one sparse attention module, proven against its own forward on one random sequence
    of index_topk + PROOF_EXTRA_TOKENS tokens (module doc), and the build-report record of what was proven and how."""
    weights = "the model's"
    work = module
    if _weights_missing(model, module):
        work, weights = _random_copy(module, seed), "random (the model's are not loaded before export)"
    p = next(work.parameters())
    indexer = getattr(work, info.indexer_attr, None)
    topk = info.index_topk if indexer is None else int(indexer_topk(indexer))
    t = topk + PROOF_EXTRA_TOKENS
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = getattr(model.config, "hidden_size", None) or work.kv_a_proj_with_mqa.in_features
    x = (torch.randn(1, t, hidden, generator=g) * 0.5).to(p.device, p.dtype)
    pos = torch.arange(t, device=p.device).unsqueeze(0)
    cos_sin = _rotary(model)(x, pos)
    mask = _causal_mask(t, p.dtype, p.device)
    tol = CHECK_TOLERANCE.get(p.dtype, LOW_PRECISION_TOLERANCE)
    record: dict[str, Any] = {"layer": name, "class": type(module).__name__, "checked": True, "tokens": t,
                              "weights": weights, "shared": indexer is None}
    evidence: dict[str, Any] = {}
    rejected: list[str] = []

    def run(facts: LayerFacts, **extra: Any) -> Any:
        return sparse_forward(work, facts, x, cos_sin, mask, position_ids=pos, **extra)

    with torch.no_grad():
        if indexer is not None:
            seen: list[Any] = []
            handle = indexer.register_forward_hook(lambda _m, _a, out: seen.append(out))
            try:
                ref = _call(work, x, cos_sin, mask, pos)
            except Exception as exc:  # noqa: BLE001 - the module's own forward failed on a plain causal call
                raise SparseExportError(f"{name} ({type(module).__name__}): its own forward failed on a {t}-token "
                                        f"causal call: {type(exc).__name__}: {exc}") from exc
            finally:
                handle.remove()
            selected = next((o for o in seen if isinstance(o, torch.Tensor) and not o.is_floating_point()), None)
            if selected is None:
                raise SparseExportError(
                    f"{name} ({type(module).__name__}): its forward did not call {info.indexer_attr} for an integer "
                    "selection (expected the indexer to return top-k token indices [B, S, k]); this is not the DSA "
                    "structure sparse export captures")
            ifacts, evidence, rejected = _prove_indexer(name, work, indexer, selected, x, *cos_sin,
                                                        SELECTION_TOLERANCE.get(p.dtype, LOW_PRECISION_SELECTION_TOLERANCE))
            outputs = len(ref) if isinstance(ref, (tuple, list)) else 0
            passes = next((i for i in range(1, outputs) if _same(ref[i], selected)), None)
            base = dict(indexer_attr=info.indexer_attr, indexer=ifacts, selection_param=None, outputs=outputs,
                        selection_output=passes)
            facts, err, tried = _prove_attention(name, module, base, ref, run, tol, p.dtype)
            h, d = _index_dims(indexer)
            record["facts"] = {**ifacts.describe(d, cos_sin[0].shape[-1]), **facts.describe()}
        else:
            # a layer without an indexer: any valid causal selection, in HF's form (no -1: masked picks)
            scores = torch.rand(1, t, t, generator=g).to(p.device)
            prev = sparse_mla.select_topk(scores, sparse_mla.causal_visible(t, t, p.device), topk)
            prev = torch.where(prev < 0, torch.zeros_like(prev), prev)
            facts = None
            for param in _selection_params(work):
                try:
                    ref = _call(work, x, cos_sin, mask, pos, **{param: prev})
                except Exception as exc:  # noqa: BLE001 - the selection does not go there: next parameter
                    rejected.append(f"selection as `{param}`: {type(exc).__name__}: {exc}")
                    continue
                outputs = len(ref) if isinstance(ref, (tuple, list)) else 0
                passes = next((i for i in range(1, outputs) if _same(ref[i], prev)), None)
                base = dict(indexer_attr=info.indexer_attr, indexer=None, selection_param=param, outputs=outputs,
                            selection_output=passes)
                try:
                    facts, err, tried = _prove_attention(name, module, base, ref,
                                                         lambda f, _p=param: run(f, **{_p: prev}), tol, p.dtype)
                except SparseExportError as exc:
                    rejected.append(f"selection as `{param}`: {exc}")
                    continue
                break
            if facts is None:
                raise SparseExportError(
                    f"{name} ({type(module).__name__}) has no indexer of its own and no forward parameter that takes an "
                    f"earlier layer's selection reproduces it; tried {_selection_params(work)}: {'; '.join(rejected)}")
            evidence = {"selection": f"the module accepts an earlier selection as `{facts.selection_param}` and "
                                     "attends to exactly those keys"}
            record["facts"] = facts.describe()
    evidence["output"] = (f"max |diff| {err:.2e} of max |output| on a random {t}-token sequence (limit {tol:.0e} in "
                          f"{str(p.dtype).removeprefix('torch.')})")
    record.update(rel_err=err, evidence=evidence, rejected=rejected + tried)
    return facts, record


def prove_each_kind(model: nn.Module, info: SparseAttentionInfo, modules: list[tuple[str, nn.Module]]
                    ) -> tuple[list[tuple[str, nn.Module, LayerFacts]], list[dict[str, Any]]]:
    """`prove_layer` on the first module of each kind (its class, and whether it has an indexer of its
    own); the facts then hold for every module of that kind. Returns (module, facts) per module and the
    records, each naming the layers its facts apply to."""
    proven: dict[tuple[type, bool], tuple[LayerFacts, dict[str, Any]]] = {}
    plan = []
    for name, m in modules:
        kind = (type(m), getattr(m, info.indexer_attr, None) is None)
        if kind not in proven:
            proven[kind] = prove_layer(model, info, name, m)
            proven[kind][1]["applies_to"] = []
        facts, record = proven[kind]
        record["applies_to"].append(name)
        plan.append((name, m, facts))
    return plan, [record for _, record in proven.values()]


TORCH_MLA_SPARSE = sparse_mla.MLA_SPARSE.default


def sparse_mla_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == TORCH_MLA_SPARSE]



def sparse_node_dims(node: torch.fx.Node) -> MLADims:
    """MLA dims of a `torch_mla_sparse` node: as match_mla (or shard) recorded them, else from its input
    shapes (bsnd, as sparse export emits it)."""
    if "mla_dims" in node.meta:
        return node.meta["mla_dims"]
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:5]]
    if any(v is None for v in vals):
        raise ValueError(f"{module_path(node)}: cannot read the sparse MLA dims (no shape metadata on its inputs)")
    return infer_dims(SPARSE_OP, *vals, "bsnd")[0]
