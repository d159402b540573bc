"""What both FlashInfer backends share: the lazy import, the metadata they take, plan keys, and the
set-up of their per-config fallback ops.

Nothing here imports FlashInfer at module load: the project runs (and its CPU tests run) without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..attention.registry import BackendSession, MLABackend, SessionSpec, StepDescriptor, StepMetadata
from ..attention.cache_format import cache_dtype_name
from ..attention.handoff import Fallback, fallback_sessions, resolve_fallback
from .metadata import StepCounts
from ..attention.mla_dims import MLADims

#: SequenceInfo fields both FlashInfer ops take: what FlashInfer needs (batch_info_host and the CSR
#: sources) plus everything the fallback ops take (torch reference and Triton), so a step can be
#: handed to either unchanged.
FI_METADATA: tuple[str, ...] = (
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
#: Default order in which a fallback op is looked for (first registered backend accepting the node).
DEFAULT_FALLBACK_ORDER: tuple[str, ...] = ("triton", "torch")


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


@dataclass(frozen=True)
class PlanKey:
    """What a FlashInfer MLA plan depends on (besides the batch): heads, latent/rope widths, the
    activations' dtype and the cache's."""

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype
    cache_dtype: torch.dtype

    @classmethod
    def of(cls, dims: MLADims, dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None) -> "PlanKey":
        return cls(dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, dtype,
                   dtype if cache_dtype is None else cache_dtype)

    def short(self) -> str:
        cache = "" if self.cache_dtype == self.dtype else f" cache {cache_dtype_name(self.cache_dtype)}"
        return (f"N={self.num_heads} R={self.kv_lora_rank} Dr={self.qk_rope_head_dim} "
                f"{cache_dtype_name(self.dtype)}{cache}")


def plan_configs(backend: MLABackend, spec: SessionSpec, fallback_order: Sequence[str]) -> dict[PlanKey, Fallback]:
    """Check every node of `spec` (ValueError naming the first refused one), group the nodes by plan
    key, and resolve each group's fallback op."""
    backend.check_all(spec)
    groups: dict[PlanKey, list[MLADims]] = {}
    for d, cache_dtype in zip(spec.dims, spec.node_cache_dtypes()):
        groups.setdefault(PlanKey.of(d, spec.dtype, cache_dtype), []).append(d)
    return {k: resolve_fallback(ds, spec.dtype, spec.target, fallback_order, backend.metadata, k.cache_dtype)
            for k, ds in groups.items()}


class FlashInferSession(BackendSession):
    """What both FlashInfer sessions hold: the policy, one fallback op per plan key, and the guards
    that an op call is for a config this session was set up with, in a step it prepared."""

    op: str = ""

    def __init__(self, spec: SessionSpec, policy: Any, configs: dict[PlanKey, Fallback]) -> None:
        super().__init__(spec)
        self.policy = policy
        self.configs = configs
        #: the fallback backend's own session (e.g. Triton's plans and FA3 prefill), and why none
        self.fallback_sessions, self.fallback_session_reason = fallback_sessions(configs, spec)

    def fallback_session(self, fb: Fallback) -> Optional[BackendSession]:
        return self.fallback_sessions.get(fb.name)

    def prepare_fallback_sessions(self, meta: StepMetadata, step: StepDescriptor) -> None:
        """Prepare the fallback backend's session for a step this session hands (in part) to it: once
        for all layers, as the runner prepares the sessions of the backends it calls itself. Without it
        Triton's op, given a session it cannot trust for this step, re-read the step's host metadata and
        re-made its launch plans in every layer."""
        for sess in self.fallback_sessions.values():
            sess.prepare(meta, step)

    def fallback_stats(self) -> dict[str, Any]:
        """The fallback session's own stats by backend name (e.g. Triton's FA3 prefill calls), or why none."""
        if not self.fallback_sessions:
            return {"fallback_session": self.fallback_session_reason}
        return {"fallback_session": {name: s.stats() for name, s in self.fallback_sessions.items()}}

    def require_config(self, key: PlanKey) -> Fallback:
        fb = self.configs.get(key)
        if fb is None:
            names = ", ".join(k.short() for k in self.configs) or "none"
            raise RuntimeError(
                f"{self.op}: this model's session was not set up for {key.short()} (it serves: {names}). The "
                "backend's setup(spec) must list every node the op runs on; setup validates each with check()."
            )
        return fb

    def unprepared(self, counts: StepCounts, last: Any) -> RuntimeError:
        return RuntimeError(
            f"{self.op}: the step's batch ({counts}) was not prepared (last prepared: {last}). Call the session's "
            "prepare(metadata, step) after SequenceInfo.prepare_step and before running the graph, every step "
            "(ModelRunner does this)."
        )
