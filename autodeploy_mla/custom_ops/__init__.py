"""Custom ops: the torch_mla source op and one cached op per attention backend.

Importing this package registers every op under `torch.ops.autodeploy` and every backend
descriptor in the registry. Optional backends (Triton, FlashInfer) import without their library:
their `check()` then refuses every node and says why.
"""

from . import torch_mla  # noqa: F401
from . import sparse_mla  # noqa: F401
from .mla_dims import MLADims, MLAShapeError  # noqa: F401
from .backend_registry import (  # noqa: F401,E402
    BackendDecision,
    BackendSession,
    CheckResult,
    DeviceInfo,
    MLABackend,
    SessionSpec,
    StepDescriptor,
    Target,
    all_backends,
    cached_ops,
    get_backend,
    library_versions,
    register_backend,
)
from .step_context import active_session, using_sessions  # noqa: F401,E402
from . import torch_backend  # noqa: F401,E402
from . import triton_mla  # noqa: F401,E402
from . import flashinfer_mla, flashinfer_trtllm_mla, flashinfer_sparse  # noqa: F401,E402
from . import moe  # noqa: F401,E402
from . import tp_all_reduce  # noqa: F401,E402
