"""`torch.ops.autodeploy.flashinfer_trtllm_mla_with_cache`: decode through FlashInfer's TRT-LLM-gen MLA kernel.

`flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla` (SM100/SM103) attends decode tokens over the
*combined* paged cache `[num_pages, page_size, R + Dr]` — the same tensor every backend uses — with a
dense block table whose width must be a multiple of 128 / page_size. The model's session owns that
block table (rebuilt on the device once per step in `prepare()`, padded with the scratch page) and
the zero-initialised workspace the kernel needs.

Decode-only steps:  q = [q_nope · W_kn | q_pe]  ->  kernel (bmm1_scale = softmax scale)  ->  · W_vᵀ.
FP8 cache (capabilities.CACHE_FACTS): the kernel needs an e4m3 query too, so q = [q_abs | q_pe ·
s_rope / s_latent] is quantised with a per-step scale from its device-side amax (no host sync), and
bmm1_scale = q_scale · s_latent · softmax scale, bmm2_scale = s_latent go as fp32 device tensors.
Prefill and mixed steps go, whole, to the fallback op: Triton if registered and accepting the node,
else the torch reference (both vectorised; no Python loop over sequences).

UNTESTED ON HARDWARE: this project had no SM100 GPU. The argument construction is tested on CPU
against a mock that enforces the kernel's documented shape rules (tests/test_flashinfer_backends.py).
The op is therefore not declared graph safe: `max_seq_len` is a host int baked into a capture.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..attention.registry import (
    CheckResult,
    MLABackend,
    SessionSpec,
    StepDescriptor,
    StepMetadata,
    Target,
    register_backend,
)
from ..attention.cache_format import FP8_DTYPE, FP8_MAX, CacheScales, is_fp8
from .capabilities import check_against_facts, check_cache_against_facts
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
from .metadata import StepCounts, fill_trtllm_block_table, trtllm_block_table_width
from ..attention.mla_dims import MLADims, resolve_scale
from ..attention.router import NodePaths, Path
from ..attention.contract import MLAInputs, append_to_paged_cache, check_cached_inputs, define_cached_op_and_kernel
from ..attention.step_context import require_session

OP = "flashinfer_trtllm_mla_with_cache"
METADATA = FI_METADATA
WORKSPACE_BYTES = 128 * 1024 * 1024  # as SGLang's TRT-LLM MLA backend; zero-initialised once


def _decode_fn() -> tuple[Any, bool]:
    """(trtllm_batch_decode_with_kv_cache_mla, whether it takes backend=)."""
    fn = None
    for mod in ("flashinfer.decode", "flashinfer.mla"):
        try:
            fn = getattr(import_flashinfer_module(mod), "trtllm_batch_decode_with_kv_cache_mla", None)
        except FlashInferUnavailable:
            fn = None
        if fn is not None:
            break
    if fn is None:
        raise FlashInferUnavailable(
            "flashinfer has no trtllm_batch_decode_with_kv_cache_mla (flashinfer.decode / flashinfer.mla); "
            "install flashinfer-python >= 0.6.18."
        )
    try:
        takes_backend = "backend" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_backend = False
    return fn, takes_backend


@dataclass(frozen=True)
class TrtllmPolicy:
    """Per-model knobs: the order in which the fallback op for prefill/mixed steps is looked for."""

    fallback_order: tuple[str, ...] = DEFAULT_FALLBACK_ORDER


class TrtllmMLASession(FlashInferSession):
    """One model's TRT-LLM-gen MLA state: configs, workspace, block table, counters."""

    backend = "flashinfer_trtllm_mla"
    op = OP

    def __init__(self, spec: SessionSpec, policy: TrtllmPolicy, configs: dict[PlanKey, Fallback]) -> None:
        super().__init__(spec, policy, configs)
        self.workspace: Optional[torch.Tensor] = None
        self.block_table: Optional[torch.Tensor] = None  # [max_batch, W] int32, W % (128 / page_size) == 0
        self.counts: Optional[StepCounts] = None
        self.decode_fn: Any = None
        self.takes_backend = False
        self.decode_steps = 0
        self.fallback_steps = 0
        if configs:
            self.decode_fn, self.takes_backend = _decode_fn()
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
            width = trtllm_block_table_width(spec.max_pages_per_seq, spec.page_size)
            self.block_table = torch.zeros(spec.max_batch_size, width, dtype=torch.int32, device=spec.device)

    def prepare(self, meta: StepMetadata, step: StepDescriptor) -> None:
        counts = StepCounts.of(meta.get("batch_info_host"))
        if self.configs and counts.decode_only:
            # Device-side copy of the step's page table into the padded block table (no sync).
            fill_trtllm_block_table(self.block_table, meta.get("page_table"))
            self.decode_steps += 1
        elif self.configs and counts.num_seqs:
            self.fallback_steps += 1
            self.prepare_fallback_sessions(meta, step)
        self.counts = counts

    def check_step(self, key: PlanKey, batch_info_host: torch.Tensor) -> StepCounts:
        self.require_config(key)
        counts = StepCounts.of(batch_info_host)
        if self.counts != counts:
            raise self.unprepared(counts, self.counts)
        return counts

    def paths(self, dims: MLADims) -> NodePaths:
        """Decode on TRT-LLM-gen; every step with prefill tokens on the handoff backend (decode only)."""
        handoff = next((fb.name for k, fb in self.configs.items() if k.num_heads == dims.num_heads), "the handoff")
        return NodePaths(Path(self.backend, "trtllm_batch_decode_with_kv_cache_mla (decode only)"),
                         Path(handoff, "TRT-LLM-gen MLA decodes only: every step with prefill tokens is handed off"))

    def stats(self) -> dict[str, Any]:
        return {"decode_steps": self.decode_steps, "fallback_steps": self.fallback_steps,
                "configs": {k.short(): fb.name for k, fb in self.configs.items()}, **self.fallback_stats()}


