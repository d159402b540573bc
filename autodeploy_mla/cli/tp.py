"""Tensor parallelism from the command line: spawning ranks and setting one up.

`autodeploy build --world-size N` spawns N ranks that each run the build command (gloo on CPU, NCCL
on GPU); under torchrun every process already is a rank. In a rank, `rank_setup` starts the process
group (and tears it down if this process started it), seeds the RNG identically, and returns the
overrides that turn the shard pass on and put the rank on its own GPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from ..distributed.env import DistributedError, default_backend, env_info, init_distributed, shutdown_distributed
from ..distributed.launch import RankFailed, spawn


def device_type(args: argparse.Namespace) -> str:
    dev = getattr(args, "device", None)
    if dev:
        return torch.device(dev).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rank_main(rank: int, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    return command(args)


def launch(args: argparse.Namespace, command: Callable[[argparse.Namespace], int]) -> Optional[int]:
    """`--world-size N` outside a rank: run `command(args)` in N spawned ranks; rank 0's exit code.
    None when nothing has to be spawned (world size 1, or already inside a rank / torchrun)."""
    want = args.world_size
    info = env_info()
    if want == 1 or info.world_size > 1:
        if info.world_size > 1 and want not in (1, info.world_size):
            raise DistributedError(
                f"--world-size {want} but this process is one of {info.world_size} ranks already (torchrun?)"
            )
        return None
    try:
        return int(spawn(_rank_main, want, command, args, backend=default_backend(device_type(args)), seed=args.seed))
    except RankFailed as exc:
        raise DistributedError(str(exc)) from None


@contextmanager
def rank_setup(args: argparse.Namespace) -> Iterator[list[str]]:
    """In a rank (spawned or torchrun): the process group, and the overrides the build needs; outside
    one: nothing. Tears the group down afterwards when this process started it (torchrun)."""
    info = env_info()
    if info.world_size == 1:
        yield []
        return
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    info = init_distributed(device_type=device_type(args))
    torch.manual_seed(args.seed)  # torchrun ranks: same RNG state everywhere
    sets = ["transforms.shard.enabled=true", f"transforms.shard.world_size={info.world_size}"]
    if device_type(args) == "cuda":
        sets.append(f"model.device=cuda:{info.local_rank}")
    try:
        yield sets
    finally:
        if owns_group:
            shutdown_distributed()
