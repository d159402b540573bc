"""Export DeepSeek Sparse Attention blocks as the DSA source ops, checked against Hugging Face first.

Exporting the HF code as written fails (`topk(min(index_topk, T))` leaves torch.export an unprovable
`Min(K, s) <= s`), and if it did not, the attention would be a dense SDPA behind a data-dependent
mask that no MLA matcher may rewrite. So while the model is exported, each sparse attention module
runs `sparse_forward` instead: the same projections, norms and RoPE as the HF module (its own
submodules and its modeling file's RoPE functions), with the indexer's score + top-k as
`torch_dsa_indexer` and the attention as `torch_mla_sparse` (custom_ops/attention/sparse_mla.py).

Before that forward is used, it is compared with the module's own forward on random inputs longer
than index_topk (so the selection matters), once per kind of layer (one that runs its indexer, one
that reuses the previous layer's selection); a mismatch refuses the model with both numbers.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..custom_ops.attention import sparse_mla
from ..custom_ops.attention.mla_dims import MLADims, infer_dims
from ..custom_ops.attention.sparse_mla import SPARSE_OP
from ..models.skeleton import is_placeholder, is_skeleton
from .fx_utils import module_path
from ..models.sparse_attention import SparseAttentionInfo

#: relative max error allowed between the HF forward and `sparse_forward` (fp32: same math, other
#: summation order in the attention; bf16/fp16: one rounding more or less per product)
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
LOW_PRECISION_TOLERANCE = 3e-2


@dataclass(frozen=True)
class SparseFamily:
    """How one HF family's sparse attention differs from the others."""

    #: name of the modeling-file function that applies the indexer's RoPE
    indexer_rope: str
    #: the attention returns (out, weights, topk_indices) and takes prev_topk_indices (GLM-5)
    passes_indices: bool


#: attention class name -> family facts (transformers 5.23: DeepSeek-V3.2 ropes the indexer half-split,
#: GLM-5 interleaved; docs/sparse_mla.md)
SPARSE_FAMILIES = {
    "DeepseekV32Attention": SparseFamily("apply_rotary_pos_emb", passes_indices=False),
    "GlmMoeDsaAttention": SparseFamily("apply_rotary_pos_emb_interleave", passes_indices=True),
}


class SparseExportError(RuntimeError):
    """A sparse attention block cannot be exported as the DSA source ops (the message names it)."""


def _modeling(module: nn.Module) -> types.ModuleType:
    return sys.modules[type(module).__module__]


