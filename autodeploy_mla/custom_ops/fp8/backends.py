"""FP8 linear backends as declared descriptors, and the per-node resolution (like attention's, DESIGN §8).

Each descriptor names its op (linear_ops.py) and says, through `check(node, target)`, whether it can
serve one `fp8_block_linear` node (its N, K, block and activation dtype) on the build's target
(device capability, installed library versions) — and why not. Checks look at data only (the target,
the installed torch's build facts); they never launch anything. Capability facts and their sources:

| backend | where | limits (why) |
|---|---|---|
| torch | anywhere | none; W8A16 (activations unquantized), a 16-bit weight copy per call |
| triton | CUDA SM89+ (FP8 `tl.dot`), or TRITON_INTERPRET=1 | K block a power of two >= 16 (act_quant's tile) |
| scaled_mm | CUDA SM 9.x only; torch with `torch.nn.functional.scaled_mm`, built with CUDA >= 12.9 | torch's ScaledBlas.cpp: "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90", cublasLt >= 12.9; block (128, 128); K % 128 == 0 and N % 16 == 0 (only aligned shapes verified: torch's own tests use multiples of 128) |
| cublas_triton | where both scaled_mm and triton accept | per call by token count: scaled_mm from linear_ops.CUBLAS_MIN_TOKENS tokens, triton below (measured: docs/benchmarks/fp8_weights_kernels.md) |
| flashinfer | CUDA SM 9.x; FlashInfer >= 0.7 (`fp8_blockscale_gemm_sm90`; its groupwise `gemm_fp8_nt_groupwise` is SM100/103/120 only) | bf16 in/out; block (128, 128); K % 128 == 0, N % 64 == 0 (vLLM gates it so) |

`resolve_fp8_linear_backend` walks a preference order (the pass takes it from its config, per device
class) and keeps every rejected backend's reason; an explicitly requested backend that cannot serve
a node is an error naming the node and the reason, unless fallback is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import torch

from ..attention.registry import CheckResult, Target, parse_version
from ..triton_helpers import interpreting
from .gemm_triton import HAS_TRITON, TRITON_IMPORT_ERROR
from .linear_ops import CUBLAS_MIN_TOKENS, LIBRARY_BLOCK

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: FlashInfer line this project runs (DESIGN §12): fp8_blockscale_gemm_sm90 exists there
FLASHINFER_MIN = (0, 7, 0)
CUDA_MIN_BLOCK_SCALING = (12, 9)


class FP8LinearResolutionError(ValueError):
    """An explicitly requested FP8 linear backend cannot serve a node (and fallback is off), or none can."""


@dataclass(frozen=True)
class FP8LinearNode:
    """What a check may know about one fp8_block_linear node."""

    n: int
    k: int
    block_n: int
    block_k: int
    x_dtype: torch.dtype
    weight_dtype: torch.dtype = FP8_WEIGHT_DTYPE
    has_bias: bool = False

    def short(self) -> str:
        return f"N={self.n} K={self.k} block=({self.block_n}, {self.block_k}) {str(self.x_dtype).removeprefix('torch.')}"


def _common(node: FP8LinearNode) -> Optional[str]:
    if node.weight_dtype != FP8_WEIGHT_DTYPE:
        return f"weight dtype {node.weight_dtype} is not float8_e4m3fn"
    if node.x_dtype not in ACT_DTYPES:
        return f"activation dtype {node.x_dtype} unsupported (fp32, bf16, fp16)"
    return None


def _sm9x(target: Target) -> Optional[str]:
    dev = target.device
    if dev.type != "cuda" or dev.capability is None:
        return f"needs a CUDA SM 9.x GPU, target is {dev.short()}"
    if dev.capability[0] != 9:
        return f"SM 9.x only, device is {dev.short()}"
    return None


@dataclass(frozen=True)
class TorchFP8Linear:
    name: str = "torch"
    op_name: str = "fp8_block_linear_torch"

    def check(self, node: FP8LinearNode, target: Target) -> CheckResult:
        why = _common(node)
        return CheckResult(why is None, why or "torch reference: dequantize + linear in the activation dtype (W8A16)")


@dataclass(frozen=True)
class TritonFP8Linear:
    name: str = "triton"
    op_name: str = "fp8_block_linear_triton"

    def check(self, node: FP8LinearNode, target: Target) -> CheckResult:
        dev = target.device
        why = _common(node)
        if why is None and not HAS_TRITON:
            why = f"triton not installed ({TRITON_IMPORT_ERROR})"
        if why is None and dev.type == "cpu" and not interpreting():
            why = "Triton kernels need a CUDA GPU (on CPU only through TRITON_INTERPRET=1)"
        if why is None and dev.type == "cuda" and (dev.sm is None or dev.sm < 89):
            why = f"FP8 tl.dot needs SM89+, device is {dev.short()}"
        if why is None and dev.type not in ("cpu", "cuda"):
            why = f"device type {dev.type!r} unsupported"
        if why is None and (node.block_k < 16 or node.block_k & (node.block_k - 1)):
            why = f"K block {node.block_k} is not a power of two >= 16 (the activation-quantization tile)"
        where = "interpreted" if dev.type == "cpu" else dev.short()
        return CheckResult(why is None, why or f"triton W8A8 block GEMM on {where}")


def scaled_mm_api_missing() -> Optional[str]:
    """Why the installed torch has no block-scaled cuBLAS FP8 GEMM, or None. Build facts of the installed
    torch, not a probe of the machine."""
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with ScalingType.BlockWise128x128"
    cuda = parse_version(torch.version.cuda)
    if cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if cuda[:2] < CUDA_MIN_BLOCK_SCALING:
        return f"torch is built with CUDA {torch.version.cuda}; block-scaled cuBLAS needs >= 12.9"
    return None


@dataclass(frozen=True)
class ScaledMMFP8Linear:
    name: str = "scaled_mm"
    op_name: str = "fp8_block_linear_scaled_mm"

    def check(self, node: FP8LinearNode, target: Target) -> CheckResult:
        why = _common(node) or _sm9x(target) or scaled_mm_api_missing()
        if why is None and (node.block_n, node.block_k) != LIBRARY_BLOCK:
            why = f"block ({node.block_n}, {node.block_k}): cuBLAS block scaling is (128, 128) only"
        if why is None and node.k % 128:
            why = f"K={node.k} is not a multiple of 128 (partial K blocks unverified with cuBLAS)"
        if why is None and node.n % 16:
            why = f"N={node.n} is not a multiple of 16 (FP8 operand and output alignment)"
        if why is None and node.x_dtype == torch.float16:
            why = "fp16 output unverified with block scaling (bf16, fp32 are)"
        return CheckResult(why is None, why or f"cuBLAS block-scaled FP8 (torch {torch.__version__}, "
                                               f"CUDA {torch.version.cuda}) on {target.device.short()}")


@dataclass(frozen=True)
class CublasTritonFP8Linear:
    """cuBLAS for prefill-sized calls, Triton for decode-sized ones (linear_ops.fp8_block_linear_cublas_triton):
    a node runs both, so both must accept it."""

    name: str = "cublas_triton"
    op_name: str = "fp8_block_linear_cublas_triton"

    def check(self, node: FP8LinearNode, target: Target) -> CheckResult:
        cub = ScaledMMFP8Linear().check(node, target)
        if not cub.ok:
            return CheckResult(False, f"its cuBLAS half (scaled_mm) refuses: {cub.reason}")
        tri = TritonFP8Linear().check(node, target)
        if not tri.ok:
            return CheckResult(False, f"its Triton half refuses: {tri.reason}")
        return CheckResult(True, f"cuBLAS block-scaled FP8 for T >= {CUBLAS_MIN_TOKENS} tokens, Triton W8A8 below: on the "
                                 "H200 Triton was as fast or faster at T <= 64 and cuBLAS faster from T = 128, up to "
                                 f"1.9x at T 2048 / 8192 (docs/benchmarks/fp8_weights_kernels.md; {cub.reason})")


@dataclass(frozen=True)
class FlashInferFP8Linear:
    name: str = "flashinfer"
    op_name: str = "fp8_block_linear_flashinfer"

    def check(self, node: FP8LinearNode, target: Target) -> CheckResult:
        ver = target.versions.get("flashinfer")
        why = _common(node) or _sm9x(target)
        if why is None and ver is None:
            why = "flashinfer not installed"
        if why is None and (parse_version(ver) or (0, 0, 0)) < FLASHINFER_MIN:
            why = (f"flashinfer {ver}: fp8_blockscale_gemm_sm90 is used from {'.'.join(map(str, FLASHINFER_MIN))} on "
                   "(the line this project runs)")
        if why is None and (node.block_n, node.block_k) != LIBRARY_BLOCK:
            why = f"block ({node.block_n}, {node.block_k}): FlashInfer's SM90 block-scale GEMM is (128, 128) only"
        if why is None and node.x_dtype != torch.bfloat16:
            why = f"bf16 activations only, got {node.x_dtype}"
        if why is None and (node.k % 128 or node.n % 64):
            why = f"N={node.n}, K={node.k}: needs K % 128 == 0 and N % 64 == 0"
        return CheckResult(why is None, why or f"FlashInfer {ver} fp8_blockscale_gemm_sm90 on {target.device.short()}")


TORCH, TRITON, SCALED_MM, FLASHINFER = TorchFP8Linear(), TritonFP8Linear(), ScaledMMFP8Linear(), FlashInferFP8Linear()
CUBLAS_TRITON = CublasTritonFP8Linear()
_BACKENDS = MappingProxyType({b.name: b for b in (TORCH, TRITON, SCALED_MM, CUBLAS_TRITON, FLASHINFER)})
#: every FP8 linear backend name (a config's `backend` is one of these or "auto")
FP8_LINEAR_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def fp8_linear_backend(name: str) -> Any:
    if name not in _BACKENDS:
        raise ValueError(f"unknown FP8 linear backend {name!r}; valid: {', '.join(FP8_LINEAR_BACKENDS)}")
    return _BACKENDS[name]


def fp8_linear_op(name: str) -> Any:
    """The backend's op overload (torch.ops.autodeploy.fp8_block_linear_<name>.default)."""
    return getattr(torch.ops.autodeploy, fp8_linear_backend(name).op_name).default


