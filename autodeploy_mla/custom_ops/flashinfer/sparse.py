"""Sparse MLA (DeepSeek Sparse Attention) through FlashInfer: backend `flashinfer_mla_sparse`.

FlashInfer 0.7.2's own sparse-MLA entry points (`trtllm_batch_decode_with_kv_cache_mla` with
`sparse_mla_top_k`, `dsa_sparse_attention`, `dsa_indexer_topk`) run on SM100/103/107 and SM12x only
(capabilities.SPARSE_NOTES). On Hopper this backend serves sparse layers with what the version does
run there:

- **selection**: the Triton backend's indexer op (`triton_dsa_indexer_with_cache`: our score kernel +
  `torch.topk`), which returns positions within the sequence, valid entries first and -1 after.
  FlashInfer's radix `top_k_page_table_transform` would fit (per-row lengths, a CUDA-graph safe
  mode), but its JIT build did not finish in 9 minutes on the H200, twice (2026-11-24), so it is not
  used;
- **attention**: `BatchMLAPagedAttentionWrapper` (fa3 on SM90) over the latent cache viewed with
  pages of one token. Each query token is its own request whose "pages" are the cache slots of its
  selected positions (page_table[seq, p // P] * P + p % P), packed back to back, so the dense
  absorbed-MLA kernel computes exactly sparse MLA; its length is min(top-k, position + 1), the number
  of valid entries.

Planning happens once per step on the host in `prepare` (the lengths come from the host mirrors of
the positions), never per layer or under capture, and is skipped when a wrapper's lengths equal its
last plan's: every decode step once all its sequences are past top-k positions. The op writes the slots into the planned
wrapper's kv_indices buffer on the device, so decode steps replay as whole-step CUDA graphs:
graph-marked decode steps use one fixed-buffer wrapper per batch size, re-planned before each replay.
Steps the plan cannot hold (over FlashInfer's work-item capacity) or that the policy routes away run
on the fallback sparse op (Triton, else the torch reference) with the same inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

import numpy as np
import torch

from ..attention.registry import (
    BackendSession,
    CheckResult,
    MLABackend,
    SessionSpec,
    StepDescriptor,
    StepMetadata,
    Target,
    get_backend,
    register_backend,
    sparse_backends,
    sparse_ops_of,
)
from ..attention.cache_format import CacheScales, is_fp8
from .capabilities import FA_MAX_WORK_ITEMS, check_against_facts, fa_kernel_for
from .common import FlashInferUnavailable, PlanKey, import_flashinfer_module
from .metadata import StepCounts, fa_plan_work_bound, fa_plan_work_count
from .mla import FLOAT_WORKSPACE_BYTES, absorbed_attention
from ..attention.mla_dims import MLADims, MLAShapeError
from ..attention.contract import MLAInputs, append_to_paged_cache, check_cached_inputs, define_cached_op_and_kernel
from ..attention.sparse_mla import INDEXER_METADATA
from ..attention.step_context import require_session

BACKEND = "flashinfer_mla_sparse"
OP = "flashinfer_mla_sparse_with_cache"
SPARSE_METADATA = (*INDEXER_METADATA, "topk_indices")
#: the backend whose indexer op selects this backend's positions (resolved through the registry)
INDEXER_FROM = "triton"


@dataclass(frozen=True)
class SparseKey:
    """What one plan depends on: the dense plan key (heads, R, Dr, dtypes) and the top-k width."""

    plan: PlanKey
    topk: int

    def short(self) -> str:
        return f"{self.plan.short()} top-k {self.topk}"


@dataclass(frozen=True)
class SparsePolicy:
    """Per-model knobs. prefill: steps with prefill tokens on FlashInfer ("flashinfer") or on the
    fallback op ("fallback"); cuda_graph: every decode-only step uses a fixed-buffer wrapper;
    max_work_items: steps over it go to the fallback op (FlashInfer's plan capacity)."""

    prefill: Literal["flashinfer", "fallback"] = "flashinfer"
    fallback_order: tuple[str, ...] = ("triton", "torch")
    cuda_graph: bool = False
    max_work_items: int = FA_MAX_WORK_ITEMS

    def __post_init__(self) -> None:
        if self.prefill not in ("flashinfer", "fallback"):
            raise ValueError(f"SparsePolicy.prefill={self.prefill!r}; valid: 'flashinfer', 'fallback'.")
        valid = sparse_backends()  # the registered backends with sparse ops of their own
        unknown = [b for b in self.fallback_order if b not in valid]
        if unknown or not self.fallback_order:
            raise ValueError(f"SparsePolicy.fallback_order={self.fallback_order!r}: each entry must be one of "
                             f"{', '.join(valid)}.")
        if not 1 <= self.max_work_items <= FA_MAX_WORK_ITEMS:
            raise ValueError(f"SparsePolicy.max_work_items={self.max_work_items}: must be in [1, {FA_MAX_WORK_ITEMS}].")


@dataclass
class PlannedKey:
    wrapper: Any
    slots: torch.Tensor  # the wrapper's kv_indices buffer (+1 junk element): the op packs the step's slots here


@dataclass
class SparseStepPlan:
    counts: StepCounts
    planned: dict[SparseKey, PlannedKey] = field(default_factory=dict)
    fallback: dict[SparseKey, str] = field(default_factory=dict)  # key -> why this step uses the fallback op


def token_positions(cu_seqlen_host: torch.Tensor, input_pos_host: torch.Tensor, num_seqs: int) -> np.ndarray:
    """Absolute position of every packed token of the step (host mirrors only; int64)."""
    cu = cu_seqlen_host[: num_seqs + 1].numpy().astype(np.int64)
    start = input_pos_host[:num_seqs].numpy().astype(np.int64)
    lens = cu[1:] - cu[:-1]
    return np.repeat(start - cu[:-1], lens) + np.arange(int(cu[-1] - cu[0]), dtype=np.int64) + cu[0]


def sparse_csr(tok_pos: np.ndarray, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qo_indptr, kv_indptr, kv_len) for one request per token: one query row each, reading the
    min(topk, position + 1) valid entries of its selection, packed back to back (FlashInfer checks
    that each request's page count, here its key count, is exactly its kv_indptr span)."""
    n = tok_pos.shape[0]
    qo = np.arange(n + 1, dtype=np.int32)
    kv_len = np.minimum(tok_pos + 1, topk).astype(np.int32)
    kv_indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(kv_len, out=kv_indptr[1:])
    return torch.from_numpy(qo), torch.from_numpy(kv_indptr), torch.from_numpy(kv_len)


def pack_selected_slots(topk_indices: torch.Tensor, tok_seq: torch.Tensor, tok_pos: torch.Tensor,
                        page_table: torch.Tensor, page_size: int, out: torch.Tensor) -> None:
    """Write the cache slots of every token's valid selected positions into `out` back to back (the
    layout of `sparse_csr`): token t's min(K, position + 1) valid entries, which every indexer op puts
    first, at out[start_t:], start_t the running sum of those counts. The -1 tail goes to out[-1], a
    junk element no request reads. On the device, from device metadata only: capture safe, no sync.
    A slot is page_table[seq, p // P] * P + p % P: with pages of one token it is the page id."""
    n, k = topk_indices.shape
    idx = topk_indices.long()
    cols = torch.arange(k, device=idx.device)
    kv_len = torch.clamp(tok_pos.long() + 1, max=k)
    start = torch.cumsum(kv_len, 0) - kv_len
    keep = cols[None, :] < kv_len[:, None]
    dest = torch.where(keep, start[:, None] + cols[None, :], torch.full_like(idx, out.shape[0] - 1))
    p = idx.clamp(min=0)
    slots = page_table[tok_seq.long()[:, None], p // page_size].long() * page_size + p % page_size
    out.scatter_(0, dest.view(-1), slots.view(-1).to(out.dtype))


def _wrapper_cls() -> Any:
    cls = getattr(import_flashinfer_module("flashinfer.mla"), "BatchMLAPagedAttentionWrapper", None)
    if cls is None:
        raise FlashInferUnavailable("flashinfer.mla has no BatchMLAPagedAttentionWrapper; upgrade flashinfer-python.")
    return cls


class FlashInferSparseSession(BackendSession):
    """One model's sparse FlashInfer state: wrappers per (config, batch size), slot buffers, plans."""

    backend = BACKEND

    def __init__(self, spec: SessionSpec, policy: SparsePolicy, configs: dict[SparseKey, str]) -> None:
        super().__init__(spec)
        self.policy = policy
        self.configs = configs  # key -> fallback backend name
        #: key -> the fallback backend's sparse attention op (same signature), found in the registry
        self.fallback_ops = {k: sparse_ops_of(name).attention for k, name in configs.items()}
        self.device = spec.device
        self.kernel = fa_kernel_for(spec.target.device) or "fa2"
        self.num_sm = spec.target.device.num_sms
        self.float_workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        # Eager wrappers keep a reference to the kv_indices they were planned with: this buffer.
        # (+1: the junk element pack_selected_slots sends the -1 entries to)
        self.slots = {k: torch.zeros(max(1, spec.max_num_tokens) * k + 1, **i32) for k in {c.topk for c in configs}}
        self.eager: dict[SparseKey, Any] = {}
        self.graph: dict[tuple[SparseKey, int], PlannedKey] = {}
        self.step: Optional[SparseStepPlan] = None
        self.plan_events: dict[int, Any] = {}
        self.last_plan: dict[int, tuple[bytes, bytes, int]] = {}  # id(wrapper) -> what it was last planned for
        self.plans = 0
        self.plans_reused = 0  # steps whose plan equalled the wrapper's last one (not re-planned)
        self.fallback_steps = 0
        for key in configs:  # build (JIT) and plan each config once now
            one = np.zeros(1, dtype=np.int64)
            self._plan(self._eager(key), sparse_csr(one, key.topk), self.slots[key.topk], key)
        self.plans = 0

    def _eager(self, key: SparseKey) -> Any:
        w = self.eager.get(key)
        if w is None:
            w = self.eager[key] = _wrapper_cls()(self.float_workspace, backend=self.kernel)
        return w

    def _graph(self, key: SparseKey, bs: int) -> PlannedKey:
        g = self.graph.get((key, bs))
        if g is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            slots = torch.zeros(bs * key.topk + 1, **i32)
            w = _wrapper_cls()(self.float_workspace, use_cuda_graph=True, qo_indptr=torch.zeros(bs + 1, **i32),
                               kv_indptr=torch.zeros(bs + 1, **i32), kv_indices=slots,
                               kv_len_arr=torch.zeros(bs, **i32), backend=self.kernel)
            g = self.graph[(key, bs)] = PlannedKey(w, slots)
        return g

    def _plan(self, wrapper: Any, csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slots: torch.Tensor,
              key: SparseKey) -> None:
        qo, kv_indptr, kv_len = csr
        # Once every token sees at least top-k positions (any long-context decode step) the lengths,
        # and so FlashInfer's schedule, repeat from step to step; only the slots change, and the op
        # rewrites those in the buffer the plan points at. Re-planning would cost ~1 ms on the host.
        same = (qo.numpy().tobytes(), kv_len.numpy().tobytes(), slots.data_ptr())
        if self.last_plan.get(id(wrapper)) == same:
            self.plans_reused += 1
            return
        done = self.plan_events.get(id(wrapper))
        if done is not None:  # the previous plan's host-to-device copy must have run (see flashinfer_mla)
            done.synchronize()
        slots = slots[: int(kv_indptr[-1])]  # the entries the requests read (a view of the fixed buffer)
        # One query per request: causal masking is moot, and the plan skips FlashInfer's tile checks.
        wrapper.plan(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=slots, kv_len_arr=kv_len,
                     num_heads=key.plan.num_heads, head_dim_ckv=key.plan.kv_lora_rank,
                     head_dim_kpe=key.plan.qk_rope_head_dim, page_size=1, causal=False, sm_scale=1.0,
                     q_data_type=key.plan.dtype, kv_data_type=key.plan.cache_dtype)
        if self.device.type == "cuda":
            ev = self.plan_events.get(id(wrapper)) or torch.cuda.Event()
            ev.record()
            self.plan_events[id(wrapper)] = ev
        self.last_plan[id(wrapper)] = same
        self.plans += 1

    def prepare(self, meta: StepMetadata, step: StepDescriptor) -> None:
        counts = StepCounts.of(meta.get("batch_info_host"))
        plan = self.step = SparseStepPlan(counts)
        n = counts.num_tokens
        if counts.num_seqs == 0 or n == 0 or not self.configs:
            return
        if not counts.decode_only and self.policy.prefill == "fallback":
            plan.fallback = {k: f"step with prefill tokens routed to {fb} (prefill=fallback)"
                             for k, fb in self.configs.items()}
        else:
            tok_pos = token_positions(meta.get("cu_seqlen_host"), meta.get("input_pos_host"), counts.num_seqs)
            graph_bs = n if counts.decode_only and (step.cuda_graph or self.policy.cuda_graph) else None
            ones = torch.ones(n, dtype=torch.int64)
            for key in self.configs:
                csr = sparse_csr(tok_pos, key.topk)
                works = fa_plan_work_bound(ones, key.plan.num_heads, self.num_sm)
                if works > self.policy.max_work_items:
                    works = fa_plan_work_count(ones, csr[2], key.plan.num_heads, self.num_sm, causal=False)
                if works > self.policy.max_work_items:
                    plan.fallback[key] = f"plan needs {works} work items, over the capacity of {self.policy.max_work_items}"
                    continue
                if graph_bs is None:
                    pk = PlannedKey(self._eager(key), self.slots[key.topk])
                else:
                    pk = self._graph(key, graph_bs)
                self._plan(pk.wrapper, csr, pk.slots, key)
                plan.planned[key] = pk
        if plan.fallback:
            self.fallback_steps += 1

    def step_for(self, key: SparseKey, batch_info_host: torch.Tensor) -> SparseStepPlan:
        if key not in self.configs:
            names = ", ".join(k.short() for k in self.configs) or "none"
            raise RuntimeError(f"{OP}: this model's session was not set up for {key.short()} (it serves: {names}).")
        counts = StepCounts.of(batch_info_host)
        plan = self.step
        if plan is None or plan.counts != counts:
            raise RuntimeError(
                f"{OP}: the step's batch ({counts}) was not prepared (last prepared: "
                f"{None if plan is None else plan.counts}). Call the session's prepare(metadata, step) every step "
                "before running the graph (ModelRunner does this).")
        return plan

    def stats(self) -> dict[str, Any]:
        return {"plans": self.plans, "plans_reused": self.plans_reused, "fallback_steps": self.fallback_steps,
                "configs": {k.short(): fb for k, fb in self.configs.items()},
                "graph_wrappers": sorted(bs for _, bs in self.graph)}


# ------------------------------------------------------------------ the ops
def _flashinfer_mla_sparse(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                           scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Append the step's latents, then attend to each token's selected positions through FlashInfer."""
    dims = check_cached_inputs(OP, x, mla_cache)
    if is_fp8(mla_cache.dtype):
        raise MLAShapeError(f"{OP}: FP8 caches are not supported for sparse MLA yet")
    topk = meta["topk_indices"]
    key = SparseKey(PlanKey.of(dims, x.q_nope.dtype, mla_cache.dtype), int(topk.shape[-1]))
    sess: FlashInferSparseSession = require_session(OP, BACKEND)  # type: ignore[assignment]
    plan = sess.step_for(key, meta["batch_info_host"])
    if key in plan.fallback:
        fb = sess.fallback_ops[key]
        return fb(*x, *(meta[m] for m in SPARSE_METADATA), mla_cache, scale, scales.latent, scales.rope)
    append_to_paged_cache(mla_cache, x, meta["cache_loc"], scales)
    t_all, n = x.q_nope.shape[1], plan.counts.num_tokens
    out = x.q_nope.new_empty(1, t_all, dims.num_heads, dims.v_head_dim)
    if n < t_all:
        out[0, n:].zero_()
    if n == 0:
        return out
    pk = plan.planned[key]
    tok_seq = meta["batch_idx"][:n].long()
    tok_pos = meta["input_pos"][tok_seq].long() + torch.arange(n, device=tok_seq.device) - meta["cu_seqlen"][tok_seq].long()
    pack_selected_slots(topk[0, :n], tok_seq, tok_pos, meta["page_table"], mla_cache.shape[1], pk.slots)
    flat = mla_cache.view(-1, 1, mla_cache.shape[-1])  # pages of one token: the slots are the page ids

    def run(q_abs, q_pe, ckv, kpe, latent_out):
        pk.wrapper.run(q_abs, q_pe, ckv, kpe, out=latent_out)

    absorbed_attention(run, x, n, flat, dims, scale, out[0, :n])
    return out


flashinfer_mla_sparse_with_cache, _direct = define_cached_op_and_kernel(OP, SPARSE_METADATA, _flashinfer_mla_sparse)


# ------------------------------------------------------------------ descriptor
@register_backend
class FlashInferSparseMLABackend(MLABackend):
    name = BACKEND
    policy_type = SparsePolicy
    cached_op = flashinfer_mla_sparse_with_cache
    direct_call = staticmethod(_direct)
    metadata = INDEXER_METADATA
    source = ("FlashInfer BatchMLAPagedAttentionWrapper over one-token pages (FlashInfer 0.7.x); selection: the "
              "Triton indexer op; facts: custom_ops/flashinfer/capabilities.py")
    sparse_only = True
    sparse_indexer_from = INDEXER_FROM
    decode_graph_safe = True  # graph-marked decode steps plan fixed-buffer wrappers; the op writes their slots

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        # The wrapper reads the cache with pages of one token whatever the cache's page size.
        res = check_against_facts(BACKEND, fa_kernel_for(target.device), dims, dtype, replace(target, page_size=1))
        if not res.ok:
            return res
        tri = get_backend(self.sparse_indexer_from).check(dims, dtype, target)
        if not tri.ok:
            return CheckResult(False, f"the selection runs on the Triton indexer op, which refuses: {tri.reason}")
        return CheckResult(True, f"{res.reason}; one-token pages, selection by the Triton indexer op")

    def setup(self, spec: SessionSpec, policy: Optional[SparsePolicy] = None) -> FlashInferSparseSession:
        policy = policy or SparsePolicy()
        self.check_all(spec)
        configs: dict[SparseKey, str] = {}
        for d, cache_dtype, k in zip(spec.dims, spec.node_cache_dtypes(), spec.node_index_topk()):
            if k <= 0:
                continue  # a layer's index-key cache, or a node without a selection
            key = SparseKey(PlanKey.of(d, spec.dtype, cache_dtype), k)
            if key in configs:
                continue
            fb = [b for b in policy.fallback_order
                  if get_backend(b).check(d, spec.dtype, spec.target).ok]
            if not fb:
                raise ValueError(f"{BACKEND}.setup: no fallback sparse op accepts {d.short()} (tried "
                                 f"{', '.join(policy.fallback_order)})")
            configs[key] = fb[0]
        return FlashInferSparseSession(spec, policy, configs)
