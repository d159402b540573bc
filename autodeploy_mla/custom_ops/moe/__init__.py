"""Fused MoE experts: `torch.ops.autodeploy.torch_moe_experts` (reference) and `triton_moe_experts`.

Imports without triton installed: the Triton op is then registered but raises a clear error, and
the `fuse_moe` pass keeps the model's own experts subgraph (saying why).
"""

from .ops import ACTIVATIONS, HAS_TRITON, TRITON_IMPORT_ERROR, check_moe_inputs, fused_moe  # noqa: F401
from .ops import torch_moe_experts, triton_moe_experts  # noqa: F401
from .tuning import MoEConfig, moe_config  # noqa: F401
from .backends import MOE_BACKENDS, resolve_moe_backend  # noqa: F401
from .fp8 import fused_moe_fp8, moe_experts_fp8_emulated, torch_moe_experts_fp8, triton_moe_experts_fp8  # noqa: F401
from .expert_parallel import EP_MOE_EXPERTS, ep_moe_experts  # noqa: F401
