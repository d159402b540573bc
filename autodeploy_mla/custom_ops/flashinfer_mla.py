"""`torch.ops.autodeploy.flashinfer_mla_with_cache`: MLA through FlashInfer's `BatchMLAPagedAttentionWrapper`.

Every token of a step — decode, chunked-prefill continuation or fresh prefill — goes through the
absorbed paged path:

    q_abs = scale * q_nope · W_kn                 torch bmm (scale folded in fp32 via alpha)
    latent = FlashInfer(q_abs, scale * q_pe, ckv = mla_cache[..., :R], kpe = mla_cache[..., R:])
    out = latent · W_vᵀ                           torch bmm

The wrapper reads ckv / kpe as strided views of the one shared cache tensor: no copy.

Planning. `plan()` runs once per step, on the host, in the descriptor's `prepare(seq_info)`, from
the host mirrors of the metadata (never per layer, never inside a CUDA-graph capture). There is one
wrapper per distinct (N, R, Dr, dtype) among the nodes this backend serves (from `setup()`), shared
by every layer with that config; the op finds it by recomputing the key from its input shapes. The
softmax scale is not part of the key: wrappers are planned with sm_scale=1 and each node folds its
own scale into the query (FlashInfer's plan work does not depend on the scale), so layers with
different scales share one plan.

Per-step fallback. Some steps go, whole, to the fallback op (Triton if registered and accepting
the node, else the torch reference; both vectorised): for safety, multi-token steps when N does not
divide FlashInfer's 64/128-row query tile (a causal tile-boundary defect,
capabilities.FA_PREFILL_SAFE_HEADS) and steps whose plan would exceed MLAPlan's 16384 work items;
by policy (`configure(prefill=...)`, default "auto"), steps with large prefill (prefill tokens x N
>= ROUTE_PREFILL_MIN_HEAD_TOKENS) when the fallback is Triton, which measured faster there on H200
(docs/benchmarks/flashinfer_plan.md). Decode-only steps always use FlashInfer.

CUDA graphs. Decode-only steps that a whole-graph decode CUDA graph may replay — those whose batch
size is one of `seq_info.token_buckets` (set by the piecewise runner), or every decode-only step
after `configure(cuda_graph=True)` — use one wrapper per batch size created with
`use_cuda_graph=True` over fixed qo_indptr / kv_indptr / kv_indices / kv_len buffers; `prepare()`
re-plans it before every replay, so a graph captured at one sequence length replays correctly after
the sequences grew. Other steps use the per-config eager wrapper (which re-allocates its metadata
buffers at each plan and so is never captured). Each fixed-buffer wrapper holds FlashInfer's 8 MiB
int workspace plus an 8 MiB pinned host mirror.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..runtime.page_allocator import SCRATCH_PAGE
from .backend_registry import (
    CheckResult,
    DeviceInfo,
    MLABackend,
    all_backends,
    library_versions,
    register_backend,
)
from .cached_op_checks import cached_op_fake, check_cached_inputs
from .capabilities import FA_MAX_WORK_ITEMS, check_against_facts, fa_kernel_for, fa_prefill_safe
from .flashinfer_metadata import MLACsr, StepCounts, fa_plan_work_bound, fa_plan_work_count, mla_csr
from .mla_dims import MLADims, resolve_scale
from .torch_backend import append_to_paged_cache

OP = "flashinfer_mla_with_cache"
FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV workspace
#: SequenceInfo fields the op takes: what FlashInfer needs (batch_info_host, cache_loc) plus everything
#: the fallback ops take (torch reference and Triton), so a step can be handed to either unchanged.
METADATA: tuple[str, ...] = (
    "batch_info_host",
    "max_seq_info_host",
    "cu_seqlen_host",
    "input_pos_host",
    "cu_seqlen",
    "input_pos",
    "seq_len_with_cache",
    "page_table",
    "batch_idx",
    "cache_loc",
)
#: Preference for steps FlashInfer must not run (first registered backend whose check() accepts).
FALLBACK_ORDER: tuple[str, ...] = ("triton", "torch")
#: Fallback backends measured faster than FlashInfer's absorbed path on large prefill
#: (docs/benchmarks/flashinfer_plan.md). With prefill="auto", a step is routed to them when its
#: prefill work, num_prefill_tokens x N, reaches ROUTE_PREFILL_MIN_HEAD_TOKENS. On H200 (N=128) the
#: absorbed path won up to 512 prefill tokens and on mixed steps with 1024 prefill tokens + 62
#: decodes; Triton won from 2048 prefill tokens (fresh, chunked on a 3584-token prefix, or 8x512):
#: absorbed attention runs in the 576/512-wide latent space, ~3.4x the FLOPs of expanded 192/128 heads.
FAST_PREFILL_FALLBACKS: tuple[str, ...] = ("triton",)
ROUTE_PREFILL_MIN_HEAD_TOKENS = 2048 * 128
PREFILL_POLICIES = ("auto", "flashinfer", "fallback")
#: Head-major query/latent storage passed to FlashInfer as strided [T, N, R] views (saves two copies
#: per layer). False = contiguous token-major tensors (one extra copy each); kept for benchmarking.
STRIDED_IO = True


class FlashInferUnavailable(RuntimeError):
    """FlashInfer is not installed or lacks the API this backend calls."""


def import_flashinfer_module(name: str) -> Any:
    """Import `flashinfer` or one of its submodules lazily (the project runs without FlashInfer)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise FlashInferUnavailable(
            f"{name} could not be imported ({e}). Install flashinfer-python (>= 0.6.18) to use the "
            "FlashInfer MLA backends, or choose backend 'triton' / 'torch'."
        ) from e


