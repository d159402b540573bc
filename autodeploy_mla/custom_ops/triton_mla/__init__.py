"""The Triton MLA backend ("triton"): `torch.ops.autodeploy.triton_mla_with_cache` + `TritonMLABackend`.

Modules by job: `policy` (TritonPolicy), `session` (per-model state), `step_shape` (one step's host
facts), `call` (what one op call runs with), `launchers` (launch planners and launchers), `op` (the
cached op), `backend` (the descriptor and its checks), `tuning` (measured rules and configs),
`kernels` / `gluon_*` (the kernels), `sparse` (the DSA ops).

Imports without triton installed: the op is then registered but raises a clear error, and the
descriptor's check() refuses every node with "triton not installed".
"""

from .backend import TritonMLABackend  # noqa: F401
from .launchers import HAS_TRITON  # noqa: F401
from .op import triton_mla_with_cache  # noqa: F401
from .policy import TritonPolicy  # noqa: F401
from .session import TritonMLASession  # noqa: F401
from .tuning import choose_prefill_path  # noqa: F401
