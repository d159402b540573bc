"""The paged latent cache's element format: the model dtype, or FP8 (e4m3) with per-layer scales.

One format serves every backend (docs/architecture.md, "FP8 latent cache"):

- A layer's cache stays one tensor `[num_pages, page_size, R + Dr]`; with FP8 its dtype is
  `torch.float8_e4m3fn` (1 byte per element: 576 bytes per token per layer for DeepSeek, half of bf16).
- Two scalars per layer, `CacheScales(latent, rope)`: the stored element is `x / scale`, rounded to
  e4m3 and saturated at ±448; the value read back is `stored * scale`. The latent and the rope key
  get separate scales because only the latent passes through an RMSNorm (kv_a_layernorm): the rope
  key's range follows kv_a_proj's raw output. FlashInfer's FP8 MLA run takes exactly these two
  (`ckv_scale`, `kpe_scale`).
- Quantisation happens in the append, once per token; readers dequantize on load. Scores are
  `s_latent * (q_abs · ckv) + s_rope * (q_pe · kpe)` and the attended latent is multiplied by
  `s_latent` before W_v, so no backend materialises a dequantized cache.

Why 1.0 is the default scale: e4m3 is a floating-point format, so a per-tensor scale moves the
window [2^-6, 448] of full (3-bit mantissa) relative precision but cannot add precision inside it.
RMS-normalised latents sit well inside that window at scale 1; a scale only helps a layer whose
values overflow 448 or sit mostly below 2^-6, which a checkpoint's calibration would say
(`runtime.kv_cache_scales`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3 magnitude: quantisation saturates here (torch's cast would make NaN on some paths).
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)

#: Names accepted by `runtime.kv_cache_dtype` (besides "auto" = the model's dtype).
CACHE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": FP8_DTYPE,
})


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def cache_dtype_name(dtype: torch.dtype) -> str:
    for name, d in CACHE_DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).replace("torch.", "")


def resolve_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`auto` -> the model dtype; otherwise the named dtype (ValueError listing the valid names)."""
    if name == "auto":
        return model_dtype
    try:
        return CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"kv cache dtype {name!r} is not one of: auto, {', '.join(CACHE_DTYPES)}") from None


@dataclass(frozen=True)
class CacheScales:
    """Dequantisation scales of one layer's FP8 cache (value = stored * scale); 1.0 for other dtypes."""

    latent: float = 1.0
    rope: float = 1.0

    def __post_init__(self) -> None:
        for name, v in (("latent", self.latent), ("rope", self.rope)):
            if not (v > 0.0 and v < float("inf")):
                raise ValueError(f"cache scale {name}={v!r}: must be a finite positive number")

    @property
    def identity(self) -> bool:
        return self.latent == 1.0 and self.rope == 1.0


UNIT_SCALES = CacheScales()


def quantize_rows(latent: torch.Tensor, rope: torch.Tensor, dtype: torch.dtype,
                  scales: CacheScales = UNIT_SCALES) -> torch.Tensor:
    """Cache rows `[..., R + Dr]` of `dtype` from the latent `[..., R]` and rope key `[..., Dr]`."""
    if not is_fp8(dtype):
        return torch.cat([latent, rope], dim=-1).to(dtype)
    lat = latent.float()
    rop = rope.float()
    # Multiply by the reciprocal in fp32, as the Triton append does, so both round identically.
    if scales.latent != 1.0:
        lat = lat * (1.0 / scales.latent)
    if scales.rope != 1.0:
        rop = rop * (1.0 / scales.rope)
    rows = torch.cat([lat, rop], dim=-1).clamp_(-FP8_MAX, FP8_MAX)
    return rows.to(dtype)


def dequantize_rows(rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype,
                    scales: CacheScales = UNIT_SCALES) -> torch.Tensor:
    """Cache rows `[..., R + Dr]` as `dtype` values (scales applied for FP8 rows)."""
    out = rows.to(dtype)
    if is_fp8(rows.dtype) and not scales.identity:
        out[..., :kv_lora_rank] *= scales.latent
        out[..., kv_lora_rank:] *= scales.rope
    return out
