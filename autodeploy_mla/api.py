"""`optimize(model, config)`: the Python entry point (DESIGN §10).

    config layers -> validated config + pipeline -> checks that need no model -> world size ->
    compile caches -> eager model (or weightless skeleton) -> passes -> CompiledModel -> ModelRunner ->
    OptimizedModel

Everything a user can get wrong without a model — unknown keys and passes, options, pass
requirements, runtime capacities the host cannot hold, the tensor-parallel world — is checked
before any model is built or exported. `OptimizedModel` is a thin facade over the `ModelRunner`
(runtime/model_runner.py) and the generation engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .config.loader import ConfigError, ConfigLayer, config_layers, load_config
from .config.schema import AppConfig, ModelConfig, RuntimeConfig
from .custom_ops.attention.registry import Target, policies_for
from .custom_ops.attention.cache_format import resolve_cache_dtype
from .custom_ops.flashinfer.jit import JitBuild, dims_from_hf_config, prefetch
from .distributed.env import init_distributed, require_group, resolve_world
from .distributed.launch import free_port, share_cpu_threads
from .models.factory import hf_config, resolve_device, resolve_dtype
from .models.loading import build_eager_model
from .models.skeleton import build_skeleton
from .runtime.artifacts import TensorParallel
from .runtime.capacity import available_host_bytes, cache_footprint, check_capacity, device_memory_bytes
from .runtime.compile_cache import CompileCaches, configure_compile_caches
from .runtime.data_parallel import Lockstep, gather_in_order, partition_by_tokens
from .runtime.engine import GenerationEngine, Request
from .runtime.errors import RequestError
from .runtime.model_runner import ModelRunner
from .runtime.page_allocator import PageAllocator
from .runtime.prefix_cache import cache_identity
from .runtime.sampling import SamplingParams
from .runtime.sequence_info import SequenceInfo
from .runtime.startup import CAPTURE_KINDS, CaptureSummary, CompileSummary, StartupReport
from .transforms.context import BuildContext, PassRecord
from .transforms.pass_manager import Pipeline, parse_pipeline, run_pipeline
from .transforms.shard import ShardOptions

ModelArg = Union[nn.Module, str, Path, None]
ConfigArg = Union[ConfigLayer, AppConfig, Sequence[ConfigLayer], None]


def build_config(model: ModelArg = None, config: ConfigArg = None, overrides: Sequence[str] = ()
                 ) -> tuple[AppConfig, Pipeline]:
    """The layered, validated config and pass pipeline for `model` + `config` + `overrides`.

    The one layering rule for the API and the CLI (config/loader.config_layers): a family name or
    YAML given as the model comes first, then the config layers (YAML paths, family names, dicts),
    then a checkpoint directory given as the model (it wins over a family's random-weight config),
    then `overrides` (`a.b=c`). An `AppConfig` is taken as it is (overrides still apply)."""
    if isinstance(config, AppConfig):
        cfg = load_config(config.model_dump(), overrides=overrides) if overrides else config
    else:
        configs: list[ConfigLayer] = []
        if config is not None:
            configs = list(config) if isinstance(config, (list, tuple)) else [config]  # type: ignore[list-item]
        named = model if isinstance(model, (str, Path)) else None
        cfg = load_config(*config_layers(named, configs), overrides=overrides)
    return cfg, parse_pipeline(cfg.transforms)


def rendezvous_port() -> int:
    """A free local TCP port for a process group whose ranks this process starts (data-parallel serving)."""
    return free_port()


def join_process_group(rank_env: Mapping[str, str], device: str) -> None:
    """In a rank process started by this package (data-parallel serving's engine cores): take the
    torchrun-style `rank_env` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), give the rank
    its share of the host's CPU threads on `device` "cpu", and start the default process group (gloo
    on CPU, NCCL on CUDA, the rank's GPU current) before a build shards by it."""
    os.environ.update(rank_env)
    if device == "cpu":
        share_cpu_threads(int(rank_env.get("WORLD_SIZE", "1")))
    init_distributed(device_type="cuda" if device.startswith("cuda") else "cpu" if device == "cpu" else None)


def check_runtime_capacity(rt: RuntimeConfig, model: Optional[ModelConfig] = None) -> None:
    """Refuse capacities this machine cannot hold, before any build work (runtime/capacity.py).

    Always: the step metadata (max_batch_size x pages-per-sequence page table, max_num_tokens
    buffers) against the host's available memory, and the int32 ranges of the metadata. With
    `model` (a config's model source): also the device it names (present? `resolve_device`) and
    the paged caches whose size the config fixes (CPU, or an explicit num_pages), from the model's
    HF config alone (layers x (R + Dr) x cache dtype per token)."""
    if model is None:
        check_capacity(rt, host_bytes=available_host_bytes())
        return
    device = resolve_device(model.device)
    footprint = cache_footprint(hf_config(model), rt, resolve_dtype(model.dtype, device))
    check_capacity(rt, device, footprint, available_host_bytes(), device_memory_bytes(device))


def _world(pipeline: Pipeline) -> Optional[TensorParallel]:
    """The tensor-parallel group of this build, resolved once (None: a single process)."""
    if not pipeline.enabled("shard"):
        return None
    opts = pipeline.options("shard")
    assert isinstance(opts, ShardOptions)
    world, rank = resolve_world(opts.world_size, opts.rank)
    if world == 1:
        return None
    return TensorParallel(world, rank, require_group(world, rank))


def _eager_model(cfg: AppConfig, pipeline: Pipeline, world: Optional[TensorParallel], device: torch.device,
                 dtype: torch.dtype) -> nn.Module:
    """The full HF model, or a weightless skeleton when every rank makes only its slices: from a
    checkpoint (`shard.load: slices`) or from hashed random weights (`model.init: hashed`)."""
    if world is not None and pipeline.enabled("load_weights"):
        opts = pipeline.options("shard")
        by_slices = isinstance(opts, ShardOptions) and opts.load == "slices"
        if (cfg.model.path is not None and by_slices) or (cfg.model.hf_config is not None and cfg.model.init == "hashed"):
            return build_skeleton(cfg.model, device, dtype)
    return build_eager_model(cfg.model, device, dtype)


@dataclass(frozen=True)
class BuildTimes:
    """What `optimize()` measured before the model could step (the passes are in the context's history)."""

    caches: Optional[CompileCaches] = None
    load_seconds: float = 0.0
    load_what: str = "module given"
    runner_seconds: float = 0.0


class OptimizedModel:
    """The compiled, cached model: generate(), the build report, and the graph (a thin facade over
    the `ModelRunner` and the generation engine)."""

    def __init__(self, ctx: BuildContext, runner: ModelRunner, eager_model: Optional[nn.Module],
                 build_times: BuildTimes = BuildTimes()) -> None:
        self.ctx = ctx
        self.runner = runner
        self.eager_model = eager_model
        self.build_times = build_times
        self.last_generation: dict[str, Any] = {}
        #: FlashInfer modules optimize() started compiling in the background (custom_ops/flashinfer/jit.py)
        self.jit_prefetch: list[JitBuild] = []

    # ------------------------------------------------------------------ views
    @property
    def config(self) -> AppConfig:
        return self.ctx.config

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.runner.gm

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def allocator(self) -> PageAllocator:
        return self.runner.allocator

    @property
    def seq_info(self) -> SequenceInfo:
        return self.runner.seq_info

    @property
    def vocab_size(self) -> int:
        return self.runner.compiled.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.compiled.eos_token_ids

    @property
    def history(self) -> list[PassRecord]:
        return self.ctx.history

    # ------------------------------------------------------------------ generation
    def engine(self, overlap: Optional[bool] = None, prefix_caching: Optional[bool] = None) -> GenerationEngine:
        """A generation engine over this model's runner and cache (`overlap`, `prefix_caching`:
        default runtime.overlap, runtime.prefix_caching)."""
        rt = self.config.runtime
        tp = self.runner.compiled.tp
        lockstep = (Lockstep(tp.world_size, self.runner.dp_host_group) if tp is not None and tp.data_parallel
                    else None)
        return GenerationEngine(self.runner, self.runner.allocator, vocab_size=self.vocab_size,
                                eos_token_ids=self.eos_token_ids, overlap=rt.overlap if overlap is None else overlap,
                                prefix_caching=rt.prefix_caching if prefix_caching is None else prefix_caching,
                                cache_identity=self.cache_identity, lockstep=lockstep)

    @property
    def data_parallel(self) -> bool:
        """Attention is data-parallel (`shard.attention: data` over >= 2 ranks): each rank runs its own
        requests in lock-step with the others (runtime/data_parallel.py)."""
        tp = self.runner.compiled.tp
        return tp is not None and tp.data_parallel

    @property
    def cache_identity(self) -> bytes:
        """The digest that roots this model's prefix-cache keys: the model (config.model), the
        activation dtype, every cache layer's name, width, dtype and FP8 scales, and the page size
        (`runtime.prefix_cache.cache_identity`). Pages cached under another identity never match."""
        return cache_identity([self.config.model, str(self.dtype), self.runner.caches.page_size,
                               *self.runner.caches.layouts])

    def warmup(self) -> dict[str, Any]:
        """Compile the static pieces and capture every CUDA graph a step can replay
        (`ModelRunner.warmup`), then, on CUDA, run a short burst of requests through the engine
        (`serving_burst`). Idempotent; returns the runner's warm-up report (with the burst's seconds)."""
        rep = self.runner.warmup()
        if self.device.type == "cuda" and "serving burst" not in rep["step_seconds"]:
            t = time.perf_counter()
            self.serving_burst()
            torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t
            rep["step_seconds"]["serving burst"] = round(dt, 4)
            rep["seconds"] += dt
        return rep

    def serving_burst(self, requests: Optional[int] = None, new_tokens: int = 4) -> list[Request]:
        """A few requests of spread-out prompt lengths through the engine, all at once (greedy).

        The warm-up's steps are one sequence each; served steps hold several prefill chunks of any
        length next to decode rows. Kernels that Triton specialises on such values (a count equal to 1
        or a multiple of 16, a chunk under or over the FA3 threshold) compile at their first use: on
        the H200 a 4-layer DeepSeek-V3 shape spent ~20 s of its first served requests compiling them.
        This burst meets them during start-up instead: `requests` (default min(max_batch_size, 24))
        prompts from 1 token to min(max_seq_len - new_tokens, 2 x max_num_tokens), arriving at once,
        so steps mix fresh prefills, continuations and decodes."""
        info = self.seq_info
        n = max(1, min(info.max_batch_size, 24) if requests is None else requests)
        longest = max(1, min(info.max_seq_len - new_tokens, 2 * info.max_num_tokens))
        lengths = [max(1, round(longest * (k + 1) / n)) - (k % 3) for k in range(n)]
        prompts = [[(7 * k + 13 * j) % self.vocab_size for j in range(max(1, ln))] for k, ln in enumerate(lengths)]
        return self.engine().run(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))

    def generate_requests(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        on_tokens: Optional[Callable[[list[tuple[int, int]]], None]] = None,
    ) -> list[Request]:
        """Per-request results (finish_reason, error). Timed after warm-up (graph capture excluded).

        Data-parallel attention: every rank must call it with the same prompts; the requests are
        partitioned across the ranks by tokens (prompt + max_new_tokens, `partition_by_tokens`), each
        rank generates its share in lock-step with the others, and every rank returns all the requests
        in prompt order (gathered from the ranks). `on_tokens` sees this rank's requests only, with
        this rank's engine ids."""
        warm = self.warmup()
        eng = self.engine()
        t0 = time.perf_counter()
        dp: dict[str, Any] = {}
        if self.data_parallel:
            tp = self.runner.compiled.tp
            assert tp is not None
            prompts = list(prompts)
            plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
            shares = partition_by_tokens([len(p) + sp.max_new_tokens for p, sp in zip(prompts, plist)],
                                         tp.world_size)
            mine = shares[tp.rank]
            local = eng.run([prompts[i] for i in mine], [plist[i] for i in mine], on_tokens)
            for r in local:  # not needed on the other ranks, and not picklable through the group
                r.leader = None
            reqs = gather_in_order(local, shares, len(prompts))
            dp = {"rank": tp.rank, "world_size": tp.world_size, "requests_per_rank": [len(s) for s in shares],
                  "my_requests": list(mine), "idle_steps": eng.idle_steps,
                  "lockstep_syncs": eng.lockstep.syncs if eng.lockstep is not None else 0}
        else:
            reqs = eng.run(prompts, params, on_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        new = sum(len(r.generated) for r in reqs)
        self.last_generation = {
            "requests": len(reqs),
            "failed": sum(r.finish_reason == "error" for r in reqs),
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "generated_tokens": new,
            "steps": len(eng.steps),
            "seconds": dt,
            "tokens_per_s": new / dt if dt > 0 else float("nan"),
            "warmup_seconds": warm["seconds"],
            "cached_tokens": sum(r.cached_tokens for r in reqs),
            "prefix_cache": self.prefix_cache_report(eng),
        }
        if dp:  # steps (and the prefix cache) are this rank's; requests and tokens every rank's
            self.last_generation["data_parallel"] = dp
        return reqs

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        on_tokens: Optional[Callable[[list[tuple[int, int]]], None]] = None,
        **sampling: Any,
    ) -> list[list[int]]:
        """Generated token ids per prompt (continuous batching). `sampling`: SamplingParams fields
        (temperature, top_k, top_p, seed, eos_token_id, stop_token_ids, ignore_eos, penalties,
        logit_bias; logprobs are on the requests of `generate_requests`). Stops at the
        model's end-of-sequence token unless ignore_eos=True. Raises if any request failed (after
        the others finished)."""
        reqs = self.generate_requests(prompts, SamplingParams(max_new_tokens=max_new_tokens, **sampling), on_tokens)
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RequestError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [r.generated for r in reqs]

    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits [S, V] of every prompt position, prefilled in chunks (then freed)."""
        self.engine().validate(prompt, SamplingParams(max_new_tokens=1))
        return self.runner.prefill_logits(prompt)

    # ------------------------------------------------------------------ report
    def startup(self) -> StartupReport:
        """Where start-up time went so far: caches, load, passes, runner, compile, capture, warm-up
        (runtime/startup.py). The server logs `startup().to_dict()`; `autodeploy build` prints `lines()`."""
        bt = self.build_times
        pw = self.runner.piecewise
        opts = self.runner.compiled.runner
        backend = opts.compile if opts is not None and pw is not None else "none"
        if pw is not None:
            groups = pw.compile_groups()
            cache: dict[str, int] = {}
            for g in groups:
                for k, v in g.get("cache", {}).items():
                    cache[k] = cache.get(k, 0) + v
            comp = CompileSummary(backend, pw.split.num_static, len(groups), sum(g.get("compiles", 0) for g in groups),
                                  sum(g.get("seconds", 0.0) for g in groups),
                                  sum(g.get("backend_seconds", 0.0) for g in groups), cache, tuple(groups),
                                  pw.token_dims_note)
            st = pw.capture_stats
            cap = CaptureSummary({k: int(st[k]["count"]) for k in CAPTURE_KINDS},
                                 {k: float(st[k]["seconds"]) for k in CAPTURE_KINDS},
                                 {k: int(st[k]["failed"]) for k in CAPTURE_KINDS})
        else:
            comp, cap = CompileSummary(backend, 0, 0, 0, 0.0, 0.0), CaptureSummary()
        warm = self.runner.warmup_report
        return StartupReport(bt.caches, bt.load_seconds, bt.load_what,
                             tuple((r.name, r.seconds) for r in self.history if r.enabled), bt.runner_seconds,
                             comp, cap, None if warm is None else float(warm["seconds"]),
                             dict(warm.get("step_seconds", {})) if warm is not None else {})

    def prefix_cache_report(self, engine: Optional[GenerationEngine] = None) -> dict[str, Any]:
        """The prefix cache now: whether it is on, pages cached (held or evictable), evictable, evicted
        so far; with `engine`: the prompt tokens it looked up and found cached (hits/queries)."""
        a = self.allocator
        out: dict[str, Any] = {"enabled": self.config.runtime.prefix_caching if engine is None else engine.prefix_caching,
                               "pages_cached": a.num_cached, "pages_evictable": a.num_evictable,
                               "pages_evicted": a.num_evicted}
        if engine is not None:
            out.update(query_tokens=engine.prefix_queries, hit_tokens=engine.prefix_hits)
        return out

    def report(self) -> dict[str, Any]:
        run = self.runner.report()
        tp = self.runner.compiled.tp
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "passes": [
                {"name": r.name, "enabled": r.enabled, "seconds": round(r.seconds, 4), "summary": r.summary}
                for r in self.history
            ],
            "layers": [d.to_dict() for d in self.ctx.artifacts.decisions],
            "attention_paths": run["attention_paths"],
            "cache": {**run["cache"], "prefix_cache": self.prefix_cache_report()},
            "runtime": self.config.runtime.model_dump(),
            "graph_inputs": run["graph_inputs"],
            "backend_sessions": run["sessions"],
            "pieces": run["pieces"],
            "piecewise_runner": run["piecewise_runner"],
            "warmup": run["warmup"],
            "tensor_parallel": None if tp is None else {"world_size": tp.world_size, "rank": tp.rank,
                                                        "group": tp.group, "all_reduces": tp.all_reduces,
                                                        "attention": tp.attention},
            "generation": self.last_generation,
            "startup": self.startup().to_dict(),
            "jit_prefetch": [b.to_dict() for b in self.jit_prefetch],
        }


def optimize(
    model: ModelArg = None,
    config: ConfigArg = None,
    overrides: Sequence[str] = (),
    on_pass: Optional[Callable[[PassRecord], None]] = None,
    *,
    backend_policies: Optional[Mapping[str, Any]] = None,
) -> OptimizedModel:
    """Compile `model` (nn.Module, family name, checkpoint dir, or None = the config's model).

    `config`: a YAML path, a family name, a dict, a list of them (layered in order over the packaged
    default), or an AppConfig. `overrides`: `a.b=c` strings applied last. The config's `attention:`
    section sets each backend's policy; `backend_policies` (backend name -> that backend's policy
    object, e.g. FlashInferPolicy) overrides a backend's whole policy from Python. The config
    objects are never mutated.
    """
    cfg, pipeline = build_config(model, config, overrides)
    check_runtime_capacity(cfg.runtime, None if isinstance(model, nn.Module) else cfg.model)
    world = _world(pipeline)
    if isinstance(model, nn.Module):
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else resolve_device(cfg.model.device)
        dtype = p.dtype if p is not None else resolve_dtype(cfg.model.dtype, device)
        caches = configure_compile_caches(device)
        jit = _prefetch_kernels(getattr(model, "config", None), cfg.runtime, device, dtype)
        eager, load_seconds, load_what = model.eval(), 0.0, "module given"
    else:
        device = resolve_device(cfg.model.device)
        dtype = resolve_dtype(cfg.model.dtype, device)
        # before anything compiles (fuse_routing's self-check runs Triton kernels) or imports flashinfer
        caches = configure_compile_caches(device)
        jit = _prefetch_kernels(hf_config(cfg.model), cfg.runtime, device, dtype)
        t0 = time.perf_counter()
        eager = _eager_model(cfg, pipeline, world, device, dtype)
        load_seconds = time.perf_counter() - t0
        load_what = f"checkpoint {cfg.model.path}" if cfg.model.path is not None else "config (random weights)"
    target = Target.detect(device, cfg.runtime.page_size)
    ctx = BuildContext(cfg, eager, device, dtype, target, world)
    run_pipeline(ctx, pipeline, on_pass)
    assert ctx.gm is not None
    t0 = time.perf_counter()
    policies = policies_for(cfg.attention.set_fields(), backend_policies)
    runner = ModelRunner(ctx.artifacts.compiled(ctx.gm), cfg.runtime, device, dtype, target, policies)
    times = BuildTimes(caches, load_seconds, load_what, time.perf_counter() - t0)
    om = OptimizedModel(ctx, runner, eager, times)
    om.jit_prefetch = jit
    return om


def _prefetch_kernels(hf: Any, rt: RuntimeConfig, device: torch.device, dtype: torch.dtype) -> list[JitBuild]:
    """Start compiling, in the background, the FlashInfer modules this model's attention may plan
    (custom_ops/flashinfer/jit.py): they build while the model is made, exported and compiled."""
    dims = dims_from_hf_config(hf) if hf is not None else None
    if dims is None or device.type != "cuda":
        return []
    return prefetch(dims, dtype, resolve_cache_dtype(rt.kv_cache_dtype, dtype), device)


__all__ = ["BuildTimes", "ConfigError", "OptimizedModel", "build_config", "check_runtime_capacity", "optimize"]
