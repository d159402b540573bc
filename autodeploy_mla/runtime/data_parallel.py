"""Data-parallel attention at run time (`transforms.shard.attention: data`, docs/parallel_layouts.md).

Every rank runs its own sequences, with its own paged cache and page allocator, but every forward
step of the graph calls the expert-parallel all-to-all (`ep_moe_experts`, tokens local): a rank
that skipped a step would leave the others waiting in a collective. So the ranks step in lock-step:

- `Lockstep.agree`: once per engine step, before launching it, every rank says whether it has a
  batch to run, whether it has any work left (waiting, running, or a step in flight) and how many
  tokens its step runs as (its CUDA-graph bucket, else its token count); one all-reduce (max). Every
  rank then runs its step padded to the largest of those sizes (`StepAgreement.tokens`), so the
  experts' dispatch has the same row count on every rank, sized by the busiest rank's step (the op
  runs with `capacity=0`), not by `max_num_tokens`. It is a host synchronisation by design, at the
  scheduler, outside every op and graph (the ops stay capturable). The flags are CPU tensors on a
  gloo group of their own (`new_host_group`, made once by the runner), not on the NCCL group of the
  graph: an all-reduce there would put the flags on the GPU, and reading them back would wait for
  the step in flight, undoing the engine's host/GPU overlap.
- a rank with no batch while another rank has one runs an idle step (`ModelRunner.idle_step`): one
  token at position 0 of a sequence that owns one reserved cache page (`IDLE_SEQ_ID`), padded to the
  agreed size, logits dropped. It goes through the same graph, so it calls every collective the
  others call. A 0-token step would be cheaper but the exported graph's token dim starts at 1 and
  the attention metadata assumes >= 1 sequence; one token of padding costs one row in the experts'
  padded dispatch.
- generation ends when no rank has work: every rank sees the same agreement, so all leave their
  loop at the same step.
- an error on one rank ends the run on every rank at the same step, not in a hang: the failing rank
  joins the next agreement with "I failed" set (`Lockstep.leave`), every rank then exchanges the error
  text (`Lockstep.failures`, one all_gather_object, only on this path) and the others raise
  `PeerRankFailed` naming the rank and its error. Each rank cancels its unfinished requests (pages
  back) and the ranks have made the same collectives, so the model can run again. Not covered: an
  error inside a forward step after the agreement (between the ranks' collectives in the graph): the
  others wait in the graph's collective until the process group's timeout.

`partition_by_tokens` gives each rank its share of a request list, balanced by tokens
(prompt + max_new_tokens), the same on every rank (deterministic, no communication);
`gather_in_order` puts the ranks' results back in the original order (all_gather_object: host
objects, fine for `generate`; one engine front feeding every rank — the server — is the next step).

Nothing here runs when attention is tensor-parallel (or with one process): the engine's `lockstep`
is None and `generate` does not partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

#: the sequence id of the idle step's one-token sequence: it holds one page for the model's lifetime
#: (prefill_logits uses -1, the warm-up -2 downwards from there)
IDLE_SEQ_ID = -1_000_000

T = TypeVar("T")


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks agreed before a step: some rank has a batch to run / has work left / failed."""

    any_batch: bool
    any_work: bool
    any_failed: bool = False
    #: the step size every rank pads its step to: the largest of the ranks' sizes (0: no rank runs one)
    tokens: int = 0
    #: some rank means to go on (a serving core that is not shutting down); False: every rank is leaving
    any_staying: bool = True


class PeerRankFailed(RuntimeError):
    """Another data-parallel rank failed; this rank stopped its run at the same step (module doc)."""

    def __init__(self, rank: int, errors: dict[int, str]) -> None:
        self.rank, self.errors = rank, dict(errors)
        what = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())) or "no error text was sent"
        super().__init__(f"data-parallel rank(s) {sorted(errors)} failed ({what}); rank {rank} stopped its run at "
                         "the same step and cancelled its unfinished requests. The ranks are still in step: "
                         "the model can run again once the cause is fixed.")


def new_host_group() -> "dist.ProcessGroup":
    """A gloo group over all ranks for the per-step agreement (host tensors, no device involved).
    Collective: every rank calls it at the same point (the runner's construction)."""
    return dist.new_group(backend="gloo")


class Lockstep:
    """The per-step agreement of the data-parallel ranks (module doc). Owned by one engine;
    `group`: a gloo group (`new_host_group`; None: the default group, which must then be gloo)."""

    def __init__(self, world_size: int, group: Optional["dist.ProcessGroup"] = None) -> None:
        if world_size < 2:
            raise ValueError(f"Lockstep: world_size={world_size}; lock-step needs >= 2 data-parallel ranks")
        self.world_size = world_size
        self.group = group
        self.syncs = 0  # agreements made (one host all-reduce each)

    def agree(self, has_batch: bool, has_work: bool, failed: bool = False, tokens: int = 0,
              staying: bool = True) -> StepAgreement:
        """`tokens`: the size this rank's step runs as (0: no batch). `staying`: False once this rank
        wants to stop (a serving core shutting down): the ranks leave together when none stays and
        none has work."""
        flags = torch.tensor([int(has_batch), int(has_work), int(failed), int(tokens), int(staying)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)  # blocking, on the host
        any_batch, any_work, any_failed, most, any_staying = flags.tolist()
        self.syncs += 1
        return StepAgreement(bool(any_batch), bool(any_work), bool(any_failed), int(most), bool(any_staying))

    def failures(self, mine: Optional[str]) -> dict[int, str]:
        """After an agreement that says some rank failed, on every rank: each rank's error text
        (None: this rank did not fail), gathered; rank -> text of the ranks that failed."""
        got: list[Any] = [None] * self.world_size
        dist.all_gather_object(got, mine, group=self.group)
        return {r: str(e) for r, e in enumerate(got) if e is not None}

    def leave(self, error: str) -> dict[int, str]:
        """This rank failed: its last agreement (failed) and the exchange of error texts, matching the
        agreement the other ranks make at their next step (module doc)."""
        self.agree(False, False, failed=True)
        return self.failures(error)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else dist.get_rank()


def partition_by_tokens(costs: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of `costs` (tokens per request: prompt + max_new_tokens) per rank, balanced by tokens:
    longest first, each to the rank with the fewest tokens so far (ties: the lower rank). Each rank's
    indices in ascending order. Deterministic, so every rank computes the same partition."""
    if world_size < 1:
        raise ValueError(f"partition_by_tokens: world_size={world_size}, must be >= 1")
    load = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda j: (-int(costs[j]), j)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += int(costs[i])
    return [sorted(s) for s in shares]


def gather_in_order(mine: Sequence[T], shares: Sequence[Sequence[int]], total: int) -> list[T]:
    """Every rank's results (rank r's `mine[j]` is request `shares[r][j]`) in the original order, on
    every rank: one all_gather_object over the default group (host objects; must be picklable)."""
    world = len(shares)
    got: list[Any] = [None] * world
    dist.all_gather_object(got, list(mine))
    out: list[Any] = [None] * total
    for r in range(world):
        if len(got[r]) != len(shares[r]):
            raise RuntimeError(f"gather_in_order: rank {r} returned {len(got[r])} results for its "
                               f"{len(shares[r])} requests")
        for i, res in zip(shares[r], got[r]):
            out[i] = res
    return out


__all__ = ["IDLE_SEQ_ID", "Lockstep", "PeerRankFailed", "StepAgreement", "gather_in_order", "new_host_group",
           "partition_by_tokens"]