@dataclass(frozen=True)
class FP8LinearDecision:
    layer: str
    node: FP8LinearNode
    requested: str
    backend: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "n": self.node.n, "k": self.node.k, "requested": self.requested,
                "backend": self.backend, "reason": self.reason, "rejected": [list(r) for r in self.rejected]}


def resolve_fp8_linear_backend(layer: str, node: FP8LinearNode, target: Target, requested: str,
                               order: Sequence[str], allow_fallback: bool = False) -> FP8LinearDecision:
    """The backend for one node: `requested` ("auto" or a name) if it accepts, else (auto, or fallback
    allowed) the first of `order` that accepts; every refusal kept with its reason."""
    rejected: list[tuple[str, str]] = []
    if requested != "auto":
        res = fp8_linear_backend(requested).check(node, target)
        if res.ok:
            return FP8LinearDecision(layer, node, requested, requested, f"requested explicitly; {res.reason}")
        if not allow_fallback:
            raise FP8LinearResolutionError(
                f"{layer}: fp8_linear backend {requested!r} cannot serve this linear ({node.short()}, "
                f"{target.device.short()}): {res.reason}. Choose another backend, use `auto`, or set "
                "transforms.resolve_fp8_linear.allow_fallback: true.")
        rejected.append((requested, res.reason))
    for name in order:
        if name == requested:
            continue
        res = fp8_linear_backend(name).check(node, target)
        if res.ok:
            how = "fallback" if requested != "auto" else "auto"
            return FP8LinearDecision(layer, node, requested, name, f"{how}: first accepted; {res.reason}",
                                     tuple(rejected))
        rejected.append((name, res.reason))
    lines = "; ".join(f"{b}: {r}" for b, r in rejected)
    raise FP8LinearResolutionError(f"{layer}: no FP8 linear backend can serve {node.short()} on "
                                   f"{target.device.short()}: {lines or 'empty preference order'}")


__all__ = ["CUBLAS_TRITON", "FLASHINFER", "FP8_LINEAR_BACKENDS", "FP8LinearDecision", "FP8LinearNode", "FP8LinearResolutionError",
           "SCALED_MM", "TORCH", "TRITON", "fp8_linear_backend", "fp8_linear_op", "resolve_fp8_linear_backend",
           "scaled_mm_api_missing"]
