"""What every Triton kernel family of the project shares (MLA attention, MoE experts and routing,
and the fusion passes that decide whether those kernels can run): the interpreter switch, the
`tl.dot` precision rule and its device-side `dot`, and power-of-two block sizes.

Kept out of `triton_mla/` so that MoE code and passes do not depend on the attention backend.
Imports without triton: the host helpers work, `dot` is then None.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1: tests on CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """DOT_PREC of `dot` for operands of `dtype`."""
    if dtype == torch.float32:
        return "ieee"  # exact fp32 products (no tf32), as the reference computes
    return "upcast" if interpreting() else "tf32"  # "tf32" is ignored for 16-bit operands


def pow2(x: int, lo: int = 16) -> int:
    """Next power of two >= x, at least `lo` (tl.dot needs dims >= 16 when compiled)."""
    return max(lo, 1 << (max(1, x) - 1).bit_length())


def _fix_interpreter_scalar_index() -> None:
    """TRITON_INTERPRET=1 with NumPy >= 2.4: the interpreter turns a scalar tensor into a Python int
    with int(array) on a 1-element 1-d array, which NumPy now refuses, so `range(lo, hi)` with
    run-time bounds fails. Patch that one conversion (restored with the interpreter's own patches)."""
    import numpy as np
    from triton.runtime import interpreter as interp

    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_autodeploy_mla", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._autodeploy_mla = True
    interp._patch_lang_tensor = patched


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

if triton is None:
    dot = None
else:
    if interpreting():
        _fix_interpreter_scalar_index()

    @triton.jit
    def dot(a, b, DOT_PREC: tl.constexpr):
        # DOT_PREC "upcast": the interpreter (TRITON_INTERPRET=1, triton 3.6) computes bf16/fp16 tl.dot
        # wrongly, so CPU runs multiply in fp32 (same rounding of the inputs, fp32 accumulate as on GPU).
        if DOT_PREC == "upcast":
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=DOT_PREC)


__all__ = ["dot", "dot_precision", "interpreting", "pow2"]
