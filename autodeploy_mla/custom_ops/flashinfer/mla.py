"""`torch.ops.autodeploy.flashinfer_mla_with_cache`: MLA through FlashInfer's `BatchMLAPagedAttentionWrapper`.

Every token of a step — decode, chunked-prefill continuation or fresh prefill — goes through the
absorbed paged path:

    q_abs = scale * q_nope · W_kn                 torch bmm (scale folded in fp32 via alpha)
    latent = FlashInfer(q_abs, scale * q_pe, ckv = mla_cache[..., :R], kpe = mla_cache[..., R:])
    out = latent · W_vᵀ                           torch bmm

The wrapper reads ckv / kpe as strided views of the one shared cache tensor: no copy. An FP8 cache
(SM90 fa3, FlashInfer >= 0.7.2, (R, Dr) = (512, 0 or 64): capabilities.CACHE_FACTS) is planned with
kv_data_type e4m3 and run with the layer's ckv_scale / kpe_scale; queries stay bf16.

Sessions. Everything this backend keeps — wrappers, plans, the workspace, fixed CUDA-graph buffers,
the policy and the counters — lives in a `FlashInferMLASession` that `setup()` returns for one
model; the op finds its model's session in the step context. Two models in one process plan
separately, each with its own page size and capacities.

Planning. `plan()` runs once per step, on the host, in the session's `prepare(metadata, step)`,
from the host mirrors of the metadata (never per layer, never inside a CUDA-graph capture). There
is one wrapper per distinct (N, R, Dr, dtype) among the nodes the session serves, shared by every
layer with that config; the op finds it by recomputing the key from its input shapes. The softmax
scale is not part of the key: wrappers are planned with sm_scale=1 and each node folds its own
scale into the query (FlashInfer's plan work does not depend on the scale), so layers with
different scales share one plan.

Per-step fallback. Some steps go, whole, to the fallback op (Triton if registered and accepting
the node, else the torch reference; both vectorised): for safety, multi-token steps when N does not
divide FlashInfer's 64/128-row query tile (a causal tile-boundary defect,
capabilities.FA_PREFILL_SAFE_HEADS) and steps whose plan would exceed MLAPlan's 16384 work items;
by policy (`FlashInferPolicy.prefill`, default "auto"), steps with prefill tokens whose estimated time
on the fallback's expanded path is lower than on FlashInfer's absorbed path, from the step's FLOPs
under the node's dims and each path's measured throughput (prefill_cost.py; fit to
docs/benchmarks/flashinfer_plan.md) when the fallback is Triton. Decode-only steps use FlashInfer, except
those of at most `decode_fallback_max_seqs` sequences (default 1) when the fallback is Triton.
The fallback op runs inside the fallback backend's own session for this model (`fallback_sessions`):
Triton keeps its step plans and its FA3 prefill wrapper there, and `prepare` prepares that session
for every step it hands over, so Triton reads the step's host shape once, not in every layer.

CUDA graphs. Decode-only steps that a whole-graph decode CUDA graph may replay — those the model
runner marks `StepDescriptor.cuda_graph` (a decode batch padded to one of its token buckets), or
every decode-only step with `FlashInferPolicy(cuda_graph=True)` — use one wrapper per batch size
created with `use_cuda_graph=True` over fixed qo_indptr / kv_indptr / kv_indices / kv_len buffers;
`prepare()` re-plans it before every replay, so a graph captured at one sequence length replays
correctly after the sequences grew. Other steps use the per-config eager wrapper (which
re-allocates its metadata buffers at each plan and so is never captured). Each fixed-buffer wrapper
holds FlashInfer's 8 MiB int workspace plus an 8 MiB pinned host mirror.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from ..attention.registry import (
    SCRATCH_PAGE,
    CheckResult,
    MLABackend,
    SessionSpec,
    StepDescriptor,
    StepMetadata,
    Target,
    register_backend,
)
from ..attention.cache_format import CacheScales, is_fp8
from .capabilities import FA_MAX_WORK_ITEMS, check_against_facts, check_cache_against_facts, fa_kernel_for, fa_prefill_safe
from ..attention.handoff import Fallback, call_fallback
from .common import (
    DEFAULT_FALLBACK_ORDER,
    FI_METADATA,
    FlashInferSession,
    FlashInferUnavailable,
    PlanKey,
    import_flashinfer_module,
    plan_configs,
)
from .metadata import MLACsr, StepCounts, fa_plan_work_bound, fa_plan_work_count, mla_csr
from ..attention.mla_dims import MLADims, resolve_scale
from ..attention.contract import MLAInputs, append_to_paged_cache, check_cached_inputs, define_cached_op_and_kernel
from ..attention.prefill_cost import SM90_FACTS, PrefillCostFacts
from ..attention.router import (DEFAULT_TRACE_STEPS, NodePaths, Path, Route, RouteLog, route_decode,
                                route_handoff_for_safety, route_prefill)
from ..attention.step_context import require_session

OP = "flashinfer_mla_with_cache"
METADATA = FI_METADATA
FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV workspace
PREFILL_POLICIES = ("auto", "flashinfer", "fallback")


@dataclass(frozen=True)
class FlashInferPolicy:
    """Per-model knobs of the FlashInfer MLA backend.

    prefill: where steps with prefill tokens run. "auto": on the fallback op when it is a backend
    with a measured expanded prefill (`fast_prefill_fallbacks`) and `prefill_cost` estimates the
    step cheaper there, else on FlashInfer; "flashinfer": always on FlashInfer (except the safety
    fallbacks); "fallback": always on the fallback op.

    prefill_cost: measured throughput and fixed cost of each path (prefill_cost.SM90_FACTS, from
    H200). The estimate takes the node's dims (N, R, Dr, Dn, Dv) and every sequence's query and
    context length: absorbed attention is ~(2R + Dr)/(Dn + Dr + Dv) times the attention FLOPs of
    expanded heads (3.4x for DeepSeek, 2.1x for GLM-4.7-Flash) but needs no K/V expansion. On
    H200 it reproduces every measured winner (docs/benchmarks/flashinfer_plan.md): FlashInfer up
    to ~512 fresh tokens at N=128 and on mixed steps, Triton from 2048 tokens or long prefixes.

    strided_io: head-major query/latent storage passed to FlashInfer as strided [T, N, R] views
    (saves two copies per layer); False = contiguous token-major tensors (kept for benchmarking).

    cuda_graph: every decode-only step uses a fixed-buffer wrapper (one per batch size), not only
    those the runner marks as graph steps; for callers that capture graphs themselves.

    max_work_items: steps whose plan needs more work items go to the fallback op (MLAPlan's
    capacity, capabilities.FA_MAX_WORK_ITEMS; lower it only to exercise that path).

    decode_fallback_max_seqs: decode-only steps of at most this many sequences run on the fallback
    op when it is one of `fast_decode_fallbacks` (0: never). H200, whole model, queued decode steps
    (docs/benchmarks/e2e_roofline.md, 2026-11-26 fifth session): at batch 1 the Triton backend's step
    is 5-11% faster (V2-Lite 3.21 -> 3.04 ms, GLM-4.7-Flash 5.36 -> 4.79 ms at 1k context, 5.40 ->
    5.00 ms at 4k); at batch 64 it is 1.6-2.5% faster at 1k but FlashInfer is 3% faster at 4k. The
    decision depends on the batch only, so a captured decode graph (one per batch size) keeps it.

    trace_steps: how many steps the session's route trace keeps (`stats()["routes"]`; the counters
    per route keep every step). Set from the config's `attention.flashinfer_mla` section, or here."""

    prefill: Literal["auto", "flashinfer", "fallback"] = "auto"
    prefill_cost: PrefillCostFacts = SM90_FACTS
    fast_prefill_fallbacks: tuple[str, ...] = ("triton",)
    fallback_order: tuple[str, ...] = DEFAULT_FALLBACK_ORDER
    strided_io: bool = True
    cuda_graph: bool = False
    max_work_items: int = FA_MAX_WORK_ITEMS
    decode_fallback_max_seqs: int = 1
    fast_decode_fallbacks: tuple[str, ...] = ("triton",)
    #: steps the route trace keeps (the router's counters keep every step)
    trace_steps: int = DEFAULT_TRACE_STEPS

    def __post_init__(self) -> None:
        if self.decode_fallback_max_seqs < 0:
            raise ValueError(f"FlashInferPolicy.decode_fallback_max_seqs={self.decode_fallback_max_seqs}: must be "
                             ">= 0 (0: decode steps never leave FlashInfer).")
        if self.prefill not in PREFILL_POLICIES:
            raise ValueError(f"FlashInferPolicy.prefill={self.prefill!r}; valid: {', '.join(PREFILL_POLICIES)}.")
        if not 1 <= self.max_work_items <= FA_MAX_WORK_ITEMS:
            raise ValueError(f"FlashInferPolicy.max_work_items={self.max_work_items}: must be in "
                             f"[1, {FA_MAX_WORK_ITEMS}] (MLAPlan's fixed capacity).")


