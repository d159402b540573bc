"""`autodeploy::tp_all_reduce`: the tensor-parallel sum of a partial result over the ranks.

The `shard` pass inserts one per attention block and one per MLP/MoE block (`all_reduce: one_shot`).
Decode messages are small (tokens x hidden bf16: 256 KiB at batch 64 x 2048), where NCCL's ring
pays 2(W-1) latency-bound steps: 8.7 us per call on 2 H200s and 27.6 us on 4 (94 calls per GLM-4.7-Flash
step: 2.6 ms of an 11.9 ms step at 4 GPUs, docs/benchmarks/tp_scaling.md). The one-shot algorithm
instead has every rank copy its input into a buffer the peers can read (PyTorch symmetric memory,
NVLink peer access), wait for all of them, and sum all W buffers itself: one kernel, one barrier
in and one out (`torch.ops.symm_mem.one_shot_all_reduce_copy`). It reads W times the message, so
it is for small messages only; larger ones take the collective.

The symmetric buffer is per-model state: `SymmAllReduceWorkspace`, created by the model's runner
(a collective rendezvous, the same point on every rank) and found by the op through the step's
sessions (`step_context`), like an attention backend's session. Without one — CPU (gloo), a message
over its size, a failed set-up — the op runs the functional collective (`_c10d_functional.all_reduce`
+ `wait_tensor`, NCCL or gloo). The choice is made from static shapes when the op runs (eagerly or
while a CUDA graph is captured), never from device values: no host sync.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .attention.registry import BackendSession
from .attention.step_context import active_session

#: the session key the runner registers the workspace under
WORKSPACE = "tp_all_reduce"
#: message sizes the one-shot path takes by default (the workspace's size): decode batches of up to
#: ~128 tokens at hidden 2048 bf16; larger messages (prefill chunks) take the collective
DEFAULT_ONE_SHOT_MAX_BYTES = 512 * 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SymmAllReduceWorkspace(BackendSession):
    """One rank's symmetric buffer for one process group (`max_bytes`, rendezvoused with the peers).

    Creating it is collective: every rank of `group_name` must create its workspace at the same point."""

    backend = WORKSPACE

    def __init__(self, group_name: str, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if max_bytes <= 0 or max_bytes % 16:
            raise ValueError(f"one-shot all-reduce workspace of {max_bytes} bytes: expected a positive multiple of 16")
        self.spec = None  # no attention dims: this session serves the collectives
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        self.world_size = int(handle.world_size)
        self.calls = 0  # op calls that took the one-shot path (eager calls and graph captures, not replays)

    def accepts(self, x: torch.Tensor, group_name: str) -> bool:
        nbytes = x.numel() * x.element_size()
        return (group_name == self.group_name and x.is_cuda and x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0)

    def view_for(self, x: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes as a tensor like `x` (offset 0: the peers' copies line up)."""
        return self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def stats(self) -> dict[str, Any]:
        return {"algorithm": "one_shot (symmetric memory)", "max_bytes": self.max_bytes,
                "world_size": self.world_size, "one_shot_calls": self.calls}


#: The functional collectives (`all_reduce: nccl` graphs hold them; the op's fallback runs them): ATen-style
#: ops with fake kernels, gloo on CPU and NCCL on GPU, capturable in CUDA graphs, naming their group by string.
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


def collective_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The functional collective (NCCL on CUDA, gloo on CPU)."""
    return WAIT_TENSOR(ALL_REDUCE(x, "sum", group_name))


@torch.library.custom_op("autodeploy::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the ranks of `group_name` (a new tensor; `x` is not changed)."""
    ws: Optional[SymmAllReduceWorkspace] = active_session(WORKSPACE)  # type: ignore[assignment]
    x = x.contiguous()
    # The kernel reads x and the buffer with the same vector width: x must be as aligned (16 B) as the
    # buffer (a view into a larger tensor may not be); otherwise the collective serves this call.
    if ws is not None and ws.accepts(x, group_name) and x.data_ptr() % 16 == 0:
        ws.calls += 1
        return torch.ops.symm_mem.one_shot_all_reduce_copy(ws.view_for(x), x, "sum", group_name)
    return collective_all_reduce(x, group_name)


@tp_all_reduce.register_fake
def _tp_all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


TP_ALL_REDUCE = torch.ops.autodeploy.tp_all_reduce.default

__all__ = ["ALL_REDUCE", "WAIT_TENSOR", "TP_ALL_REDUCE", "WORKSPACE", "DEFAULT_ONE_SHOT_MAX_BYTES", "SymmAllReduceWorkspace", "tp_all_reduce",
           "collective_all_reduce"]