def sparse_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                   attention_mask: Optional[torch.Tensor] = None, past_key_values: Any = None,
                   position_ids: Optional[torch.Tensor] = None, prev_topk_indices: Optional[torch.Tensor] = None,
                   **kwargs: Any) -> tuple:
    """The HF sparse attention forward (uncached, causal) with the indexer's selection and the
    attention as DSA source ops. Bound to an attention module of a SPARSE_FAMILIES class."""
    fam = SPARSE_FAMILIES[type(self).__name__]
    mod = _modeling(self)
    b, s = hidden_states.shape[:-1]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(b, s, -1, self.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    ckv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_pe = torch.split(ckv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_pass = self.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    q_pe, k_pe = mod.apply_rotary_pos_emb_interleave(q_pe, k_pe.view(b, 1, s, self.qk_rope_head_dim), cos, sin)

    idx = self.indexer
    if idx is not None:
        qi = idx.wq_b(q_resid).view(b, s, idx.n_heads, idx.head_dim)
        qi_rot, qi_pass = torch.split(qi, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
        ki = idx.k_norm(idx.wk(hidden_states)).unsqueeze(2)
        ki_rot, ki_pass = torch.split(ki, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
        rope = getattr(mod, fam.indexer_rope, None)
        if rope is None:
            raise SparseExportError(f"{type(self).__name__}: {mod.__name__} has no {fam.indexer_rope}() for the "
                                    "indexer's RoPE (another transformers version?)")
        qi_rot, ki_rot = rope(qi_rot, ki_rot, cos, sin, unsqueeze_dim=2)
        qi = torch.cat([qi_rot, qi_pass], dim=-1)
        ki = torch.cat([ki_rot, ki_pass], dim=-1).squeeze(2)
        w = idx.weights_proj(hidden_states.to(idx.weights_proj.weight.dtype)).float() * (idx.n_heads ** -0.5)
        topk = torch.ops.autodeploy.torch_dsa_indexer(qi, ki, w, int(idx.index_topk), float(idx.softmax_scale))
    elif prev_topk_indices is not None:
        topk = prev_topk_indices.to(torch.int32)
    else:
        raise SparseExportError(f"{type(self).__name__} layer {getattr(self, 'layer_idx', '?')}: a layer without "
                                "an indexer needs the previous full layer's top-k indices; none were passed")
    out = torch.ops.autodeploy.torch_mla_sparse(
        q_nope.transpose(1, 2), q_pe.transpose(1, 2), kv_pass, k_pe.transpose(1, 2), self.kv_b_proj.weight, topk,
        True, float(self.scaling), "bsnd")
    out = self.o_proj(out.reshape(b, s, -1))
    return (out, None, topk) if fam.passes_indices else (out, None)


def sparse_attention_modules(model: nn.Module, info: SparseAttentionInfo) -> list[tuple[str, nn.Module]]:
    """Every attention module of the model's sparse layers (full and shared), in layer order; raises
    SparseExportError naming a layer whose class this exporter does not know."""
    parents = {p.rsplit(".", 1)[0] for p in info.indexer_paths}
    out = []
    for name, m in model.named_modules():
        known = type(m).__name__ in SPARSE_FAMILIES
        if name in parents and not known:
            raise SparseExportError(
                f"{name} ({type(m).__name__}) has a DSA indexer, but sparse export knows only "
                f"{sorted(SPARSE_FAMILIES)}: its RoPE and index layout are unverified, so it is refused")
        if known and hasattr(m, "indexer"):
            out.append((name, m))
    return out


@contextlib.contextmanager
def sparse_forwards(modules: list[tuple[str, nn.Module]]) -> Iterator[None]:
    """Run `sparse_forward` in place of these modules' forwards inside the block."""
    saved = []
    try:
        for _, m in modules:
            saved.append((m, m.__dict__.get("forward")))
            m.forward = types.MethodType(sparse_forward, m)
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


def check_sparse_forward(model: nn.Module, name: str, module: nn.Module, *, seed: int = 0,
                         rotary: Optional[Callable] = None) -> dict[str, Any]:
    """Compare `sparse_forward` with the module's HF forward on one random sequence of
    index_topk + 8 tokens; returns what was compared, raises SparseExportError on a mismatch."""
    p = next(module.parameters())
    if p.device.type == "meta" or is_skeleton(model) or any(is_placeholder(w) for w in module.parameters()):
        # the weights arrive after export (load_weights): nothing meaningful to compare yet
        return {"layer": name, "checked": False, "why": "weights not materialised at export (skeleton)"}
    cfg = model.config
    topk = int(cfg.index_topk)
    t = topk + 8
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(1, t, cfg.hidden_size, generator=g) * 0.5).to(p.device, p.dtype)
    pos = torch.arange(t, device=p.device).unsqueeze(0)
    rotary = rotary or model.model.rotary_emb
    cos_sin = rotary(x, pos)
    mask = _causal_mask(t, p.dtype, p.device)
    prev = None
    if module.indexer is None:  # a shared layer: any valid causal selection
        scores = torch.rand(1, t, t, generator=g).to(p.device)
        prev = sparse_mla.select_topk(scores, sparse_mla.causal_visible(t, t, p.device), topk)
        prev = torch.where(prev < 0, torch.zeros_like(prev), prev)  # HF form: no -1 (masked picks instead)
    kwargs = {"prev_topk_indices": prev} if SPARSE_FAMILIES[type(module).__name__].passes_indices else {}
    try:
        with torch.no_grad():
            ref = module.forward(x, cos_sin, mask, None, pos, **kwargs)[0]
            ours = sparse_forward(module, x, cos_sin, mask, None, pos, **kwargs)[0]
    except SparseExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - an HF module this exporter does not fit: say which
        raise SparseExportError(f"{name} ({type(module).__name__}): comparing the DSA source-op forward with the "
                                f"Hugging Face forward failed: {type(exc).__name__}: {exc}") from exc
    err = float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    tol = CHECK_TOLERANCE.get(p.dtype, LOW_PRECISION_TOLERANCE)
    if not err <= tol:
        raise SparseExportError(
            f"{name} ({type(module).__name__}): the DSA source-op forward differs from the Hugging Face forward "
            f"on a random {t}-token sequence by {err:.2e} of max |output| (limit {tol:.0e} in {p.dtype}); refusing "
            "to export it (a transformers version whose sparse attention changed?)")
    return {"layer": name, "checked": True, "tokens": t, "rel_err": err, "shared": module.indexer is None}


def check_each_kind(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> list[dict[str, Any]]:
    """`check_sparse_forward` on the first layer of each kind (own indexer / shared)."""
    done: set[bool] = set()
    out = []
    for name, m in modules:
        kind = m.indexer is None
        if kind not in done:
            done.add(kind)
            out.append(check_sparse_forward(model, name, m))
    return out


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
