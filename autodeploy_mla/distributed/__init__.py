"""Tensor parallelism support: process groups, launching, collectives, sharded weight loading.

The graph transformation itself is the `shard` pass (transforms/shard.py); see
docs/tensor_parallel.md for the design and how to launch.
"""

from .env import (  # noqa: F401
    MULTICAST_OFF_ENV,
    DistInfo,
    DistributedError,
    disable_multicast_env,
    env_info,
    init_distributed,
    is_rank0,
    shutdown_distributed,
)
from .launch import RankFailed, spawn  # noqa: F401
