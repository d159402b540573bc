"""Block-scaled FP8 weights: the format (format.py) and the source ops (linear.py).

Importing this package registers `torch.ops.autodeploy.fp8_block_linear` and
`fp8_block_dequantize`. Backend ops and kernels of FP8 linears register from their own modules.
"""

from . import format, linear  # noqa: F401
from .format import BlockFP8Format, FP8FormatError, dequantize, quantize_weight, scale_shape  # noqa: F401
from .linear import FP8_DEQUANTIZE, FP8_LINEAR  # noqa: F401
