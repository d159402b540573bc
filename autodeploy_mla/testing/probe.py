"""What one rank saw: build a model with the shard pass on, generate, and return everything a test
or a benchmark wants to compare across ranks and against a single process.

`probe_rank` is the function the CPU/GPU tensor-parallel tests spawn (`spawn(probe_rank, 2, jobs)`).
Everything it returns is plain Python / CPU tensors, so it pickles back to the parent.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ..api import optimize
from ..cli import build, build_parser
from ..distributed.env import MULTICAST_OFF_ENV, env_info
from ..models.checkpoint import module_tensor
from ..models.skeleton import is_placeholder, is_skeleton
from ..transforms.shard import count_all_reduces


@dataclass
class ProbeJob:
    name: str
    model: Union[str, Callable[[], torch.nn.Module], None]  # family / checkpoint dir, or a module-level factory
    overrides: Sequence[str] = ()
    prompts: Sequence[Sequence[int]] = ()
    max_new_tokens: int = 4
    logits_prompt: Optional[Sequence[int]] = None
    #: Instead of the above: run `autodeploy <cli_argv>` in this rank (the CLI's in-rank path:
    #: process group already up, shard pass on, rank 0 prints/verifies/writes the report).
    cli_argv: Optional[Sequence[str]] = None
    #: Also generate with these sampling parameters (e.g. temperature, top_k; no seed: the global RNG,
    #: which the launcher seeds identically on every rank) -> result["sampled"].
    sampling: Optional[dict[str, Any]] = None
    #: Also return the values of the graph's weights (CPU copies; tiny models only) -> result["weight_values"]:
    #: what a test compares with the slices of the whole model. FP8 weights come back as their uint8 bit
    #: patterns (torch 2.13 cannot unpickle a float8 tensor: its storage has no dtype).
    weight_values: bool = False


def rank_overrides() -> list[str]:
    """Overrides every rank needs: the shard pass on, and on CUDA the rank's own GPU."""
    sets = ["transforms.shard.enabled=true"]
    if torch.cuda.is_available() and env_info().world_size > 1:
        sets.append(f"model.device=cuda:{env_info().local_rank}")
    return sets


def probe_rank(rank: int, jobs: Sequence[ProbeJob]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for job in jobs:
        if job.cli_argv is not None:
            out[job.name] = {"rank": rank, "rc": build(build_parser().parse_args(list(job.cli_argv)))}
            continue
        model = job.model() if callable(job.model) else job.model
        if isinstance(model, torch.nn.Module) and torch.cuda.is_available() and env_info().world_size > 1:
            model = model.to(f"cuda:{env_info().local_rank}")
        om = optimize(model, overrides=[*job.overrides, *rank_overrides()])
        tokens = om.generate([list(p) for p in job.prompts], max_new_tokens=job.max_new_tokens) if job.prompts else []
        sampled = (om.generate([list(p) for p in job.prompts], max_new_tokens=job.max_new_tokens, **job.sampling)
                   if job.sampling else None)
        # prefix caching's decisions (the second generate takes the first's prompt pages): every rank
        # must take the same pages and cache the same keys in the same pages
        prefix = ({**om.last_generation["prefix_cache"], "cached_tokens": om.last_generation["cached_tokens"],
                   "pages": {k.hex(): p for k, p in om.allocator.cached_pages().items()}}
                  if job.prompts else None)
        logits = om.prefill_logits(list(job.logits_prompt)).float().cpu() if job.logits_prompt else None
        # The distribution each prompt's first generated token was drawn from (to tell a real
        # disagreement from a near-tie that 16-bit rounding may flip).
        first_logits = [om.prefill_logits(list(p))[-1].float().cpu() for p in job.prompts]
        rec = next((r for r in om.history if r.name == "shard"), None)
        load = next((r for r in om.history if r.name == "load_weights"), None)
        weights, values = {}, {}
        for n in om.gm.graph.nodes:
            if n.op == "get_attr":
                t = module_tensor(om.gm, n.target)
                if isinstance(t, torch.Tensor):
                    weights[n.target] = (tuple(t.shape), is_placeholder(t))
                    if job.weight_values:
                        v = t.detach().cpu().clone()
                        values[n.target] = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
        rep = om.report()
        out[job.name] = {
            "rank": rank,
            "world_size": env_info().world_size,
            "tokens": tokens,
            "sampled": sampled,
            "prefix_cache": prefix,
            "logits": logits,
            "first_logits": first_logits,
            "shard_summary": rec.summary if rec else None,
            "shard_details": rec.details if rec else None,
            "load_details": load.details if load else None,
            "layers": rep["layers"],
            "all_reduces": count_all_reduces(om.gm),
            "all_reduce_ops": sorted({str(n.target) for n in om.gm.graph.nodes if n.meta.get("tp_collective")}),
            "tp_all_reduce": om.runner.tp_all_reduce,
            "weights": weights,
            "weight_values": values if job.weight_values else None,
            "skeleton": is_skeleton(om.eager_model),
            "env": {k: os.environ.get(k) for k in MULTICAST_OFF_ENV},
            "device": str(om.device),
            "dtype": str(om.dtype),
        }
        del om
    return out
