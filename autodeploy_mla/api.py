"""`optimize(model, config)`: the Python entry point (DESIGN §10).

model -> export -> match_mla -> insert_cached_mla_attention -> (piecewise) -> caches + metadata ->
an OptimizedModel that generates with continuous batching over the paged cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .config.loader import ConfigLayer, load_config
from .config.schema import AppConfig
from .custom_ops.backend_registry import MLABackend, get_backend
from .distributed.collectives import rank0_logits_step
from .distributed.loading import build_eager_model
from .models.factory import resolve_device, resolve_dtype, resolve_model_arg
from .runtime.engine import GenerationEngine, Request
from .runtime.kv_cache import CacheLayout, MLACacheManager, plan_num_pages
from .runtime.page_allocator import PageAllocator
from .runtime.sampling import SamplingParams
from .runtime.sequence_info import SequenceInfo, StepSequence
from .transforms.context import BuildContext, PassRecord
from .transforms.pass_manager import run_passes

ModelArg = Union[nn.Module, str, Path, None]


class OptimizedModel:
    """The compiled, cached model: generate(), the build report, and the graph."""

    def __init__(self, ctx: BuildContext, eager_model: Optional[nn.Module]) -> None:
        self.ctx = ctx
        self.config: AppConfig = ctx.config
        self.eager_model = eager_model
        self.gm: torch.fx.GraphModule = ctx.gm  # type: ignore[assignment]
        self.device, self.dtype = ctx.device, ctx.dtype
        rt = self.config.runtime
        self.seq_info = SequenceInfo(rt.max_batch_size, rt.max_num_tokens, rt.max_seq_len, rt.page_size, self.device)
        layouts = [CacheLayout(c["name"], c["layer"], c["spec"]) for c in ctx.state["cache_inputs"]]
        num_pages = plan_num_pages(layouts, rt.page_size, rt.max_batch_size, rt.max_seq_len, self.device,
                                   rt.num_pages, rt.free_memory_fraction)
        self.caches = MLACacheManager(layouts, num_pages, rt.page_size, self.device)
        self.allocator = PageAllocator(num_pages, rt.page_size, self.seq_info.max_pages_per_seq)
        self.metadata_inputs: list[str] = ctx.state["metadata_inputs"]
        self.cache_names = [lay.name for lay in layouts]
        self.backends: list[MLABackend] = []
        for name in sorted({c["backend"] for c in ctx.state["cache_inputs"]}):
            be = get_backend(name)
            dims = [c["dims"] for c in ctx.state["cache_inputs"] if c["backend"] == name]
            be.setup(dims, self.dtype, self.seq_info)
            self.backends.append(be)
        #: Replaced by the piecewise runner when that pass is enabled.
        self.runner: Callable[..., Any] = ctx.state.get("runner_factory", lambda gm, info: gm)(self.gm, self.seq_info)
        self.last_generation: dict[str, Any] = {}
        #: gather_logits applied: the graph returns [1, max_batch_size, V] rows, not [1, T, V].
        self.logits_gathered: bool = bool(ctx.state.get("logits_gathered"))

    # ------------------------------------------------------------------ one step
    def forward_step(self, info: SequenceInfo) -> torch.Tensor:
        """Run the graph on the step `info` describes; returns logits [1, T, V]."""
        for be in self.backends:
            be.prepare(info)
        ids, pos = info.graph_inputs()
        args = [ids, pos, *(info.get(m) for m in self.metadata_inputs), *(self.caches.caches[c] for c in self.cache_names)]
        with torch.inference_mode():
            out = self.runner(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

    def next_token_logits(self, info: SequenceInfo) -> torch.Tensor:
        """One step; the logits each sequence samples from, [num_seqs, V] in flat-batch order."""
        logits = self.forward_step(info)
        nb = len(info.seq_ids)
        if self.logits_gathered:  # the graph already returns one row per sequence
            return logits[0, :nb]
        return logits[0].index_select(0, info.dev["last_token"][:nb])

    # ------------------------------------------------------------------ generation
    def engine(self) -> GenerationEngine:
        step = self.next_token_logits
        if self.ctx.state.get("tensor_parallel"):  # every rank samples from rank 0's logits rows
            step = rank0_logits_step(step)
        return GenerationEngine(step, self.seq_info, self.allocator)

    def generate_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        on_tokens: Optional[Callable[[list[tuple[int, int]]], None]] = None,
    ) -> list[Request]:
        eng = self.engine()
        t0 = time.perf_counter()
        reqs = eng.run(prompts, params, on_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        new = sum(len(r.generated) for r in reqs)
        self.last_generation = {
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "generated_tokens": new,
            "steps": len(eng.steps),
            "seconds": dt,
            "tokens_per_s": new / dt if dt > 0 else float("nan"),
        }
        return reqs

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        on_tokens: Optional[Callable[[list[tuple[int, int]]], None]] = None,
        **sampling: Any,
    ) -> list[list[int]]:
        """Generated token ids per prompt (continuous batching). `sampling`: SamplingParams fields."""
        reqs = self.generate_requests(prompts, SamplingParams(max_new_tokens=max_new_tokens, **sampling), on_tokens)
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [r.generated for r in reqs]

    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits [S, V] of every prompt position, prefilled in chunks (then freed).

        Chunks are max_num_tokens long, or max_batch_size when gather_logits is on (the graph then
        returns at most that many rows, here one per token of the chunk).
        """
        rid = -1
        chunk = self.seq_info.max_num_tokens
        if self.logits_gathered:
            chunk = min(chunk, self.seq_info.max_batch_size)
        self.allocator.ensure(rid, len(prompt))
        outs = []
        try:
            for start in range(0, len(prompt), chunk):
                toks = list(prompt[start : start + chunk])
                self.seq_info.prepare_step([StepSequence(rid, toks, start)], self.allocator.pages_of,
                                           logits_for="all" if self.logits_gathered else "last")
                outs.append(self.forward_step(self.seq_info)[0, : len(toks)].float())
        finally:
            self.allocator.free(rid)
        return torch.cat(outs)

    # ------------------------------------------------------------------ report
    @property
    def history(self) -> list[PassRecord]:
        return self.ctx.history

    def report(self) -> dict[str, Any]:
        decisions = self.ctx.state.get("backend_decisions", [])
        caches = self.caches
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "passes": [
                {"name": r.name, "enabled": r.enabled, "seconds": round(r.seconds, 4), "summary": r.summary}
                for r in self.history
            ],
            "layers": [d.to_dict() for d in decisions],
            "cache": {
                "num_pages": caches.num_pages,
                "page_size": caches.page_size,
                "layers": len(caches.caches),
                "bytes_per_layer": {n: t.numel() * t.element_size() for n, t in caches.caches.items()},
                "total_bytes": caches.total_bytes,
            },
            "runtime": self.config.runtime.model_dump(),
            "pieces": self.ctx.state.get("piecewise_report"),
            "tensor_parallel": self.ctx.state.get("tensor_parallel"),
            "generation": self.last_generation,
        }


