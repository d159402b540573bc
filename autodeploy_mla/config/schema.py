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


class AppConfig(_Strict):
    model: ModelConfig = ModelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    transforms: dict[str, Optional[dict[str, Any]]] = Field(default_factory=dict)
