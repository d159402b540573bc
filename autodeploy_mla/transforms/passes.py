"""The built-in passes. Importing this module registers them (registry.py); the pass manager does.

Each pass lives in its own module with its options and its declared stage:
export (EXPORT) -> match_mla (PATTERN) -> shard (SHARD) -> load_weights (WEIGHTS) -> fuse_gemms, fuse_moe, fuse_routing, real_rope (FUSE) ->
resolve_fp8_linear (KERNELS) -> insert_cached_mla_attention (CACHE) -> gather_logits (OUTPUT) -> piecewise (COMPILE).
"""

from . import export  # noqa: F401
from . import fuse_gemms  # noqa: F401
from . import fuse_moe  # noqa: F401
from . import fuse_routing  # noqa: F401
from . import gather_logits  # noqa: F401
from . import insert_cached_attention  # noqa: F401
from . import load_weights  # noqa: F401
from . import match_mla  # noqa: F401
from . import piecewise  # noqa: F401
from . import real_rope  # noqa: F401
from . import resolve_fp8_linear  # noqa: F401
from . import shard  # noqa: F401
