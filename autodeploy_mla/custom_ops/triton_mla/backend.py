"""`TritonMLABackend` ("triton"): the descriptor of the Triton MLA backend, its capability checks
and its session factory (the op is op.py; the kernels kernels.py and gluon_*.py)."""

from __future__ import annotations

from typing import Optional

import torch

from ..attention.cache_format import cache_dtype_name, is_fp8
from ..attention.mla_dims import MLADims
from ..attention.registry import (CheckResult, MLABackend, SessionSpec, SparseOps, Target, parse_version,
                                  register_backend)
from ..triton_helpers import interpreting
from . import gluon_decode as GD
from .launchers import HAS_TRITON, TRITON_IMPORT_ERROR
from .op import METADATA, triton_mla_with_cache, triton_mla_with_cache_direct
from .policy import DEFAULT_POLICY, TritonPolicy
from .session import TritonMLASession
from .sparse import DSA_INDEXER_WITH_CACHE as SPARSE_INDEXER_WITH_CACHE
from .sparse import triton_mla_sparse_with_cache
from .tuning import MAX_EXPAND_HEAD_DIM, MAX_KV_LORA_RANK, MAX_ROPE_DIM, expansion_supported, validate_dims


@register_backend
class TritonMLABackend(MLABackend):
    name = "triton"
    policy_type = TritonPolicy
    cached_op = triton_mla_with_cache
    direct_call = staticmethod(triton_mla_with_cache_direct)
    metadata = METADATA
    source = "autodeploy_mla Triton kernels (docs/triton_backend.md; H200 numbers in docs/benchmarks/mla_kernels.md)"
    # Decode grids come from host batch_info (fixed per captured batch size) and a split count from
    # the static page-table width under capture; kernels read lengths from device metadata.
    # Verified by tests/test_triton_mla.py::test_cuda_graph_decode_replays_as_sequences_grow (GPU).
    decode_graph_safe = True
    #: static-bounds steps run `_attend_static` (one work-list launch over the sequence capacity)
    mixed_graph_safe = True
    #: sparse MLA (DSA) ops: split points too; graph safe like the dense op (static sizes under capture)
    sparse_ops = SparseOps(indexer=SPARSE_INDEXER_WITH_CACHE, attention=triton_mla_sparse_with_cache)

    def check(self, dims: MLADims, dtype: torch.dtype, target: Target) -> CheckResult:
        device = target.device
        tv = target.versions.get("triton")
        if tv is None or not HAS_TRITON:
            extra = f" (import failed: {TRITON_IMPORT_ERROR})" if tv is not None else ""
            return CheckResult(False, f"triton not installed{extra}; pip install 'triton>=3.4'")
        if (parse_version(tv) or (0, 0, 0)) < (3, 4, 0):
            return CheckResult(False, f"triton {tv} is older than 3.4 (the version these kernels were tested on)")
        if device.type == "cpu":
            if not interpreting():
                return CheckResult(False, "Triton kernels need a CUDA GPU (on CPU only through TRITON_INTERPRET=1)")
        elif device.type != "cuda":
            return CheckResult(False, f"device type {device.type!r} unsupported (CUDA only)")
        elif device.sm is not None and device.sm < 80 and dtype == torch.bfloat16:
            return CheckResult(False, f"bf16 tl.dot needs SM80+, device is {device.short()}")
        elif device.sm is not None and device.sm < 70:
            return CheckResult(False, f"needs SM70+, device is {device.short()}")
        if target.page_size < 1:
            return CheckResult(False, f"page_size={target.page_size} must be >= 1")
        why = validate_dims(dims, dtype)
        if why:
            return CheckResult(False, why)
        note = "" if expansion_supported(dims) else f"; prefill absorbed only (Dn/Dv > {MAX_EXPAND_HEAD_DIM})"
        where = "CPU interpreter (slow, for tests)" if device.type == "cpu" else device.short()
        if device.type == "cuda":
            g_ok, g_why = GD.dims_supported(dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim,
                                            target.page_size, dtype, device.sm)
            wide = dims.num_heads > GD.NARROW_MAX_HEADS
            note += ((f"; decode on the Gluon warp-specialised kernel{', 64 heads per program' if wide else ''} "
                      "(16-bit cache)") if g_ok else f"; decode on the tl kernels (not Gluon: {g_why})")
        return CheckResult(True, f"triton on {where}: any N, R<= {MAX_KV_LORA_RANK}, Dr<= {MAX_ROPE_DIM}{note}")

    def check_cache(self, dims: MLADims, dtype: torch.dtype, cache_dtype: torch.dtype, target: Target) -> CheckResult:
        if cache_dtype == dtype:
            return CheckResult(True, "cache in the model dtype")
        if not is_fp8(cache_dtype):
            return CheckResult(False, f"a {cache_dtype_name(cache_dtype)} cache under {cache_dtype_name(dtype)} "
                                      "activations (the kernels read the model dtype or fp8_e4m3)")
        sm = target.device.sm
        if target.device.type == "cuda" and sm is not None and sm < 89:
            return CheckResult(False, f"Triton converts e4m3 only on SM89+, device is {target.device.short()}")
        return CheckResult(True, "fp8_e4m3 cache: tiles converted to the query dtype on load, scales in the scores")

    def setup(self, spec: SessionSpec, policy: Optional[TritonPolicy] = None) -> TritonMLASession:
        self.check_all(spec)
        return TritonMLASession(spec, policy or DEFAULT_POLICY)
