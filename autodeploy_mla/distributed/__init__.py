"""Process plumbing for tensor parallelism: process groups and launching ranks.

Used only by the API and the CLI (a layer test enforces it): the graph transformation is the
`shard` pass (transforms/shard.py), weight loading by slices is models/ + the `load_weights` pass,
and the runtime's sampling broadcast is in runtime/model_runner.py. See docs/tensor_parallel.md.
"""

from .env import (  # noqa: F401
    MULTICAST_OFF_ENV,
    DistInfo,
    DistributedError,
    disable_multicast_env,
    env_info,
    init_distributed,
    is_rank0,
    require_group,
    resolve_world,
    shutdown_distributed,
)
from .launch import RankFailed, share_cpu_threads, spawn  # noqa: F401
