"""Launching ranks: `spawn` (torch.multiprocessing, one process per rank).

`spawn(fn, world_size, *args)` picks a free rendezvous port, sets the torchrun-style environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, and the NVLink-multicast-off variables),
initialises the process group in every rank (gloo on CPU, NCCL on CUDA with `cuda:rank`), seeds
every rank identically, runs `fn(rank, *args)` and returns rank 0's result. Any rank failing makes
`spawn` raise with that rank's traceback.

Under torchrun the environment is already there: `init_distributed()` (env.py) is all a process
needs; the CLI's in-rank set-up (cli/tp.py) calls it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from .env import (
    DistributedError,
    default_backend,
    disable_multicast_env,
    init_distributed,
    shutdown_distributed,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, fn: Callable[..., Any], args: tuple, world_size: int, port: int, backend: str,
            seed: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    disable_multicast_env()
    share_cpu_threads(world_size)
    result: Any = None
    error: Optional[str] = None
    try:
        init_distributed(backend)
        torch.manual_seed(seed)  # same RNG state on every rank: unseeded sampling agrees too
        result = fn(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the traceback
        error = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    # The result is written before the teardown, so a teardown that hangs cannot lose it.
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        try:
            pickle.dump((result, error), f)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            f.seek(0)
            f.truncate()
            error = error or f"rank {rank}: result not picklable: {exc}"
            pickle.dump((None, error), f)
    sys.stdout.flush()
    sys.stderr.flush()
    if error is not None:
        # No teardown (the other ranks may be waiting in a collective and would never join it); a
        # non-zero exit makes the parent stop them.
        os._exit(1)
    if not shutdown_distributed():
        os._exit(0)  # the teardown hung: leave without the interpreter's shutdown, which would wait on NCCL


def share_cpu_threads(ranks_on_host: int) -> int:
    """Give each of the host's ranks its share of the CPU cores for torch's intra-op threads (what
    torchrun does with OMP_NUM_THREADS). Otherwise every rank starts one thread per core, and the
    ranks' thread pools fight over the same cores during host-side step preparation. A user's
    OMP_NUM_THREADS wins. Returns the thread count set."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    n = max(1, (os.cpu_count() or 1) // max(1, ranks_on_host))
    torch.set_num_threads(n)
    return n


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    seed: int = 0,
    all_results: bool = False,
) -> Any:
    """Run `fn(rank, *args)` in `world_size` fresh processes with a process group; rank 0's result
    (or every rank's, in rank order, with `all_results`). `fn` must be importable (module level)."""
    if world_size < 1:
        raise DistributedError(f"world_size={world_size}: must be >= 1")
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise DistributedError(
            f"world_size={world_size} with NCCL needs {world_size} GPUs, this host has {torch.cuda.device_count()}"
        )
    disable_multicast_env()  # inherited by the children before CUDA/NCCL start there
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autodeploy_tp_") as out_dir:
        ctx = mp.spawn(
            _worker, args=(fn, args, world_size, free_port(), backend, seed, out_dir), nprocs=world_size,
            join=False,
        )
        abnormal = None
        try:
            while not ctx.join():
                pass
        except mp.ProcessExitedException as exc:
            abnormal = exc
        results, errors = [], []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.is_file():
                results.append(None)
                if abnormal is None:
                    errors.append(f"rank {r}: no result")
                continue
            res, err = pickle.loads(path.read_bytes())
            results.append(res)
            if err:
                errors.append(err)
        if abnormal is not None and not errors:
            errors.append(f"a rank exited abnormally: {abnormal}")
    if errors:
        raise RankFailed("\n".join(errors))
    return results if all_results else results[0]