# Indirections the CPU tests replace with mocks (installed versions, device capability).
def installed_versions() -> dict[str, Optional[str]]:
    return library_versions()


def device_info(device: torch.device) -> DeviceInfo:
    return DeviceInfo.of(device)


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H200; only used when the kernels are emulated on CPU in tests


# ------------------------------------------------------------------ fallback op
@dataclass(frozen=True)
class Fallback:
    name: str
    op: Any
    metadata: tuple[str, ...]


def resolve_fallback(
    dims_list: Sequence[MLADims],
    dtype: torch.dtype,
    device: DeviceInfo,
    versions: Mapping[str, Optional[str]],
    page_size: int,
    available_metadata: Sequence[str] = METADATA,
    order: Optional[Sequence[str]] = None,
) -> Fallback:
    """First backend of `order` (default FALLBACK_ORDER) that is registered, takes a subset of our metadata
    and accepts every node."""
    registry = all_backends()
    tried = []
    for name in FALLBACK_ORDER if order is None else order:
        be = registry.get(name)
        if be is None:
            tried.append(f"{name}: not registered")
            continue
        if not set(be.metadata) <= set(available_metadata):
            tried.append(f"{name}: needs metadata {sorted(set(be.metadata) - set(available_metadata))}")
            continue
        bad = [r.reason for d in dims_list if not (r := be.check(d, dtype, device, versions, page_size)).ok]
        if bad:
            tried.append(f"{name}: {bad[0]}")
            continue
        return Fallback(name, be.cached_op, tuple(be.metadata))
    raise ValueError("no fallback backend for FlashInfer's unsupported steps: " + "; ".join(tried))


def call_fallback(fb: Fallback, inputs: Sequence[torch.Tensor], meta: Mapping[str, torch.Tensor],
                  mla_cache: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    return fb.op(*inputs, *(meta[m] for m in fb.metadata), mla_cache, scale)


# ------------------------------------------------------------------ per-process state
@dataclass(frozen=True)
class PlanKey:
    """What a FlashInfer MLA plan depends on (besides the batch): heads, latent/rope widths, dtype."""

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, dims: MLADims, dtype: torch.dtype) -> "PlanKey":
        return cls(dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, dtype)

    def short(self) -> str:
        return f"N={self.num_heads} R={self.kv_lora_rank} Dr={self.qk_rope_head_dim} {str(self.dtype).replace('torch.', '')}"


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


@dataclass
class FlashInferMLAState:
    configs: dict[PlanKey, Fallback] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    page_size: int = 0
    max_pages_per_seq: int = 0
    kernel: str = "fa3"
    num_sm: int = 132
    float_workspace: Optional[torch.Tensor] = None
    eager: dict[PlanKey, Any] = field(default_factory=dict)
    graph: dict[tuple[PlanKey, int], Any] = field(default_factory=dict)
    graph_buffers: dict[int, GraphBuffers] = field(default_factory=dict)
    cuda_graph: bool = False
    prefill: str = "auto"  # see PREFILL_POLICIES / FlashInferMLABackend.configure
    step: Optional[StepPlan] = None
    plan_events: dict[int, Any] = field(default_factory=dict)  # id(wrapper) -> event after its last plan
    plans: int = 0  # plan() calls since setup (for tests and benchmarks)
    fallback_steps: int = 0  # steps with at least one config on the fallback op (safety or routing)
    routed_steps: int = 0  # of those, steps routed by the prefill policy


