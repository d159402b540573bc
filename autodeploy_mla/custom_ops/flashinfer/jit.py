"""FlashInfer's JIT modules compiled ahead, in the background, so that start-up does not wait for nvcc.

FlashInfer compiles each kernel module with nvcc the first time a wrapper plans it and caches the
result on disk. On a fresh H200 host that was the largest part of a DeepSeek-V2-Lite start
(py-spy, docs/benchmarks/serving_http.md): ~20 s for the MLA decode module, built when the model
runner creates its FlashInfer session, and ~96 s for the FA3 ragged-prefill module (ten
translation units; the slowest bounds the parallel build), built by the first long prefill of
the warm-up. Neither needs the model: both are determined by the MLA dims, the dtypes and the GPU.

`prefetch` starts those builds in background threads as soon as `optimize()` has resolved the
config, so they run while the model is made, exported and compiled. A build here only compiles
(`JitSpec.build`, under FlashInfer's own file lock): the module is loaded later by the thread that
plans it, never while another thread may be capturing a CUDA graph. The module arguments are the
ones FlashInfer 0.7's wrappers pass at plan time (`flashinfer/mla/_batch_mla/_backends/fa3_backend.py`,
`BatchPrefillWithRaggedKVCacheWrapper.plan`); a guess that misses only costs a background build,
as the wrapper then builds its own module as before. `JitBuild.done` lets a session use a module
only once it is built (the Triton backend's FA3 prefill: docs/serving.md, start-up).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..attention.mla_dims import MLADims

#: (Dqk, Dv) pairs FlashInfer 0.7's FA3 prefill kernels are built for (192 / 128: DeepSeek's expanded heads)
FA3_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})


@dataclass
class JitBuild:
    """One module compiled in a daemon thread: `done()` without waiting, `error` if it failed."""

    name: str
    build: Callable[[], None]
    seconds: Optional[float] = None
    error: Optional[str] = None
    _thread: Optional[threading.Thread] = field(default=None, repr=False)

    def start(self) -> "JitBuild":
        self._thread = threading.Thread(target=self._run, name=f"jit-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        t = time.perf_counter()
        try:
            _lower_priority()
            self.build()
        except Exception as exc:  # noqa: BLE001 - the wrapper builds (and reports) it again when used
            self.error = f"{type(exc).__name__}: {exc}"[:500]
        self.seconds = time.perf_counter() - t

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    @property
    def ok(self) -> bool:
        return self.done() and self.error is None

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.ok

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.name, "done": self.done(), "seconds": self.seconds, "error": self.error}


#: nice value of the build threads and the nvcc processes they start (Linux: per thread, inherited)
BUILD_NICE = 10


def _lower_priority() -> None:
    """Run this thread (and the ninja / nvcc processes it starts, which inherit it) at a lower CPU
    priority: the build is background work; model export, Inductor's compile workers and, once
    serving, the engine loop and HTTP come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BUILD_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: build at normal priority
        pass


def dims_from_hf_config(config: Any) -> Optional[MLADims]:
    """The MLA dims an HF config declares (DeepSeek-style attribute names), None if it declares none."""
    text = getattr(config, "text_config", None) or config
    names = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    vals = [getattr(text, n, None) for n in names]
    if not all(isinstance(v, int) and v >= 0 for v in vals) or vals[0] == 0 or vals[4] == 0:
        return None
    n, dn, dr, dv, r = vals
    return MLADims(num_heads=n, qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv, kv_lora_rank=r)


def _flashinfer_jit() -> Any:
    import flashinfer.jit

    return flashinfer.jit


def mla_module(kernel: str, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype) -> JitBuild:
    """The MLA paged-attention module `FlashInferMLASession` plans (kernel fa3 on SM90, fa2 on SM80)."""
    def build() -> None:
        spec = _flashinfer_jit().gen_batch_mla_module(kernel, dtype, cache_dtype, dtype, torch.int32,
                                                     dims.kv_lora_rank, dims.qk_rope_head_dim, False)
        spec.build(need_lock=True)

    return JitBuild(f"mla_{kernel}_ckv{dims.kv_lora_rank}_kpe{dims.qk_rope_head_dim}", build)


def fa3_prefill_module(head_dim_qk: int, head_dim_vo: int, dtype: torch.dtype) -> JitBuild:
    """The FA3 ragged-prefill module the Triton backend's expanded prefill plans (fa3_prefill.py)."""
    def build() -> None:
        spec = _flashinfer_jit().gen_batch_prefill_module("fa3", dtype, dtype, dtype, torch.int32, head_dim_qk,
                                                         head_dim_vo, 0, False, False, False)
        spec.build(need_lock=True)

    return JitBuild(f"fa3_prefill_qk{head_dim_qk}_vo{head_dim_vo}", build)


def prefetch(dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device) -> list[JitBuild]:
    """Start building the FlashInfer modules a model of `dims` may plan on `device` (none where
    FlashInfer is not installed, the device is not CUDA, or the dtypes are not 16-bit)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or cache_dtype != dtype:
        return []
    try:
        _flashinfer_jit()
    except Exception:  # noqa: BLE001 - no FlashInfer here: nothing to build
        return []
    major, _ = torch.cuda.get_device_capability(device)
    builds = []
    if major >= 8:
        builds.append(mla_module("fa3" if major == 9 else "fa2", dims, dtype, cache_dtype))
    qk, vo = dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.v_head_dim
    if major == 9 and (qk, vo) in FA3_HEAD_DIMS:
        builds.append(fa3_prefill_module(qk, vo, dtype))
    return [b.start() for b in builds]
