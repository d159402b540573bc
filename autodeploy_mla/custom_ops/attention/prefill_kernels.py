"""Attention kernels one backend may use for another's expanded prefill, found by name.

vLLM selects an MLA model's prefill backend separately from its decode backend; here the Triton
backend's expanded prefill (K/V expanded by kv_b_proj, then an ordinary causal attention) may attend
with FlashInfer's FA3 ragged prefill. That kernel lives with FlashInfer (flashinfer/fa3_prefill.py)
and registers itself here; the Triton session asks for it by name, so neither backend imports the
other and the kernel's facts (`unavailable`) stay next to its code.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from .mla_dims import MLADims


class PrefillAttention(Protocol):
    """One model's instance of a prefill attention kernel (owned by the using backend's session)."""

    @property
    def ready(self) -> bool:
        """Whether it can run now (e.g. its module has finished compiling)."""

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, qo_indptr: tuple[int, ...],
            kv_indptr: tuple[int, ...], sm_scale: float) -> None:
        """out = causal attention of q over (k, v), sequences by the host indptrs."""

    def stats(self) -> dict[str, Any]: ...


class PrefillKernel(Protocol):
    """A registered prefill attention kernel: its capability facts and its per-model factory."""

    name: str

    def unavailable(self, dims: MLADims, dtype: torch.dtype, device: torch.device) -> str:
        """Why it cannot run these dims here ('' when it can)."""

    def make(self, device: torch.device, head_dims: frozenset[tuple[int, int]]) -> PrefillAttention: ...


# Filled while custom_ops/ is imported (flashinfer/fa3_prefill.py), never changed afterwards; holds
# stateless kernel descriptors.
_PREFILL_KERNELS: dict[str, PrefillKernel] = {}


def register_prefill_kernel(kernel: PrefillKernel) -> PrefillKernel:
    if kernel.name in _PREFILL_KERNELS:
        raise ValueError(f"prefill kernel {kernel.name!r} is registered twice")
    _PREFILL_KERNELS[kernel.name] = kernel
    return kernel


def prefill_kernel(name: str) -> Optional[PrefillKernel]:
    """The registered prefill kernel `name`, or None (its library's package was not imported)."""
    return _PREFILL_KERNELS.get(name)


__all__ = ["PrefillAttention", "PrefillKernel", "prefill_kernel", "register_prefill_kernel"]
