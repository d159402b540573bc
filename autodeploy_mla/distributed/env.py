"""Process-group setup: read the launch environment (torchrun or our spawn launcher), initialise
torch.distributed once per process, and answer "which rank am I, how many are we".

Backends: gloo on CPU, NCCL on CUDA (one GPU per rank, `cuda:LOCAL_RANK`). Before NCCL starts, the
NVLink-multicast paths are switched off (NVLS in NCCL, multicast in torch symmetric memory and in
NVSHMEM): on the lent H200 hosts they are not usable, and a collective that tries them hangs or
fails at the first all-reduce instead of at setup.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

#: Set (forced) in every rank's environment before the process group starts.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class DistributedError(RuntimeError):
    """The distributed setup is inconsistent; the message says what was found and what to do."""


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None  # None: no process group

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def disable_multicast_env(env: Optional[dict] = None) -> None:
    """Force the multicast-off variables into `env` (default: this process's environment)."""
    target = os.environ if env is None else env
    target.update(MULTICAST_OFF_ENV)


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None


def env_info() -> DistInfo:
    """Rank/world size of this process: from the initialised process group, else from the
    torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK), else a single process."""
    if dist.is_available() and dist.is_initialized():
        local = _env_int("LOCAL_RANK")
        rank = dist.get_rank()
        return DistInfo(rank, dist.get_world_size(), rank if local is None else local, dist.get_backend())
    world = _env_int("WORLD_SIZE") or 1
    rank = _env_int("RANK") or 0
    local = _env_int("LOCAL_RANK")
    return DistInfo(rank, world, rank if local is None else local, None)


def default_backend(device_type: Optional[str] = None) -> str:
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(backend: Optional[str] = None, device_type: Optional[str] = None) -> DistInfo:
    """Initialise the default process group from the environment if it says world_size > 1.

    Idempotent. On CUDA the rank's GPU (`cuda:LOCAL_RANK`) becomes the current device, so a config
    that says `device: cuda` (or auto) lands on the rank's own GPU.
    """
    info = env_info()
    if info.backend is not None or info.world_size == 1:
        return info
    if not dist.is_available():
        raise DistributedError("torch.distributed is not available in this torch build; run with world_size 1")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={info.world_size} but {', '.join(missing)} is not set: launch with torchrun "
            "or `autodeploy build --world-size N`, which set the rendezvous address."
        )
    backend = backend or default_backend(device_type)
    if backend == "nccl":
        disable_multicast_env()
        n = torch.cuda.device_count()
        if info.local_rank >= n:
            raise DistributedError(
                f"rank {info.rank} wants cuda:{info.local_rank} but this host has {n} GPU(s); "
                f"use at most {n} ranks per host"
            )
        torch.cuda.set_device(info.local_rank)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", info.local_rank)
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, **kwargs)
    return env_info()


def shutdown_distributed(timeout_s: float = 60.0) -> bool:
    """Destroy the process group, first freeing every captured CUDA graph (a live graph holding an
    NCCL collective makes the teardown block forever: pytorch/pytorch#115388). The teardown runs in a
    daemon thread; if it has not finished after `timeout_s` it is abandoned with a warning and False
    is returned, so a finished run still exits (the caller should then leave with `os._exit`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    from ..runtime.cuda_graphs import release_cuda_graphs

    release_cuda_graphs()
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, name="destroy_process_group", daemon=True).start()
    if done.wait(timeout_s):
        return True
    warnings.warn(f"torch.distributed teardown did not finish within {timeout_s:.0f}s; abandoning it "
                  "(the results are complete; the process exits without a clean NCCL shutdown)", stacklevel=2)
    return False


def resolve_world(world_size: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    """(world_size, rank) of a tensor-parallel build: explicit options win, else the process group /
    environment. Raised here once, before any build work, so no pass reads the environment."""
    info = env_info()
    w = info.world_size if world_size is None else int(world_size)
    r = info.rank if rank is None else int(rank)
    if w < 1:
        raise DistributedError(f"world_size={w}: must be >= 1")
    if not 0 <= r < w:
        raise DistributedError(f"rank {r} is outside world_size {w}")
    return w, r


def require_group(world_size: int, rank: int) -> str:
    """The default process group's name, after checking it matches (world_size, rank)."""
    info = env_info()
    if info.backend is None or info.world_size != world_size:
        raise DistributedError(
            f"world_size={world_size} needs an initialised torch.distributed process group of {world_size} "
            f"ranks (found {'none' if info.backend is None else info.world_size}). Launch with "
            f"`autodeploy build --world-size {world_size}` or torchrun --nproc-per-node {world_size}."
        )
    if info.rank != rank:
        raise DistributedError(f"rank={rank} in the config but this process is rank {info.rank}")
    return world_group_name()


def is_rank0() -> bool:
    return env_info().is_rank0


def world_group_name() -> str:
    """Name of the default process group, as functional collectives take it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError("torch.distributed is not initialised")
    return dist.group.WORLD.group_name