@dataclass
class StepPlan:
    """What `prepare()` decided for the current step."""

    counts: StepCounts
    wrappers: dict[PlanKey, Any] = field(default_factory=dict)
    fallback: dict[PlanKey, str] = field(default_factory=dict)  # key -> why this step uses the fallback


@dataclass
class GraphBuffers:
    """Fixed device buffers of the CUDA-graph wrappers of one batch size (shared by all configs)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor


def _wrapper_cls() -> Any:
    mla = import_flashinfer_module("flashinfer.mla")
    cls = getattr(mla, "BatchMLAPagedAttentionWrapper", None)
    if cls is None:
        raise FlashInferUnavailable("flashinfer.mla has no BatchMLAPagedAttentionWrapper; upgrade flashinfer-python.")
    return cls


class FlashInferMLASession(FlashInferSession):
    """One model's FlashInfer MLA state: configs, wrappers, plans, buffers, policy and counters."""

    backend = "flashinfer_mla"
    op = OP
    policy: FlashInferPolicy

    def __init__(self, spec: SessionSpec, policy: FlashInferPolicy, configs: dict[PlanKey, Fallback]) -> None:
        super().__init__(spec, policy, configs)
        self.device = spec.device
        self.kernel = fa_kernel_for(spec.target.device) or "fa2"
        self.num_sm = spec.target.device.num_sms
        # For the prefill cost estimate: nodes of one plan key share N, R, Dr but may differ in Dn/Dv; the
        # widest expanded heads make the estimate conservative (towards FlashInfer, the planned path).
        self.key_dims: dict[PlanKey, MLADims] = {}
        nodes = sorted(zip(spec.dims, spec.node_cache_dtypes()), key=lambda dc: dc[0].qk_nope_head_dim + dc[0].v_head_dim)
        for d, cache_dtype in nodes:
            self.key_dims[PlanKey.of(d, spec.dtype, cache_dtype)] = d  # the widest of each key comes last and stays
        self.float_workspace: Optional[torch.Tensor] = None
        self.eager: dict[PlanKey, Any] = {}
        self.graph: dict[tuple[PlanKey, int], Any] = {}
        self.graph_buffers: dict[int, GraphBuffers] = {}
        self.step: Optional[StepPlan] = None
        self.plan_events: dict[int, Any] = {}  # id(wrapper) -> event after its last plan
        self.plans = 0  # plan() calls since setup
        self.fallback_steps = 0  # steps with at least one config on the fallback op (safety or routing)
        self.routed_steps = 0  # of those, steps routed by the prefill policy
        #: the attention router's record of this model's steps (counters per route, bounded trace)
        self.routes = RouteLog(policy.trace_steps)
        if configs:
            self.float_workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            # Build (JIT) and plan each config once now, so the first step does not pay for it.
            warm = MLACsr(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([SCRATCH_PAGE], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
            for key in configs:
                self._plan(self._wrapper_for(key, None), warm, key)
            self.plans = 0

    # -- wrappers and plans
    def _graph_buffers(self, bs: int) -> GraphBuffers:
        buf = self.graph_buffers.get(bs)
        if buf is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            buf = GraphBuffers(torch.zeros(bs + 1, **i32), torch.zeros(bs + 1, **i32),
                               torch.zeros(max(1, bs * self.spec.max_pages_per_seq), **i32), torch.zeros(bs, **i32))
            self.graph_buffers[bs] = buf
        return buf

    def _wrapper_for(self, key: PlanKey, graph_bs: Optional[int]) -> Any:
        """The eager wrapper of `key`, or (graph_bs given) its CUDA-graph wrapper for that batch size."""
        if graph_bs is None:
            w = self.eager.get(key)
            if w is None:
                w = self.eager[key] = _wrapper_cls()(self.float_workspace, backend=self.kernel)
            return w
        w = self.graph.get((key, graph_bs))
        if w is None:
            b = self._graph_buffers(graph_bs)
            w = self.graph[(key, graph_bs)] = _wrapper_cls()(
                self.float_workspace, use_cuda_graph=True, qo_indptr=b.qo_indptr, kv_indptr=b.kv_indptr,
                kv_indices=b.kv_indices, kv_len_arr=b.kv_len, backend=self.kernel,
            )
        return w

    def _plan(self, wrapper: Any, csr: MLACsr, key: PlanKey) -> None:
        # plan() stages its schedule in a pinned host buffer and copies it to the device asynchronously;
        # re-planning overwrites that buffer, so first wait until the previous plan's copy has executed
        # (normally long done: the engine synchronises every step to read the sampled tokens).
        done = self.plan_events.get(id(wrapper))
        if done is not None:
            done.synchronize()
        # Keyword arguments: the positional form is deprecated in newer FlashInfer releases.
        wrapper.plan(
            qo_indptr=csr.qo_indptr, kv_indptr=csr.kv_indptr, kv_indices=csr.kv_indices, kv_len_arr=csr.kv_len,
            num_heads=key.num_heads, head_dim_ckv=key.kv_lora_rank, head_dim_kpe=key.qk_rope_head_dim,
            page_size=self.spec.page_size, causal=True, sm_scale=1.0, q_data_type=key.dtype,
            kv_data_type=key.cache_dtype,
        )
        if self.device.type == "cuda":
            ev = self.plan_events.get(id(wrapper)) or torch.cuda.Event()
            ev.record()
            self.plan_events[id(wrapper)] = ev
        self.plans += 1

    def _route(self, key: PlanKey, counts: StepCounts, csr: MLACsr) -> Route:
        """This step's route for one config by policy (the attention router; safety comes after)."""
        p = self.policy
        handoff = self.configs[key].name
        if counts.decode_only:
            return route_decode(self.backend, handoff, counts.num_seqs, p.decode_fallback_max_seqs,
                                p.fast_decode_fallbacks)
        return route_prefill(self.backend, handoff, p.prefill, p.fast_prefill_fallbacks, self.key_dims[key],
                             csr.qo_lens, csr.kv_len, p.prefill_cost)

    def paths(self, dims: MLADims) -> NodePaths:
        """The node's decode and prefill paths under this session's policy and handoff backend."""
        p = self.policy
        fb = next((f for k, f in self.configs.items()
                   if (k.num_heads, k.kv_lora_rank, k.qk_rope_head_dim) ==
                   (dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim)), None)
        handoff = fb.name if fb is not None else "the handoff backend"
        dec = (f"{self.backend} (FlashInfer MLA wrapper; fixed-buffer wrappers in decode graphs)"
               + (f"; decode steps of <= {p.decode_fallback_max_seqs} sequence(s) -> {handoff} "
                  "(decode_fallback_max_seqs)" if handoff in p.fast_decode_fallbacks and p.decode_fallback_max_seqs
                  else ""))
        if not fa_prefill_safe(dims.num_heads):
            pre = Path(handoff, f"N={dims.num_heads} does not divide FlashInfer's query tile: every step with "
                                "prefill tokens runs on the handoff backend")
        elif p.prefill == "fallback":
            pre = Path(handoff, "prefill=fallback: every step with prefill tokens")
        elif p.prefill == "auto" and handoff in p.fast_prefill_fallbacks:
            pre = Path(self.backend, f"per step by estimated cost: {self.backend} absorbed vs {handoff} expanded "
                                     f"({p.prefill_cost.source})")
        else:
            pre = Path(self.backend, f"prefill={p.prefill}: absorbed on FlashInfer")
        return NodePaths(Path(self.backend, dec), pre)

    def prepare(self, meta: StepMetadata, step: StepDescriptor) -> None:
        """Plan every config once for the step described by the metadata's host mirrors."""
        counts = StepCounts.of(meta.get("batch_info_host"))
        plan = StepPlan(counts)
        self.step = plan
        if counts.num_seqs == 0 or not self.configs:
            return
        csr = mla_csr(meta.get("cu_seqlen_host"), meta.get("seq_len_with_cache_host"), meta.get("page_table_host"),
                      counts.num_seqs, self.spec.page_size)
        # Fixed-buffer (CUDA-graph) wrappers for decode-only steps that may be replayed from a graph.
        graphable = counts.decode_only and (step.cuda_graph or self.policy.cuda_graph)
        graph_bs = counts.num_seqs if graphable else None
        qo_lens = csr.qo_lens
        routed = False
        self.routes.next_step()
        kind = "decode" if counts.decode_only else "prefill"
        for key in self.configs:
            route = self._route(key, counts, csr)
            if route.backend != self.backend:
                plan.fallback[key] = route.reason
                self.routes.record(key.short(), route)
                routed = True
                continue
            if not counts.decode_only and not fa_prefill_safe(key.num_heads):
                why = (f"multi-token step with N={key.num_heads}: FlashInfer's causal tile bound "
                       "can drop a visible key unless N divides the 64/128-row query tile")
                plan.fallback[key] = why
                self.routes.record(key.short(), route_handoff_for_safety(kind, self.configs[key].name, why))
                continue
            limit = self.policy.max_work_items
            works = fa_plan_work_bound(qo_lens, key.num_heads, self.num_sm)
            if works > limit:  # the bound is loose: count exactly before giving up
                works = fa_plan_work_count(qo_lens, csr.kv_len, key.num_heads, self.num_sm)
            if works > limit:
                why = f"plan needs {works} work items, over the capacity of {limit}"
                plan.fallback[key] = why
                self.routes.record(key.short(), route_handoff_for_safety(kind, self.configs[key].name, why))
                continue
            w = self._wrapper_for(key, graph_bs)
            self._plan(w, csr, key)
            plan.wrappers[key] = w
            self.routes.record(key.short(), route)
        if plan.fallback:
            self.fallback_steps += 1
            self.routed_steps += routed
            self.prepare_fallback_sessions(meta, step)

    def step_for(self, key: PlanKey, batch_info_host: torch.Tensor) -> StepPlan:
        self.require_config(key)
        counts = StepCounts.of(batch_info_host)
        plan = self.step
        if plan is None or plan.counts != counts:
            raise self.unprepared(counts, None if plan is None else plan.counts)
        return plan

    def stats(self) -> dict[str, Any]:
        return {"plans": self.plans, "fallback_steps": self.fallback_steps, "routed_steps": self.routed_steps,
                "configs": {k.short(): fb.name for k, fb in self.configs.items()},
                "graph_wrappers": sorted(bs for _, bs in self.graph), "routes": self.routes.to_dict(),
                **self.fallback_stats()}


# ------------------------------------------------------------------ the math around FlashInfer
def absorbed_attention(run, x: MLAInputs, n: int, mla_cache: torch.Tensor, dims: MLADims, scale: Optional[float],
                       out: torch.Tensor, strided: bool = True) -> None:
    """out[n, N, Dv] = MLA over the paged cache for the first n tokens; `run(q_abs, q_pe, ckv, kpe,
    latent_out)` attends with softmax scale 1 (the node's scale is folded into the query here)."""
    q_nope, q_pe = x.q_nope[0, :n], x.q_pe[0, :n]
    nh, r = dims.num_heads, dims.kv_lora_rank
    s = resolve_scale(dims, scale)
    w_kn, w_v = dims.split_kv_b(x.kv_b_proj_weight)
    dt = q_nope.dtype
    # alpha scales the fp32 accumulator before rounding: q_abs carries the scale at no extra rounding.
    q_abs_hm = torch.empty(nh, n, r, dtype=dt, device=q_nope.device)
    q_abs_hm.baddbmm_(q_nope.transpose(0, 1), w_kn, beta=0.0, alpha=s)
    q_pe_s = q_pe * s  # [n, N, Dr] contiguous (one extra bf16 rounding on the rope part only)
    ckv, kpe = mla_cache[..., :r], mla_cache[..., r:]
    if strided:
        latent_hm = torch.empty(nh, n, r, dtype=dt, device=q_nope.device)
        run(q_abs_hm.transpose(0, 1), q_pe_s, ckv, kpe, latent_hm.transpose(0, 1))
    else:
        latent = torch.empty(n, nh, r, dtype=dt, device=q_nope.device)
        run(q_abs_hm.transpose(0, 1).contiguous(), q_pe_s, ckv, kpe, latent)
        latent_hm = latent.transpose(0, 1)
    torch.bmm(latent_hm, w_v.transpose(1, 2), out=out.transpose(0, 1))


def _wrapper_run(wrapper, scales: Optional[CacheScales] = None):
    """run(...) of `wrapper`; with `scales` (an FP8 cache) the per-tensor ckv / kpe scales it requires."""
    extra = {} if scales is None else {"ckv_scale": scales.latent, "kpe_scale": scales.rope}

    def run(q_abs, q_pe, ckv, kpe, latent_out):
        wrapper.run(q_abs, q_pe, ckv, kpe, out=latent_out, **extra)
    return run


def _flashinfer_mla_with_cache(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                               scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Append the step's tokens to the paged cache, then attend through FlashInfer. Returns [1, T, N, Dv]."""
    dims = check_cached_inputs(OP, x, mla_cache)
    key = PlanKey.of(dims, x.q_nope.dtype, mla_cache.dtype)
    sess: FlashInferMLASession = require_session(OP, "flashinfer_mla")  # type: ignore[assignment]
    plan = sess.step_for(key, meta["batch_info_host"])
    if key in plan.fallback:
        fb = sess.configs[key]
        return call_fallback(fb, x, meta, mla_cache, scale, scales, sess.fallback_session(fb))

    append_to_paged_cache(mla_cache, x, meta["cache_loc"], scales)
    t_all = x.q_nope.shape[1]
    n = plan.counts.num_tokens
    out = x.q_nope.new_empty(1, t_all, dims.num_heads, dims.v_head_dim)
    if n < t_all:
        out[0, n:].zero_()  # padded tokens: finite, ignored
    if n == 0:
        return out
    run = _wrapper_run(plan.wrappers[key], scales if is_fp8(mla_cache.dtype) else None)
    absorbed_attention(run, x, n, mla_cache, dims, scale, out[0, :n], strided=sess.policy.strided_io)
    return out


flashinfer_mla_with_cache, _direct = define_cached_op_and_kernel(OP, METADATA, _flashinfer_mla_with_cache)


# ------------------------------------------------------------------ descriptor
@register_backend
class FlashInferMLABackend(MLABackend):
    name = "flashinfer_mla"
    policy_type = FlashInferPolicy
    cached_op = flashinfer_mla_with_cache
    direct_call = staticmethod(_direct)
    metadata = METADATA
    source = "FlashInfer BatchMLAPagedAttentionWrapper (fa3 on SM90, fa2 on SM80+); facts: custom_ops/flashinfer/capabilities.py"
    is_dynamic = True
    #: Decode-only steps marked for CUDA graphs plan fixed-buffer wrappers (see module doc).
    decode_graph_safe = True
    #: sparse (DSA) layers of a model requested on this backend run on FlashInfer's sparse backend
    sparse_sibling = "flashinfer_mla_sparse"

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        res = check_against_facts(self.name, fa_kernel_for(target.device), dims, dtype, target)
        if res.ok and not fa_prefill_safe(dims.num_heads):
            return CheckResult(True, res.reason + f"; N={dims.num_heads} does not divide FlashInfer's query tile, "
                               "so multi-token steps run on the fallback op (decode stays on FlashInfer)")
        return res

    def check_cache(self, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
        return check_cache_against_facts(self.name, fa_kernel_for(target.device), dims, dtype, cache_dtype, target)

    def setup(self, spec: SessionSpec, policy: Optional[FlashInferPolicy] = None) -> FlashInferMLASession:
        policy = policy or FlashInferPolicy()
        return FlashInferMLASession(spec, policy, plan_configs(self, spec, policy.fallback_order))
