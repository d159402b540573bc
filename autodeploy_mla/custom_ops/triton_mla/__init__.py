"""The Triton MLA backend ("triton"): `torch.ops.autodeploy.triton_mla_with_cache` + `TritonMLABackend`.

Imports without triton installed: the op is then registered but raises a clear error, and the
descriptor's check() refuses every node with "triton not installed".
"""

from .op import HAS_TRITON, TritonMLABackend, TritonMLASession, TritonPolicy, triton_mla_with_cache  # noqa: F401
from .tuning import choose_prefill_path  # noqa: F401
