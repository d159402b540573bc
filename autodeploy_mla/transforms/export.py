"""Export a Hugging Face causal LM (or any model calling torch_mla) to an FX GraphModule.

The graph takes `(input_ids, position_ids)` and returns the logits only. No attention_mask is an
input: after cache insertion the graph runs on a packed token batch `[1, T]` whose attention
structure comes from the batch metadata, never from a mask tensor (DESIGN §3, §5).
"""

from __future__ import annotations

import contextlib

import torch
from pydantic import Field
from torch import nn
from torch.export import Dim

from ..models.factory import eos_token_ids
from ..models.sparse_attention import find_sparse_attention
from .context import BuildContext
from .sparse_export import SparseExportError, prove_each_kind, sparse_attention_modules, sparse_forwards
from .registry import PassOptions, PassResult, Stage, register_pass

__all__ = ["ExportError", "SparseAttentionNotCaptured", "export_model"]


class ExportError(RuntimeError):
    """torch.export could not capture the model; the message says what failed and what to try."""


class SparseAttentionNotCaptured(ExportError):
    """The model uses DeepSeek Sparse Attention in a form the compiler cannot capture (or run) yet."""


class _LogitsOnly(nn.Module):
    """Calls the causal LM the way the compiled graph will be called and returns just the logits.

    `use_cache=False` keeps DynamicCache out of the outputs (it does not export); a plain tensor
    output keeps the graph's signature independent of the HF ModelOutput class.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        if isinstance(out, torch.Tensor):
            return out
        logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", None)
        if logits is None:
            logits = out[0]
        return logits


def export_model(model: nn.Module, *, example_batch: int = 2, example_seq: int = 8) -> torch.fx.GraphModule:
    """torch.export `model(input_ids=, position_ids=, use_cache=False)` with dynamic batch and seq.

    Runs under no_grad (otherwise the rotary embedding is captured as a
    `wrap_with_set_grad_enabled` subgraph that hides its ops from the passes) and returns the
    unlifted GraphModule whose single output is the logits `[B, S, V]`. No decompositions are run,
    so SDPA and linear stay single nodes for the matcher. Example sizes must be >= 2 so that
    torch.export does not specialise batch or seq to 1.
    """
    if example_batch < 2 or example_seq < 2:
        raise ValueError(
            f"export_model: example_batch and example_seq must be >= 2 (got {example_batch}, "
            f"{example_seq}); torch.export specialises size-1 dims to constants."
        )
    sparse = find_sparse_attention(model)
    patch = contextlib.nullcontext()
    if sparse is not None:
        # HF's sparse attention does not export (an unprovable min(index_topk, T) top-k) and hides its
        # selection in a data-dependent mask: export it as the DSA source ops instead, with the facts
        # proven against each kind of layer's own forward (transforms/sparse_export.py).
        try:
            plan, sparse_checks = prove_each_kind(model, sparse, sparse_attention_modules(model, sparse))
        except SparseExportError as exc:
            raise SparseAttentionNotCaptured(f"{sparse.describe()}: {exc}") from exc
        patch = sparse_forwards(plan)
    wrapper = _LogitsOnly(model).eval()
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    input_ids = torch.randint(0, vocab, (example_batch, example_seq), device=_device_of(model))
    position_ids = (
        torch.arange(example_seq, device=input_ids.device).unsqueeze(0).expand(example_batch, -1).contiguous()
    )
    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    dynamic_shapes = {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}}
    try:
        with torch.no_grad(), patch:
            ep = torch.export.export(
                wrapper, (input_ids, position_ids), dynamic_shapes=dynamic_shapes
            )
    except Exception as exc:  # torch.export raises many unrelated types; re-raise with guidance
        raise ExportError(
            f"torch.export failed for {type(model).__name__} called as model(input_ids=[B,S], "
            f"position_ids=[B,S], use_cache=False) with dynamic batch and seq: "
            f"{type(exc).__name__}: {exc}\n"
            "What to try: make sure the model is in eval mode and uses attn_implementation='sdpa' "
            "or 'eager'; for MoE models use the default experts implementation (not "
            "experts_implementation='eager', whose data-dependent loop does not export); if a dim "
            "was specialised, use other example sizes (example_batch/example_seq >= 2, not equal "
            "to another fixed dim such as the vocab or hidden size)."
        ) from exc
    gm = ep.module()
    _strip_wrapper_from_module_paths(gm)
    if sparse is not None:
        gm.meta["sparse_attention"] = {"info": sparse, "checks": sparse_checks}
    return gm


def _strip_wrapper_from_module_paths(gm: torch.fx.GraphModule) -> None:
    """Make node.meta["nn_module_stack"] paths the user model's own module names.

    Export sees the model as the wrapper's attribute "model", so paths read "model.model.layers.3..."
    for an HF causal LM. Stripping that prefix makes every path valid for
    `model.get_submodule(path)` (the root itself becomes ""), which is what reports and per-layer
    config overrides name. Kept in node metadata because GraphModule.meta does not survive a rewrap.
    """
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {key: (_unwrapped(val[0]), *val[1:]) for key, val in stack.items()}


def _unwrapped(path: str) -> str:
    return "" if path == "model" else path.removeprefix("model.")


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


class ExportOptions(PassOptions):
    example_batch: int = Field(2, ge=2)
    example_seq: int = Field(8, ge=2)


def logits_vocab_size(gm: torch.fx.GraphModule) -> int | None:
    """V of the graph's [B, S, V] logits output, from export's fake values."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0]
    node = vals[0] if isinstance(vals, (tuple, list)) else vals
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if val is None or val.dim() < 1 or not isinstance(val.shape[-1], int):
        return None
    return int(val.shape[-1])


@register_pass("export", ExportOptions, stage=Stage.EXPORT)
def export(ctx: BuildContext, opts: ExportOptions) -> PassResult:
    if ctx.model is None:
        raise ValueError("export: no model to export")
    exported = export_model(ctx.model, example_batch=opts.example_batch, example_seq=opts.example_seq)
    # A plain GraphModule: the exported module's pytree codegen and input-check hooks would reject
    # the metadata and cache inputs that cache insertion adds.
    exported.graph._codegen = torch.fx.graph.CodeGen()
    ctx.gm = torch.fx.GraphModule(exported, exported.graph)
    vocab = logits_vocab_size(ctx.gm) or getattr(getattr(ctx.model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ExportError(f"{type(ctx.model).__name__}: cannot tell the vocabulary size (the output is not "
                          "[B, S, V] logits and the model has no config.vocab_size)")
    ctx.artifacts.vocab_size = int(vocab)
    ctx.artifacts.eos_token_ids = eos_token_ids(ctx.model)
    n = sum(1 for _ in ctx.gm.graph.nodes)
    details = {"nodes": n, "vocab_size": int(vocab), "eos_token_ids": list(ctx.artifacts.eos_token_ids)}
    summary = f"{type(ctx.model).__name__} -> {n} nodes"
    sparse = exported.meta.get("sparse_attention")
    if sparse is not None:  # DSA exported as its source ops; what was compared with HF before that
        details["sparse_attention"] = {"index_topk": sparse["info"].index_topk, "checks": sparse["checks"]}
        summary += f"; DeepSeek Sparse Attention as DSA source ops (index_topk {sparse['info'].index_topk})"
    return PassResult(summary, details)