_STATE = FlashInferMLAState()


def state() -> FlashInferMLAState:
    return _STATE


def _wrapper_cls():
    mla = import_flashinfer_module("flashinfer.mla")
    cls = getattr(mla, "BatchMLAPagedAttentionWrapper", None)
    if cls is None:
        raise FlashInferUnavailable("flashinfer.mla has no BatchMLAPagedAttentionWrapper; upgrade flashinfer-python.")
    return cls


def _graph_buffers(st: FlashInferMLAState, bs: int) -> GraphBuffers:
    buf = st.graph_buffers.get(bs)
    if buf is None:
        i32 = dict(dtype=torch.int32, device=st.device)
        buf = GraphBuffers(torch.zeros(bs + 1, **i32), torch.zeros(bs + 1, **i32),
                           torch.zeros(max(1, bs * st.max_pages_per_seq), **i32), torch.zeros(bs, **i32))
        st.graph_buffers[bs] = buf
    return buf


def _wrapper_for(st: FlashInferMLAState, key: PlanKey, graph_bs: Optional[int]) -> Any:
    """The eager wrapper of `key`, or (graph_bs given) its CUDA-graph wrapper for that batch size."""
    if graph_bs is None:
        w = st.eager.get(key)
        if w is None:
            w = st.eager[key] = _wrapper_cls()(st.float_workspace, backend=st.kernel)
        return w
    w = st.graph.get((key, graph_bs))
    if w is None:
        b = _graph_buffers(st, graph_bs)
        w = st.graph[(key, graph_bs)] = _wrapper_cls()(
            st.float_workspace, use_cuda_graph=True, qo_indptr=b.qo_indptr, kv_indptr=b.kv_indptr,
            kv_indices=b.kv_indices, kv_len_arr=b.kv_len, backend=st.kernel,
        )
    return w


def _plan(st: FlashInferMLAState, wrapper: Any, csr: MLACsr, key: PlanKey) -> None:
    # plan() stages its schedule in a pinned host buffer and copies it to the device asynchronously;
    # re-planning overwrites that buffer, so first wait until the previous plan's copy has executed
    # (normally long done: the engine synchronises every step to read the sampled tokens).
    done = st.plan_events.get(id(wrapper))
    if done is not None:
        done.synchronize()
    # Keyword arguments: the positional form is deprecated in newer FlashInfer releases.
    wrapper.plan(
        qo_indptr=csr.qo_indptr, kv_indptr=csr.kv_indptr, kv_indices=csr.kv_indices, kv_len_arr=csr.kv_len,
        num_heads=key.num_heads, head_dim_ckv=key.kv_lora_rank, head_dim_kpe=key.qk_rope_head_dim,
        page_size=st.page_size, causal=True, sm_scale=1.0, q_data_type=key.dtype, kv_data_type=key.dtype,
    )
    if st.device.type == "cuda":
        ev = st.plan_events.get(id(wrapper)) or torch.cuda.Event()
        ev.record()
        st.plan_events[id(wrapper)] = ev
    st.plans += 1


def plan_step(st: FlashInferMLAState, seq_info) -> StepPlan:
    """Plan every config once for the step described by `seq_info`'s host mirrors."""
    counts = StepCounts.of(seq_info.get("batch_info_host"))
    step = StepPlan(counts)
    if counts.num_seqs == 0 or not st.configs:
        return step
    csr = mla_csr(seq_info.get("cu_seqlen_host"), seq_info.get("seq_len_with_cache_host"),
                  seq_info.get("page_table_host"), counts.num_seqs, st.page_size)
    # Fixed-buffer (CUDA-graph) wrappers for decode-only steps that may be replayed from a graph: those
    # padded to one of the runner's token buckets (T == batch size), or all of them in cuda_graph mode.
    buckets = getattr(seq_info, "token_buckets", ()) or ()
    graph_bs = counts.num_seqs if counts.decode_only and (st.cuda_graph or counts.num_seqs in buckets) else None
    qo_lens = csr.qo_lens
    routed = False
    for key in st.configs:
        if not counts.decode_only and _route_prefill(st, key, counts):
            step.fallback[key] = f"step with prefill tokens routed to {st.configs[key].name} (prefill={st.prefill})"
            routed = True
            continue
        if not counts.decode_only and not fa_prefill_safe(key.num_heads):
            step.fallback[key] = (f"multi-token step with N={key.num_heads}: FlashInfer's causal tile bound "
                                  "can drop a visible key unless N divides the 64/128-row query tile")
            continue
        works = fa_plan_work_bound(qo_lens, key.num_heads, st.num_sm)
        if works > FA_MAX_WORK_ITEMS:  # the bound is loose: count exactly before giving up
            works = fa_plan_work_count(qo_lens, csr.kv_len, key.num_heads, st.num_sm)
        if works > FA_MAX_WORK_ITEMS:
            step.fallback[key] = f"plan needs {works} work items, over MLAPlan's capacity of {FA_MAX_WORK_ITEMS}"
            continue
        w = _wrapper_for(st, key, graph_bs)
        _plan(st, w, csr, key)
        step.wrappers[key] = w
    if step.fallback:
        st.fallback_steps += 1
        st.routed_steps += routed
    return step


