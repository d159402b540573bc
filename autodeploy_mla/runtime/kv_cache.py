"""Paged latent caches: one tensor per MLA layer, `[num_pages, page_size, R + Dr]` (DESIGN §7)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..custom_ops.attention.registry import CacheSpec
from .errors import CapacityError


@dataclass(frozen=True)
class CacheLayout:
    name: str  # graph input name
    layer: str
    spec: CacheSpec


def page_bytes(layouts: Sequence[CacheLayout], page_size: int) -> int:
    """Bytes one page costs across all layers."""
    return sum(page_size * lay.spec.width * lay.spec.dtype.itemsize for lay in layouts)


def plan_num_pages(
    layouts: Sequence[CacheLayout],
    page_size: int,
    max_batch_size: int,
    max_seq_len: int,
    device: torch.device,
    num_pages: int | None,
    free_memory_fraction: float,
) -> int:
    """Pages per layer: explicit, else a fraction of free GPU memory, else enough for full batches (CPU)."""
    full = 1 + max_batch_size * math.ceil(max_seq_len / page_size)
    if num_pages is not None:
        return num_pages
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = int(free * free_memory_fraction) // max(page_bytes(layouts, page_size), 1)
        if n < 2:
            raise CapacityError(
                f"free GPU memory ({free / 2**30:.2f} GiB x {free_memory_fraction}) holds {n} cache pages; "
                "need at least 2. Lower page_size/max_seq_len or free memory."
            )
        return min(n, full)
    return full


class MLACacheManager:
    """Owns the per-layer cache tensors (zero-initialised: the scratch page reads as zeros)."""

    def __init__(self, layouts: Sequence[CacheLayout], num_pages: int, page_size: int, device: torch.device) -> None:
        self.layouts = list(layouts)
        self.num_pages = num_pages
        self.page_size = page_size
        need = num_pages * page_bytes(self.layouts, page_size)
        try:
            self.caches: dict[str, torch.Tensor] = {
                lay.name: torch.zeros(num_pages, page_size, lay.spec.width, dtype=lay.spec.dtype, device=device)
                for lay in self.layouts
            }
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            raise CapacityError(
                f"the paged caches ({len(self.layouts)} layers x {num_pages} pages x {page_size} tokens = "
                f"{need / 2**30:.2f} GiB on {device}) could not be allocated ({type(exc).__name__}: {exc}). "
                "Lower runtime.num_pages or runtime.free_memory_fraction, or max_batch_size / max_seq_len."
            ) from None

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.caches.values())
