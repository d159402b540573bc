"""The build configuration schema (DESIGN §10).

Top-level sections are fixed and unknown keys are errors. `transforms` is a map of pass name ->
options; the pass manager validates each pass's options with that pass's own pydantic model and
puts the passes in their declared order (transforms/pass_manager.py), so this schema stays
independent of which passes exist.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The device strings a model can be built for; whether that device is present is checked before
#: the build (models/factory.resolve_device), not here, so a CUDA config still loads on a CPU host.
DEVICE_FORMS = "auto | cpu | cuda | cuda:N"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def is_device_form(name: str) -> bool:
    """Whether `name` is one of DEVICE_FORMS (whether this machine has it is another question)."""
    return bool(_DEVICE.match(name))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Where the model comes from: a checkpoint directory, or an HF config dict (random weights)."""

    path: Optional[str] = Field(None, description="HF checkpoint directory (config.json + *.safetensors)")
    hf_config: Optional[dict[str, Any]] = Field(None, description="HF config dict; weights are seeded random")
    seed: int = 0
    init: Literal["transformers", "hashed"] = Field(
        "transformers",
        description="random weights (hf_config): transformers' own init from `seed`, or `hashed` (every "
        "element a function of seed, name and index: tensor-parallel ranks make only their slices)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    trust_remote_code: bool = False

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        """Only the forms the build knows how to place a model on; torch.device() would accept
        'xla' or 'mps' here and fail minutes later, or name 'tpu' in a traceback."""
        if not is_device_form(v):
            raise ValueError(f"{v!r} is not a device this build supports; expected {DEVICE_FORMS} "
                             "(N: a CUDA device index, 0 for the first GPU)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path is not None and self.hf_config is not None:
            raise ValueError("model: set either `path` (checkpoint) or `hf_config` (random weights), not both")
        if self.init == "hashed" and self.path is not None:
            raise ValueError(f"model.init=hashed makes random weights, but model.path={self.path!r} is a checkpoint "
                             "with its own; drop model.init or use model.hf_config")
        return self


KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"]


class CacheScalesConfig(_Strict):
    """Dequantisation scales of one FP8 cache layer (stored = value / scale, saturated at ±448)."""

    latent: float = Field(1.0, gt=0, description="scale of the latent part (R elements per token)")
    rope: float = Field(1.0, gt=0, description="scale of the rope-key part (Dr elements per token)")


class RuntimeConfig(_Strict):
    """Fixed capacities of the cached runtime; CUDA graphs and metadata buffers are sized from these."""

    max_batch_size: int = Field(8, ge=1)
    max_seq_len: int = Field(512, ge=2)
    max_num_tokens: int = Field(256, ge=1, description="tokens per step; longer prompts prefill in chunks")
    page_size: int = Field(64, ge=1)
    num_pages: Optional[int] = Field(None, ge=2, description="cache pages per layer (incl. scratch page 0)")
    free_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="on CUDA without num_pages: fraction of free memory for caches"
    )
    overlap: bool = Field(
        True, description="schedule and launch step i+1 before waiting for step i's sampled tokens"
    )
    prefix_caching: bool = Field(
        True, description="automatic prefix caching: requests take cached full prompt pages of earlier ones "
        "(docs/prefix_caching.md)"
    )
    kv_cache_dtype: KVCacheDtype = Field(
        "auto", description="paged latent cache dtype: auto (the model dtype) or fp8_e4m3 (half the bytes)"
    )
    kv_cache_layers: dict[str, KVCacheDtype] = Field(
        default_factory=dict, description="per-layer override of kv_cache_dtype: layer-name glob or layer index -> dtype"
    )
    kv_cache_scales: dict[str, CacheScalesConfig] = Field(
        default_factory=dict,
        description="FP8 cache scales per layer: layer-name glob or layer index -> {latent, rope} (default 1.0)",
    )


#: FlashInfer MLAPlan's fixed work-item capacity (custom_ops/flashinfer/capabilities.FA_MAX_WORK_ITEMS)
_FA_MAX_WORK_ITEMS = 16384
#: steps a session's route trace keeps (custom_ops/attention/router.DEFAULT_TRACE_STEPS)
_TRACE_STEPS = 64


class FlashInferMLAAttention(_Strict):
    """`attention.flashinfer_mla`: how the FlashInfer MLA backend routes its steps (FlashInferPolicy)."""

    prefill: Literal["auto", "flashinfer", "fallback"] = Field(
        "auto", description="steps with prefill tokens: auto (by estimated cost), flashinfer, or fallback (handoff)")
    fast_prefill_fallbacks: list[str] = Field(["triton"], description="handoff backends auto may send prefills to")
    fallback_order: list[str] = Field(["triton", "torch"], description="handoff backend: first registered that "
                                                                        "accepts the node")
    strided_io: bool = True
    cuda_graph: bool = Field(False, description="every decode-only step on a fixed-buffer wrapper")
    max_work_items: int = Field(_FA_MAX_WORK_ITEMS, ge=1, le=_FA_MAX_WORK_ITEMS)
    decode_fallback_max_seqs: int = Field(1, ge=0, description="decode steps of at most this many sequences go to "
                                                               "the handoff backend (0: never)")
    fast_decode_fallbacks: list[str] = Field(["triton"], description="handoff backends small decodes may go to")
    trace_steps: int = Field(_TRACE_STEPS, ge=0, description="steps the route trace keeps")


class TritonAttention(_Strict):
    """`attention.triton`: the Triton backend's knobs (TritonPolicy)."""

    prefill_mode: Literal["auto", "expand", "absorb"] = "auto"
    decode_splits: int = Field(0, ge=0, description="0: split-K by the tuning rules; k: force k chunks")
    poison_buffers: bool = False
    fp8_dot: bool = False
    decode_layout: Literal["auto", "heads_on_m", "heads_on_n"] = "auto"
    prefill_attention: Literal["auto", "triton", "flashinfer"] = "auto"
    decode_kernel: Literal["auto", "triton", "gluon"] = "auto"
    trace_steps: int = Field(_TRACE_STEPS, ge=0, description="steps the route trace keeps")


class FlashInferSparseAttention(_Strict):
    """`attention.flashinfer_mla_sparse`: the FlashInfer sparse backend's knobs (SparsePolicy)."""

    prefill: Literal["flashinfer", "fallback"] = "flashinfer"
    fallback_order: list[str] = ["triton", "torch"]
    cuda_graph: bool = False
    max_work_items: int = Field(_FA_MAX_WORK_ITEMS, ge=1, le=_FA_MAX_WORK_ITEMS)


class TrtllmAttention(_Strict):
    """`attention.flashinfer_trtllm_mla`: the TRT-LLM-gen backend's knobs (TrtllmPolicy)."""

    fallback_order: list[str] = ["triton", "torch"]


class AttentionConfig(_Strict):
    """Per-backend attention policies: what the router and each backend decide per step. Only the keys
    a config sets reach the backend (the rest keep the backend's own defaults); `optimize(...,
    backend_policies=)` overrides a backend's whole policy from Python."""

    flashinfer_mla: FlashInferMLAAttention = FlashInferMLAAttention()
    triton: TritonAttention = TritonAttention()
    flashinfer_mla_sparse: FlashInferSparseAttention = FlashInferSparseAttention()
    flashinfer_trtllm_mla: TrtllmAttention = TrtllmAttention()

    def set_fields(self) -> dict[str, dict[str, Any]]:
        """backend -> the keys this config set explicitly (backends with none left out)."""
        out = {}
        for name in type(self).model_fields:
            section = getattr(self, name)
            fields = section.model_dump(exclude_unset=True)
            if fields:
                out[name] = fields
        return out


class AppConfig(_Strict):
    model: ModelConfig = ModelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    transforms: dict[str, Optional[dict[str, Any]]] = Field(default_factory=dict)
    #: per-backend attention policies (the router's and each backend's knobs)
    attention: AttentionConfig = AttentionConfig()
