"""Block-scaled FP8 weights (DeepSeek-V3's format: e4m3 weights, one fp32 scale per 128 x 128 block).

Importing this package registers the source ops `fp8_block_linear` / `fp8_block_dequantize`
(linear.py), one `fp8_block_linear_<backend>` op per backend (linear_ops.py) and the FP8 MoE experts
ops (custom_ops/moe/fp8.py) under `torch.ops.autodeploy`. The format itself is models/fp8_format.py
(re-exported by format.py): models may not import custom_ops.
"""

from . import format, linear  # noqa: F401  (the source ops)
from . import linear_ops  # noqa: F401  (one op per backend)
from .act_quant import act_quant, act_quant_reference  # noqa: F401
from .backends import FP8_LINEAR_BACKENDS, FP8LinearNode, resolve_fp8_linear_backend  # noqa: F401
from .emulation import dequantize_blocks, w8a8_block_linear_emulated  # noqa: F401
from .format import BlockFP8Format, FP8FormatError, dequantize, quantize_weight, scale_shape  # noqa: F401
from .linear import FP8_DEQUANTIZE, FP8_LINEAR  # noqa: F401