def optimize(
    model: ModelArg = None,
    config: ConfigLayer | AppConfig | Sequence[ConfigLayer] | None = None,
    overrides: Sequence[str] = (),
    on_pass: Optional[Callable[[PassRecord], None]] = None,
) -> OptimizedModel:
    """Compile `model` (nn.Module, family name, checkpoint dir, or None = the config's model).

    `config`: a YAML path, a dict, a list of them (layered in order over the packaged default), or
    an AppConfig. `overrides`: `a.b=c` strings applied last. The config objects are never mutated.
    """
    if isinstance(config, AppConfig):
        cfg = config
    else:
        layers: list[ConfigLayer] = []
        if isinstance(model, (str, Path)):
            layers.append(resolve_model_arg(str(model)))
        if config is not None:
            layers += list(config) if isinstance(config, (list, tuple)) else [config]
        cfg = load_config(*layers, overrides=overrides)

    if isinstance(model, nn.Module):
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else resolve_device(cfg.model.device)
        dtype = p.dtype if p is not None else resolve_dtype(cfg.model.dtype, device)
        eager = model.eval()
    else:
        device = resolve_device(cfg.model.device)
        dtype = resolve_dtype(cfg.model.dtype, device)
        eager = build_eager_model(cfg, device, dtype)  # weightless when `shard` reads checkpoint slices
    ctx = BuildContext(cfg, eager, device, dtype)
    run_passes(ctx, on_pass)
    return OptimizedModel(ctx, eager)
