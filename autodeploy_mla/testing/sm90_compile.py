"""Compile Triton kernels to SM90 cubins on a machine without a GPU (tests).

CPU tests run kernels in Triton's interpreter, which executes Python and never runs Triton's
compiler: a construction only the compiler rejects would pass there and fail on the first GPU. Triton's
CUDA backend (with its ptxas) is installed with triton on x86-64 Linux and compiles for a target
without a device. The check runs in a fresh process with TRITON_INTERPRET=0: in the test process the
`@triton.jit` functions already belong to the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: prepended to every check script: `compile_sm90(fn, signature, constexprs)` -> compiled kernel
PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_sm90(fn, signature, constexprs):
    k = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in k.asm
    return k
"""


def sm90_backend_missing() -> str:
    """Why SM90 cubins cannot be built here ('' when they can)."""
    try:
        import triton.backends.nvidia.compiler as nvidia  # the CUDA backend (and its ptxas)
    except Exception as exc:  # noqa: BLE001
        return f"triton's CUDA backend is not importable here: {exc}"
    return "" if nvidia.CUDABackend is not None else "triton's CUDA backend has no CUDABackend"


def run_sm90_compile_check(script: str, cache_dir: Path, timeout_s: int = 600) -> subprocess.CompletedProcess:
    """Run PRELUDE + `script` in a fresh interpreter-free process (Triton cache in `cache_dir`)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
