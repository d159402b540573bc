"""MoE backends as declared descriptors, one lookup for both MoE passes.

Like the attention backends (`attention/registry.py`), each MoE backend declares what it serves
through `check()`; `fuse_moe` (the experts) and `fuse_routing` (the router) ask `resolve_moe_backend`
instead of each keeping its own copy of the capability rules. What differs between the two ops is
data here (`MoEOp`): the reasons they report, and what `auto` does where only the interpreter or
no CUDA device is there (the experts pass keeps the model's subgraph; the routing pass runs the
torch reference, which is the model's own calls in one op).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ..attention.registry import CheckResult, DeviceInfo
from ..triton_helpers import interpreting
from .ops import HAS_TRITON, TRITON_IMPORT_ERROR
from .routing import MAX_EXPERTS

MoEOpKind = Literal["experts", "routing"]
#: block-FP8 expert weights (DeepSeek-V3's checkpoints): served by the *_moe_experts_fp8 ops (fp8.py)
FP8_WEIGHTS = torch.float8_e4m3fn
#: backends a MoE pass may be configured with (besides "auto")
MOE_BACKENDS: tuple[str, ...] = ("triton", "torch")


@dataclass(frozen=True)
class MoEOp:
    """What one MoE pass reports and how its `auto` behaves off CUDA."""

    pass_name: str
    torch_reason: str  # the torch reference, configured
    triton_reason: str  # Triton chosen (after "triton on <device>: ")
    kept: str  # the model's subgraph kept ("kept the model's <kept>: ...")
    #: auto off CUDA (or interpreted): run the torch reference (True) or keep the model's subgraph
    auto_off_cuda_torch: bool
    refusal_hint: str  # what to use instead when triton was requested and refuses


def triton_unavailable(dev: DeviceInfo) -> Optional[str]:
    """Why Triton kernels cannot run on the build's device, or None when they can."""
    if not HAS_TRITON:
        return f"triton not installed ({TRITON_IMPORT_ERROR})"
    if dev.type == "cpu" and not interpreting():
        return "Triton kernels need a CUDA GPU (on CPU only through TRITON_INTERPRET=1)"
    if dev.type not in ("cpu", "cuda"):
        return f"device type {dev.type!r} unsupported"
    return None


@dataclass(frozen=True)
class TritonMoEBackend:
    """The Triton MoE kernels (moe/kernels.py, moe/route_kernel.py)."""

    name: str = "triton"

    def check(self, kind: MoEOpKind, dev: DeviceInfo, dtype: Optional[torch.dtype] = None,
              num_experts: int = 0) -> CheckResult:
        why = triton_unavailable(dev)
        if kind == "experts":
            if why is None and dev.sm is not None and dev.sm < 80 and dtype in (torch.bfloat16,):
                why = f"bf16 tl.dot needs SM80+, device is {dev.short()}"
            if why is None and dev.sm is not None and dev.sm < 89 and dtype == FP8_WEIGHTS:
                why = f"FP8 tl.dot needs SM89+, device is {dev.short()}"
            if why is None and dtype not in (torch.float16, torch.bfloat16, torch.float32, FP8_WEIGHTS):
                why = f"dtype {dtype} unsupported"
        elif why is None and num_experts > MAX_EXPERTS:
            why = f"{num_experts} experts exceed the kernel's {MAX_EXPERTS}"
        return CheckResult(why is None, why or f"triton on {dev.short()}")


@dataclass(frozen=True)
class TorchMoEBackend:
    """The torch reference ops: run anywhere."""

    name: str = "torch"

    def check(self, kind: MoEOpKind, dev: DeviceInfo, dtype: Optional[torch.dtype] = None,
              num_experts: int = 0) -> CheckResult:
        return CheckResult(True, "torch reference")


_EXPERTS = MoEOp("fuse_moe", "configured: torch reference (dense over experts; for tests)",
                 "fused layout + gate-fused up GEMM + weighted down GEMM", "experts", False,
                 "use backend: auto (keeps the model's experts) or torch")
_ROUTING = MoEOp("fuse_routing", "configured: torch reference (HF's calls)", "one kernel per router", "routing", True,
                 "use backend: auto or torch (the reference)")
TRITON, TORCH = TritonMoEBackend(), TorchMoEBackend()


def moe_op(kind: MoEOpKind) -> MoEOp:
    if kind == "experts":
        return _EXPERTS
    if kind == "routing":
        return _ROUTING
    raise ValueError(f"unknown MoE op kind {kind!r}; valid: experts, routing")


def resolve_moe_backend(kind: MoEOpKind, requested: str, dev: DeviceInfo, dtype: Optional[torch.dtype] = None,
                        num_experts: int = 0) -> tuple[Optional[str], str]:
    """(backend, reason) for one MoE layer of `kind`; backend None keeps the model's subgraph.
    `requested` is "auto" or one of MOE_BACKENDS; an explicit "triton" that cannot run is an error."""
    op = moe_op(kind)
    if requested not in ("auto", *MOE_BACKENDS):
        raise ValueError(f"transforms.{op.pass_name}.backend={requested!r}; valid: auto, {', '.join(MOE_BACKENDS)}")
    if requested == "torch":
        return "torch", op.torch_reason
    res = TRITON.check(kind, dev, dtype, num_experts)
    if requested == "auto":
        if op.auto_off_cuda_torch and (dev.type != "cuda" or interpreting()):
            where = "under TRITON_INTERPRET=1" if interpreting() else f"on {dev.short()}"
            return "torch", (f"torch reference {where}: the model's own calls in one op (auto runs the Triton "
                             "kernel compiled on CUDA only; backend: triton forces the interpreter)")
        if not op.auto_off_cuda_torch and dev.type == "cpu":
            return None, ("kept the model's experts: auto fuses on CUDA only (on CPU, backend: triton runs the "
                          "kernels in Triton's interpreter, for tests)")
    if res.ok:
        return "triton", f"{res.reason}: {op.triton_reason}"
    if requested == "triton":
        raise ValueError(f"transforms.{op.pass_name}.backend=triton cannot run here: {res.reason}; {op.refusal_hint}")
    return None, f"kept the model's {op.kept}: {res.reason}"


def experts_op(backend: str, fp8: bool = False):
    """The fused experts op of `backend` ("triton" | "torch"): the block-FP8 variant when the expert
    weights are float8_e4m3fn (`fp8`), which takes each weight's block scales after it."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; valid: {', '.join(MOE_BACKENDS)}")
    return getattr(torch.ops.autodeploy, f"{backend}_moe_experts{'_fp8' if fp8 else ''}").default


__all__ = ["FP8_WEIGHTS", "MOE_BACKENDS", "experts_op", "MoEOp", "TorchMoEBackend", "TritonMoEBackend", "moe_op", "resolve_moe_backend",
           "triton_unavailable"]