def _route_prefill(st: FlashInferMLAState, key: PlanKey, counts: StepCounts) -> bool:
    """Whether a step with prefill tokens goes to the fallback op by policy (not for safety)."""
    if st.prefill == "flashinfer":
        return False
    if st.prefill == "fallback":
        return True
    return (st.configs[key].name in FAST_PREFILL_FALLBACKS  # auto
            and counts.num_prefill_tokens * key.num_heads >= ROUTE_PREFILL_MIN_HEAD_TOKENS)


def _step_for(st: FlashInferMLAState, op: str, key: PlanKey, batch_info_host: torch.Tensor) -> StepPlan:
    if key not in st.configs:
        served = ", ".join(k.short() for k in st.configs) or "none"
        raise RuntimeError(
            f"{op}: no FlashInfer plan for {key.short()} (setup() was given: {served}). The backend's "
            "setup(dims_list, dtype, seq_info) must list every node it serves; setup validates each with check()."
        )
    counts = StepCounts.of(batch_info_host)
    step = st.step
    if step is None or step.counts != counts:
        planned = None if step is None else step.counts
        raise RuntimeError(
            f"{op}: the step's batch ({counts}) was not planned (last plan: {planned}). Call the backend's "
            "prepare(seq_info) after SequenceInfo.prepare_step and before running the graph, every step."
        )
    return step


# ------------------------------------------------------------------ the math around FlashInfer
def absorbed_attention(run, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_proj_weight: torch.Tensor,
                       mla_cache: torch.Tensor, dims: MLADims, scale: Optional[float], out: torch.Tensor,
                       strided: bool = True) -> None:
    """out[n, N, Dv] = MLA over the paged cache for n tokens; `run(q_abs, q_pe, ckv, kpe, latent_out)` attends
    with softmax scale 1 (the node's scale is folded into the query here)."""
    n = q_nope.shape[0]
    nh, dn, dv, r = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    s = resolve_scale(dims, scale)
    w = kv_b_proj_weight.view(nh, dn + dv, r)
    w_kn, w_v = w[:, :dn], w[:, dn:]
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


def _wrapper_run(wrapper):
    def run(q_abs, q_pe, ckv, kpe, latent_out):
        wrapper.run(q_abs, q_pe, ckv, kpe, out=latent_out)
    return run


