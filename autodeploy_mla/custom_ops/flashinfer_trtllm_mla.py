"""`torch.ops.autodeploy.flashinfer_trtllm_mla_with_cache`: decode through FlashInfer's TRT-LLM-gen MLA kernel.

`flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla` (SM100/SM103) attends decode tokens over the
*combined* paged cache `[num_pages, page_size, R + Dr]` — the same tensor every backend uses — with a
dense block table whose width must be a multiple of 128 / page_size. The descriptor owns that block
table (rebuilt on the device once per step in `prepare()`, padded with the scratch page) and the
zero-initialised workspace the kernel needs.

Decode-only steps:  q = [q_nope · W_kn | q_pe]  ->  kernel (bmm1_scale = softmax scale)  ->  · W_vᵀ.
Prefill and mixed steps go, whole, to the fallback op: Triton if registered and accepting the node,
else the torch reference (both vectorised; no Python loop over sequences).

UNTESTED ON HARDWARE: this project had no SM100 GPU. The argument construction is tested on CPU
against a mock that enforces the kernel's documented shape rules (tests/test_flashinfer_backends.py).
The op is therefore not declared graph safe: `max_seq_len` is a host int baked into a capture.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .backend_registry import CheckResult, DeviceInfo, MLABackend, register_backend
from .cached_op_checks import cached_op_fake, check_cached_inputs
from .capabilities import check_against_facts
from .flashinfer_metadata import StepCounts, fill_trtllm_block_table, trtllm_block_table_width
from .flashinfer_mla import (
    METADATA,
    Fallback,
    FlashInferUnavailable,
    PlanKey,
    call_fallback,
    device_info,
    import_flashinfer_module,
    installed_versions,
    resolve_fallback,
)
from .mla_dims import MLADims, resolve_scale
from .torch_backend import append_to_paged_cache

OP = "flashinfer_trtllm_mla_with_cache"
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


@dataclass
class TrtllmMLAState:
    configs: dict[PlanKey, Fallback] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    page_size: int = 0
    workspace: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None  # [max_batch, W] int32, W % (128 / page_size) == 0
    counts: Optional[StepCounts] = None
    decode_fn: Any = None
    takes_backend: bool = False
    decode_steps: int = 0
    fallback_steps: int = 0


_STATE = TrtllmMLAState()


def state() -> TrtllmMLAState:
    return _STATE


def _check_step(st: TrtllmMLAState, key: PlanKey, batch_info_host: torch.Tensor) -> StepCounts:
    if key not in st.configs:
        served = ", ".join(k.short() for k in st.configs) or "none"
        raise RuntimeError(
            f"{OP}: {key.short()} was not set up (setup() was given: {served}); the backend's setup() must list "
            "every node it serves."
        )
    counts = StepCounts.of(batch_info_host)
    if st.counts != counts:
        raise RuntimeError(
            f"{OP}: the step's batch ({counts}) was not prepared (last: {st.counts}). Call the backend's "
            "prepare(seq_info) after SequenceInfo.prepare_step, every step."
        )
    return counts


@torch.library.custom_op("autodeploy::flashinfer_trtllm_mla_with_cache", mutates_args=("mla_cache",))
def flashinfer_trtllm_mla_with_cache(
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
    """Decode-only steps through trtllm-gen; any step with prefill tokens through the fallback op."""
    dims = check_cached_inputs(OP, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, mla_cache)
    key = PlanKey.of(dims, q_nope.dtype)
    st = _STATE
    counts = _check_step(st, key, batch_info_host)
    if not counts.decode_only:
        if counts.num_seqs > 0:
            meta = dict(zip(METADATA, (batch_info_host, max_seq_info_host, cu_seqlen_host, input_pos_host, cu_seqlen,
                                       input_pos, seq_len_with_cache, page_table, batch_idx, cache_loc)))
            return call_fallback(st.configs[key], (q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight), meta,
                                 mla_cache, scale)
        append_to_paged_cache(mla_cache, compressed_kv, kpe, cache_loc)
        return q_nope.new_zeros(1, q_nope.shape[1], dims.num_heads, dims.v_head_dim)

    append_to_paged_cache(mla_cache, compressed_kv, kpe, cache_loc)
    nh, dn, dv, r, dr = (dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank,
                         dims.qk_rope_head_dim)
    nb = counts.num_decode_seqs  # one token per sequence
    t_all = q_nope.shape[1]
    out = q_nope.new_empty(1, t_all, nh, dv)
    if nb < t_all:
        out[0, nb:].zero_()
    w = kv_b_proj_weight.view(nh, dn + dv, r)
    w_kn, w_v = w[:, :dn], w[:, dn:]
    query = q_nope.new_empty(nb, 1, nh, r + dr)
    query[:, 0, :, :r].copy_(torch.bmm(q_nope[0, :nb].transpose(0, 1), w_kn).transpose(0, 1))
    query[:, 0, :, r:].copy_(q_pe[0, :nb])
    latent = q_nope.new_empty(nb, 1, nh, r)
    kwargs: dict[str, Any] = {"backend": "trtllm-gen"} if st.takes_backend else {}
    st.decode_fn(
        query=query,
        kv_cache=mla_cache.unsqueeze(1),  # [pages, 1, page_size, R+Dr]: accepted by every 0.6/0.7 release
        workspace_buffer=st.workspace,
        qk_nope_head_dim=dn,
        kv_lora_rank=r,
        qk_rope_head_dim=dr,
        block_tables=st.block_table[:nb],
        seq_lens=seq_len_with_cache[:nb],
        max_seq_len=int(max_seq_info_host[1]),  # host tensor: no sync
        out=latent,
        bmm1_scale=resolve_scale(dims, scale),
        bmm2_scale=1.0,
        **kwargs,
    )
    torch.bmm(latent[:, 0].transpose(0, 1), w_v.transpose(1, 2), out=out[0, :nb].transpose(0, 1))
    return out


flashinfer_trtllm_mla_with_cache.register_fake(cached_op_fake(OP, METADATA))


@register_backend
class FlashInferTrtllmMLABackend(MLABackend):
    name = "flashinfer_trtllm_mla"
    cached_op = torch.ops.autodeploy.flashinfer_trtllm_mla_with_cache
    metadata = METADATA
    source = ("FlashInfer trtllm_batch_decode_with_kv_cache_mla (SM100/103, decode only; prefill via fallback op); "
              "UNTESTED on hardware; facts: custom_ops/capabilities.py")
    is_dynamic = True
    decode_graph_safe = False  # max_seq_len is a host int; not validated under capture on SM100

    def check(
        self,
        dims: MLADims,
        dtype: torch.dtype,
        device: DeviceInfo,
        versions: Mapping[str, Optional[str]],
        page_size: int,
    ) -> CheckResult:
        res = check_against_facts(self.name, "trtllm-gen", dims, dtype, device, versions, page_size)
        if res.ok:
            return CheckResult(True, res.reason + "; decode only (prefill/mixed steps use the fallback op)")
        return res

    def setup(self, dims: list[MLADims], dtype: torch.dtype, seq_info) -> None:
        device = torch.device(seq_info.device)
        dev, versions = device_info(device), installed_versions()
        groups: dict[PlanKey, list[MLADims]] = {}
        for d in dims:
            res = self.check(d, dtype, dev, versions, seq_info.page_size)
            if not res.ok:
                raise ValueError(f"{self.name}.setup: cannot serve {d.short()} {dtype} on {dev.short()} "
                                 f"(page_size={seq_info.page_size}): {res.reason}")
            groups.setdefault(PlanKey.of(d, dtype), []).append(d)
        configs = {k: resolve_fallback(ds, dtype, dev, versions, seq_info.page_size) for k, ds in groups.items()}
        _STATE.__init__()
        st = _STATE
        st.configs, st.device, st.page_size = configs, device, seq_info.page_size
        if configs:
            st.decode_fn, st.takes_backend = _decode_fn()
            st.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            width = trtllm_block_table_width(seq_info.max_pages_per_seq, seq_info.page_size)
            st.block_table = torch.zeros(seq_info.max_batch_size, width, dtype=torch.int32, device=device)

    def prepare(self, seq_info) -> None:
        st = _STATE
        counts = StepCounts.of(seq_info.get("batch_info_host"))
        if st.configs and counts.decode_only:
            # Device-side copy of the step's page table into the padded block table (no sync).
            fill_trtllm_block_table(st.block_table, seq_info.get("page_table"))
            st.decode_steps += 1
        elif st.configs and counts.num_seqs:
            st.fallback_steps += 1
        st.counts = counts
