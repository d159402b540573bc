"""Block-FP8 weights (DeepSeek-V3's format: e4m3 weights, one fp32 scale per 128 x 128 block).

Importing this package registers the source op `fp8_block_linear`, its per-backend ops and the FP8
MoE experts ops under `torch.ops.autodeploy`.
"""

from . import linear  # noqa: F401  (the source op)
from . import linear_ops  # noqa: F401  (one op per backend)
from .act_quant import act_quant, act_quant_reference  # noqa: F401
from .backends import FP8_LINEAR_BACKENDS, FP8LinearNode, resolve_fp8_linear_backend  # noqa: F401
from .emulation import dequantize_blocks, w8a8_block_linear_emulated  # noqa: F401