@torch.library.custom_op("autodeploy::flashinfer_mla_with_cache", mutates_args=("mla_cache",))
def flashinfer_mla_with_cache(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    batch_info_host: torch.Tensor,
    max_seq_info_host: torch.Tensor,
    cu_seqlen_host: torch.Tensor,
    input_pos_host: torch.Tensor,
    cu_seqlen: torch.Tensor,
    input_pos: torch.Tensor,
    seq_len_with_cache: torch.Tensor,
    page_table: torch.Tensor,
    batch_idx: torch.Tensor,
    cache_loc: torch.Tensor,
    mla_cache: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Append the step's tokens to the paged cache, then attend through FlashInfer. Returns [1, T, N, Dv]."""
    dims = check_cached_inputs(OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache)
    key = PlanKey.of(dims, q_nope.dtype)
    st = _STATE
    step = _step_for(st, OP, key, batch_info_host)
    if key in step.fallback:
        meta = dict(zip(METADATA, (batch_info_host, max_seq_info_host, cu_seqlen_host, input_pos_host, cu_seqlen,
                                   input_pos, seq_len_with_cache, page_table, batch_idx, cache_loc)))
        return call_fallback(st.configs[key], (q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight), meta,
                             mla_cache, scale)

    append_to_paged_cache(mla_cache, compressed_kv, kpe, cache_loc)
    t_all = q_nope.shape[1]
    n = step.counts.num_tokens
    out = q_nope.new_empty(1, t_all, dims.num_heads, dims.v_head_dim)
    if n < t_all:
        out[0, n:].zero_()  # padded tokens: finite, ignored
    if n == 0:
        return out
    absorbed_attention(_wrapper_run(step.wrappers[key]), q_nope[0, :n], q_pe[0, :n], kv_b_proj_weight,
                       mla_cache, dims, scale, out[0, :n], strided=STRIDED_IO)
    return out


flashinfer_mla_with_cache.register_fake(cached_op_fake(OP, METADATA))


# ------------------------------------------------------------------ descriptor
def _group_by_key(dims_list: Sequence[MLADims], dtype: torch.dtype) -> dict[PlanKey, list[MLADims]]:
    groups: dict[PlanKey, list[MLADims]] = {}
    for d in dims_list:
        groups.setdefault(PlanKey.of(d, dtype), []).append(d)
    return groups


@register_backend
class FlashInferMLABackend(MLABackend):
    name = "flashinfer_mla"
    cached_op = torch.ops.autodeploy.flashinfer_mla_with_cache
    metadata = METADATA
    source = "FlashInfer BatchMLAPagedAttentionWrapper (fa3 on SM90, fa2 on SM80+); facts: custom_ops/capabilities.py"
    is_dynamic = True
    #: Decode-only steps at a token-bucket batch size plan fixed-buffer wrappers (see module doc).
    decode_graph_safe = True

    def check(
        self,
        dims: MLADims,
        dtype: torch.dtype,
        device: DeviceInfo,
        versions: Mapping[str, Optional[str]],
        page_size: int,
    ) -> CheckResult:
        res = check_against_facts(self.name, fa_kernel_for(device), dims, dtype, device, versions, page_size)
        if res.ok and not fa_prefill_safe(dims.num_heads):
            return CheckResult(True, res.reason + f"; N={dims.num_heads} does not divide FlashInfer's query tile, "
                               "so multi-token steps run on the fallback op (decode stays on FlashInfer)")
        return res

    # -- runtime hooks
    def configure(self, *, cuda_graph: Optional[bool] = None, prefill: Optional[str] = None) -> None:
        """Runtime options (kept across setup()).

        cuda_graph=True: every decode-only step uses a fixed-buffer wrapper (one per batch size) that
        CUDA graphs can capture, not only those at a `seq_info.token_buckets` size; for callers that
        capture graphs themselves. prepare() re-plans them before each replay.
        prefill: where steps with prefill tokens run. "auto" (default): on the fallback op when that is
        a backend measured faster for large prefill (Triton) and the step's prefill tokens x N reach
        ROUTE_PREFILL_MIN_HEAD_TOKENS, else on FlashInfer; "flashinfer": always on FlashInfer (except
        the safety fallbacks); "fallback": always on the fallback op.
        """
        if cuda_graph is not None:
            _STATE.cuda_graph = bool(cuda_graph)
        if prefill is not None:
            if prefill not in PREFILL_POLICIES:
                raise ValueError(f"{self.name}.configure: prefill={prefill!r}; valid: {', '.join(PREFILL_POLICIES)}.")
            _STATE.prefill = prefill

    def setup(self, dims: list[MLADims], dtype: torch.dtype, seq_info) -> None:
        device = torch.device(seq_info.device)
        dev, versions = device_info(device), installed_versions()
        groups = _group_by_key(dims, dtype)
        configs: dict[PlanKey, Fallback] = {}
        for key, ds in groups.items():
            for d in ds:
                res = self.check(d, dtype, dev, versions, seq_info.page_size)
                if not res.ok:
                    raise ValueError(f"{self.name}.setup: cannot serve {d.short()} {dtype} on {dev.short()} "
                                     f"(page_size={seq_info.page_size}): {res.reason}")
            configs[key] = resolve_fallback(ds, dtype, dev, versions, seq_info.page_size)
        st = _STATE
        keep = (st.cuda_graph, st.prefill)
        _STATE.__init__()  # drop wrappers/plans of a previous build
        st.cuda_graph, st.prefill = keep
        st.configs = configs
        st.device = device
        st.page_size = seq_info.page_size
        st.max_pages_per_seq = seq_info.max_pages_per_seq
        st.kernel = fa_kernel_for(dev) or "fa2"
        st.num_sm = device_sm_count(device)
        if configs:
            st.float_workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            # Build (JIT) and plan each config once now, so the first step does not pay for it.
            warm = MLACsr(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([SCRATCH_PAGE], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
            for key in configs:
                _plan(st, _wrapper_for(st, key, None), warm, key)
            st.plans = 0

    def prepare(self, seq_info) -> None:
        _STATE.step = plan_step(_STATE, seq_info)
