"""The block-FP8 weight format, under the name the FP8 kernels import it by.

The definitions live in `models/fp8_format.py` (the checkpoint loader, one layer down, needs them
too); this module re-exports them so that kernels, backends and passes use one import path.
"""

from ...models.fp8_format import (  # noqa: F401
    FP8_DTYPE,
    FP8_MAX,
    MAX_BLOCK,
    MIN_BLOCK,
    QUANT_METHODS,
    TENSOR_SCALE_BLOCK,
    BlockFP8Format,
    FP8FormatError,
    check_scale,
    dequantize,
    expand_scale,
    fp8_weight_bytes,
    hashed_scale,
    quantize_weight,
    scale_shape,
)

__all__ = ["FP8_DTYPE", "FP8_MAX", "MAX_BLOCK", "MIN_BLOCK", "QUANT_METHODS", "TENSOR_SCALE_BLOCK", "BlockFP8Format",
           "FP8FormatError", "check_scale", "dequantize", "expand_scale", "fp8_weight_bytes", "hashed_scale",
           "quantize_weight", "scale_shape"]
