"""FlashInfer's FA3 ragged prefill as the attention kernel of the Triton backend's expanded prefill.

The expanded prefill attends over K/V expanded by kv_b_proj: an ordinary causal attention with
q, k of Dn + Dr and v of Dv per head. On SM90 FlashInfer's ragged prefill (`backend="fa3"`, the
Hopper FlashAttention-3 kernels, warp-specialised with TMA) runs that attention ~1.8x faster than
our `expanded_prefill_kernel` from 2048 tokens on (H200: N 16, qk 192 / vo 128, T 2048: 59.6 µs vs
~88 µs of kernel; docs/benchmarks/fi_ragged_prefill.md). FA3 has no shared k_pe, so the op writes K
per head ([k_nope | k_pe]) and q as one [T, N, Dn + Dr] tensor (`pack_heads_kernel`, one launch
each), and passes V as a strided view of the expansion GEMM's output (the kernels take row and head
strides). With that packing the whole op beats our kernel from 1024 new tokens (N 16: 0.92x at 1024,
0.87x at 2048; GLM 0.92x, 0.84x), so "auto" takes FA3 from tuning.FA3_PREFILL_MIN_TOKENS = 1024.

`Fa3Prefill` is per-model state (the Triton session owns one): a FlashInfer workspace and wrapper,
and the background compile of its module (`flashinfer.jit`: ~96 s of nvcc on a fresh H200 host,
started when the session is made unless `optimize()` started it earlier): until that compile has
finished, `ready` is False and the op attends with `expanded_prefill_kernel`, so no step and no
start-up waits for nvcc. The wrapper is planned once per step (the plan depends on the step's sequence lengths only, so every layer of a
step reuses it). Planning stages FlashInfer's schedule in a pinned host buffer copied to the device
asynchronously; a re-plan first waits for the previous plan's copy (an event), as the FlashInfer MLA
backend does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .jit import FA3_HEAD_DIMS, JitBuild, fa3_prefill_module
from ..attention.mla_dims import MLADims
from ..attention.prefill_kernels import register_prefill_kernel

#: FlashInfer's float workspace for the prefill plan (split-KV partials of long sequences)
FA3_WORKSPACE_BYTES = 128 << 20


def fa3_unavailable(dims: MLADims, dtype: torch.dtype, device: torch.device) -> str:
    """Why FlashInfer's FA3 prefill cannot run these dims here ('' when it can)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FA3 prefill takes bf16/fp16 activations (got {dtype})"
    dqk, dv = dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.v_head_dim
    if (dqk, dv) not in FA3_HEAD_DIMS:
        return f"FA3 prefill has no kernel for head dims qk {dqk} / vo {dv} (built: {sorted(FA3_HEAD_DIMS)})"
    if device.type != "cuda":
        return f"FA3 prefill needs a CUDA device (got {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FA3 prefill kernels are SM90 (Hopper) only (this GPU is SM{major}{minor})"
    try:
        import flashinfer.prefill  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not here
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return ""


class Fa3Prefill:
    """One model's FlashInfer FA3 ragged-prefill wrapper (see the module docstring)."""

    def __init__(self, device: torch.device, head_dims: frozenset[tuple[int, int]] = frozenset(),
                 workspace_bytes: int = FA3_WORKSPACE_BYTES) -> None:
        import flashinfer.prefill

        self.device = device
        dtype = torch.bfloat16  # the module's dtype does not change its build time; bf16 is what runs
        self.builds: list[JitBuild] = [fa3_prefill_module(qk, vo, dtype).start() for qk, vo in sorted(head_dims)]
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        self._key: Optional[tuple[Any, ...]] = None
        self._planned: Optional[torch.cuda.Event] = None
        self.plans = 0
        self.calls = 0

    def _plan(self, key: tuple[Any, ...], qo_indptr: tuple[int, ...], kv_indptr: tuple[int, ...], heads: int,
              dqk: int, dv: int, sm_scale: float, dtype: torch.dtype) -> None:
        if self._planned is not None:
            self._planned.synchronize()  # the previous plan's staged copy has executed (normally long ago)
        pin = self.device.type == "cuda"
        qo = torch.tensor(qo_indptr, dtype=torch.int32)
        kv = torch.tensor(kv_indptr, dtype=torch.int32)
        if pin:
            qo, kv = qo.pin_memory(), kv.pin_memory()
        self.wrapper.plan(qo, kv, heads, heads, dqk, head_dim_vo=dv, causal=True, sm_scale=sm_scale,
                          q_data_type=dtype, kv_data_type=dtype)
        self._planned = torch.cuda.Event()
        self._planned.record()
        self._key = key
        self.plans += 1

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, qo_indptr: tuple[int, ...],
            kv_indptr: tuple[int, ...], sm_scale: float) -> None:
        """out[T, N, Dv] = causal attention of q [T, N, Dqk] over k [S, N, Dqk], v [S, N, Dv] (row and
        head strides free, last dims contiguous), sequences by the host indptrs (query i of a sequence
        sees its first kv_len - q_len + i + 1 keys)."""
        heads, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
        key = (qo_indptr, kv_indptr, heads, dqk, dv, sm_scale, q.dtype)
        if key != self._key:
            self._plan(key, qo_indptr, kv_indptr, heads, dqk, dv, sm_scale, q.dtype)
        self.wrapper.run(q, k, v, out=out)
        self.calls += 1

    @property
    def ready(self) -> bool:
        """The module is compiled (or failed to: then the wrapper's own build reports it on use)."""
        return all(b.done() for b in self.builds)

    def stats(self) -> dict[str, Any]:
        return {"fa3_prefill_plans": self.plans, "fa3_prefill_calls": self.calls,
                "fa3_prefill_builds": [b.to_dict() for b in self.builds]}


#: the name the Triton session asks the prefill-kernel registry for
FA3_PREFILL = "flashinfer_fa3"


class Fa3PrefillKernel:
    """The registered descriptor of FlashInfer's FA3 ragged prefill (stateless; `make` gives a model its own)."""

    name = FA3_PREFILL

    def unavailable(self, dims: MLADims, dtype: torch.dtype, device: torch.device) -> str:
        return fa3_unavailable(dims, dtype, device)

    def make(self, device: torch.device, head_dims: frozenset[tuple[int, int]]) -> Fa3Prefill:
        return Fa3Prefill(device, head_dims)


register_prefill_kernel(Fa3PrefillKernel())
