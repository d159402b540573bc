"""Custom ops: the torch_mla source op and one cached op per attention backend.

Importing this package registers every op under `torch.ops.autodeploy` and every backend
descriptor in the registry. Optional backends (Triton, FlashInfer) import without their library:
their `check()` then refuses every node and says why.
"""

from .attention import torch_mla  # noqa: F401
from .attention import sparse_mla  # noqa: F401
from .attention.mla_dims import MLADims, MLAShapeError  # noqa: F401
from .attention.registry import (  # noqa: F401,E402
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
from .attention.step_context import active_session, using_sessions  # noqa: F401,E402
from . import torch_backend  # noqa: F401,E402
from . import triton_mla  # noqa: F401,E402
from .flashinfer import mla, sparse, trtllm_mla  # noqa: F401,E402
from . import moe  # noqa: F401,E402
from . import fp8  # noqa: F401,E402
from . import tp_all_reduce  # noqa: F401,E402