def fp8_query(query: torch.Tensor, r: int, scales: CacheScales, sm_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 query, bmm1_scale, bmm2_scale) for a kernel that reads query and cache in e4m3 with one KV
    scale: the rope part is rescaled by s_rope / s_latent, the query's scale comes from its amax on
    the device (1-element fp32 tensors: no host sync)."""
    q = query.float()
    if scales.rope != scales.latent:
        q = torch.cat([q[..., :r], q[..., r:] * (scales.rope / scales.latent)], dim=-1)
    q_scale = (q.abs().amax() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    q8 = (q / q_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    bmm2 = torch.full((1,), scales.latent, dtype=torch.float32, device=query.device)
    return q8, q_scale * (scales.latent * sm_scale), bmm2


def _trtllm_mla_with_cache(x: MLAInputs, meta: Mapping[str, torch.Tensor], mla_cache: torch.Tensor,
                           scale: Optional[float], scales: CacheScales) -> torch.Tensor:
    """Decode-only steps through trtllm-gen; any step with prefill tokens through the fallback op."""
    dims = check_cached_inputs(OP, x, mla_cache)
    key = PlanKey.of(dims, x.q_nope.dtype, mla_cache.dtype)
    sess: TrtllmMLASession = require_session(OP, "flashinfer_trtllm_mla")  # type: ignore[assignment]
    counts = sess.check_step(key, meta["batch_info_host"])
    if not counts.decode_only:
        if counts.num_seqs > 0:
            fb = sess.configs[key]
            return call_fallback(fb, x, meta, mla_cache, scale, scales, sess.fallback_session(fb))
        append_to_paged_cache(mla_cache, x, meta["cache_loc"], scales)
        return x.q_nope.new_zeros(1, x.q_nope.shape[1], dims.num_heads, dims.v_head_dim)

    append_to_paged_cache(mla_cache, x, meta["cache_loc"], scales)
    nh, dn, dv, r, dr = (dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank,
                         dims.qk_rope_head_dim)
    nb = counts.num_decode_seqs  # one token per sequence
    q_nope, q_pe = x.q_nope, x.q_pe
    t_all = q_nope.shape[1]
    out = q_nope.new_empty(1, t_all, nh, dv)
    if nb < t_all:
        out[0, nb:].zero_()
    w_kn, w_v = dims.split_kv_b(x.kv_b_proj_weight)
    query = q_nope.new_empty(nb, 1, nh, r + dr)
    query[:, 0, :, :r].copy_(torch.bmm(q_nope[0, :nb].transpose(0, 1), w_kn).transpose(0, 1))
    query[:, 0, :, r:].copy_(q_pe[0, :nb])
    latent = q_nope.new_empty(nb, 1, nh, r)
    kwargs: dict[str, Any] = {"backend": "trtllm-gen"} if sess.takes_backend else {}
    bmm1: Any = resolve_scale(dims, scale)
    bmm2: Any = 1.0
    if is_fp8(mla_cache.dtype):
        query, bmm1, bmm2 = fp8_query(query, r, scales, bmm1)
    sess.decode_fn(
        query=query,
        kv_cache=mla_cache.unsqueeze(1),  # [pages, 1, page_size, R+Dr]: accepted by every 0.6/0.7 release
        workspace_buffer=sess.workspace,
        qk_nope_head_dim=dn,
        kv_lora_rank=r,
        qk_rope_head_dim=dr,
        block_tables=sess.block_table[:nb],
        seq_lens=meta["seq_len_with_cache"][:nb],
        max_seq_len=int(meta["max_seq_info_host"][1]),  # host tensor: no sync
        out=latent,
        bmm1_scale=bmm1,
        bmm2_scale=bmm2,
        **kwargs,
    )
    torch.bmm(latent[:, 0].transpose(0, 1), w_v.transpose(1, 2), out=out[0, :nb].transpose(0, 1))
    return out


flashinfer_trtllm_mla_with_cache, _direct = define_cached_op_and_kernel(OP, METADATA, _trtllm_mla_with_cache)


@register_backend
class FlashInferTrtllmMLABackend(MLABackend):
    name = "flashinfer_trtllm_mla"
    policy_type = TrtllmPolicy
    cached_op = flashinfer_trtllm_mla_with_cache
    direct_call = staticmethod(_direct)
    metadata = METADATA
    source = ("FlashInfer trtllm_batch_decode_with_kv_cache_mla (SM100/103, decode only; prefill via fallback op); "
              "UNTESTED on hardware; facts: custom_ops/flashinfer/capabilities.py")
    is_dynamic = True
    decode_graph_safe = False  # max_seq_len is a host int; not validated under capture on SM100

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        res = check_against_facts(self.name, "trtllm-gen", dims, dtype, target)
        if res.ok:
            return CheckResult(True, res.reason + "; decode only (prefill/mixed steps use the fallback op)")
        return res

    def check_cache(self, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
        return check_cache_against_facts(self.name, "trtllm-gen", dims, dtype, cache_dtype, target)

    def setup(self, spec: SessionSpec, policy: Optional[TrtllmPolicy] = None) -> TrtllmMLASession:
        policy = policy or TrtllmPolicy()
        return TrtllmMLASession(spec, policy, plan_configs(self, spec, policy.fallback_order))
