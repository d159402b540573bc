"""Custom ops: the torch_mla source op and one cached op per attention backend.

Importing this package registers every op under `torch.ops.autodeploy` and every backend
descriptor in the registry. Optional backends (Triton, FlashInfer) import without their library.
"""

from . import torch_mla  # noqa: F401
from .mla_dims import MLADims, MLAShapeError  # noqa: F401
from . import torch_backend  # noqa: F401,E402
from .backend_registry import (  # noqa: F401,E402
    CheckResult,
    DeviceInfo,
    MLABackend,
    all_backends,
    cached_ops,
    get_backend,
    library_versions,
    register_backend,
)
try:  # the Triton backend imports without triton (its check() then refuses every node)
    from . import triton_mla  # noqa: F401,E402
except ImportError:  # pragma: no cover
    pass
try:  # FlashInfer backends: FlashInfer itself is imported lazily, so this never needs it
    from . import flashinfer_mla, flashinfer_trtllm_mla  # noqa: F401,E402
except ImportError:  # pragma: no cover
    pass
