"""Runtime capacities checked from the config alone, before any model is built or exported.

The `ModelRunner` sizes its fixed buffers from `runtime.*` once the model is compiled: the step
metadata (`SequenceInfo`, max_batch_size x pages-per-sequence page table, max_num_tokens token
buffers) and the paged latent caches (`kv_cache.plan_num_pages`: `runtime.num_pages`, or on CPU
enough pages for max_batch_size full sequences). A capacity the machine cannot hold used to surface
there, after the export and every pass: `runtime.max_batch_size=100000000` on CPU passed the old
metadata-only check (6 GiB of metadata, under half of the host) and failed 20 s later allocating
5.3 TiB of cache; on a real checkpoint that is minutes. Everything those allocations depend on is
known before the build — the runtime config, the device, and the cache width per token from the
model's HF config (layers x (kv_lora_rank + qk_rope_head_dim) x the cache dtype) — so
`check_capacity` computes the same sizes first and refuses, with the numbers, what cannot work.

It refuses only what certainly fails. Every size is a lower bound: the metadata staging buffer (not
the sampler's small per-slot buffers), the caches at the smallest cache dtype the config names (no
DSA index-key cache, no weights, no activations). A cache too small for one full sequence is NOT
refused: shorter requests run, a longer one fails alone with OutOfPagesError (tests/test_engine.py).
On CUDA without `num_pages` the cache is a fraction of the free memory at build time and is not
checked here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config.schema import RuntimeConfig
from ..custom_ops.attention.cache_format import cache_dtype_name, resolve_cache_dtype
from ..models.factory import text_config
from .errors import CapacityError
from .kv_cache import plan_num_pages
from .sequence_info import metadata_nbytes

#: Largest value of the int32 fields of the step metadata (slot indices, positions, page numbers).
INT32_MAX = 2**31 - 1
GiB = 2**30


@dataclass(frozen=True)
class CacheFootprint:
    """The least one cached token costs, from the model's HF config: `layers` MLA layers, each
    `width` (R + Dr) elements of at least `itemsize` bytes (the smallest cache dtype configured)."""

    layers: int
    width: int
    itemsize: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.width * self.itemsize

    def describe(self) -> str:
        return f"{self.bytes_per_token} bytes per token ({self.layers} layers x {self.width} {self.dtype})"


def cache_footprint(hf: Any, rt: RuntimeConfig, model_dtype: torch.dtype) -> Optional[CacheFootprint]:
    """The cache cost per token of the model `hf` (an HF config) under `rt`; None when the config
    does not give the MLA dims (num_hidden_layers, kv_lora_rank, qk_rope_head_dim): then nothing is
    assumed and the caches are not checked before the build."""
    text = text_config(hf)
    dims = [getattr(text, k, None) for k in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim")]
    if not all(isinstance(d, int) and d >= 0 for d in dims) or dims[0] == 0 or dims[1] + dims[2] == 0:
        return None
    layers, r, dr = dims
    dtypes = {resolve_cache_dtype(name, model_dtype) for name in (rt.kv_cache_dtype, *rt.kv_cache_layers.values())}
    smallest = min(dtypes, key=lambda d: d.itemsize)
    return CacheFootprint(layers, r + dr, smallest.itemsize, cache_dtype_name(smallest))


def available_host_bytes() -> Optional[int]:
    """Memory the host can still give this process (MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of a CUDA device (None for other devices)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device.index if device.index is not None else
                                                torch.cuda.current_device()).total_memory)


def planned_num_pages(rt: RuntimeConfig, device: torch.device) -> Optional[int]:
    """Cache pages per layer the runner will allocate, where the config alone decides it (the same
    rule as kv_cache.plan_num_pages): runtime.num_pages, or on CPU max_batch_size full sequences.
    None on CUDA without num_pages (sized from the free memory at build time)."""
    if rt.num_pages is None and device.type == "cuda":
        return None
    return plan_num_pages([], rt.page_size, rt.max_batch_size, rt.max_seq_len, device, rt.num_pages,
                          rt.free_memory_fraction)


def _caps(rt: RuntimeConfig) -> str:
    return (f"runtime.max_batch_size={rt.max_batch_size}, max_num_tokens={rt.max_num_tokens}, "
            f"max_seq_len={rt.max_seq_len}, page_size={rt.page_size}")


def _cache_message(rt: RuntimeConfig, device: torch.device, cache: CacheFootprint, pages: int, need: int,
                   limit: int, host_meta: Optional[int]) -> str:
    """Why the caches do not fit, and the largest setting that would."""
    pps = math.ceil(rt.max_seq_len / rt.page_size)
    page_cost = rt.page_size * cache.bytes_per_token
    fits = limit // page_cost  # pages per layer this memory holds, at most
    if rt.num_pages is not None:
        head = f"runtime.num_pages={pages}, page_size={rt.page_size}"
        src = "pages per layer"
    else:
        head = f"runtime.max_batch_size={rt.max_batch_size}, max_seq_len={rt.max_seq_len}, page_size={rt.page_size}"
        src = (f"pages per layer: num_pages is null, so {'on CPU ' if device.type != 'cuda' else ''}the cache holds "
               f"max_batch_size full sequences of {pps} pages + 1 scratch page")
    where = (f"the {limit / GiB:.2f} GiB this host has available (after {host_meta / GiB:.2f} GiB of step metadata)"
             if host_meta is not None else f"the {limit / GiB:.2f} GiB of {device} (its total memory after the step "
             "metadata's copy)")
    if page_cost > limit:
        todo = f"One page of {rt.page_size} tokens alone costs {page_cost / GiB:.2f} GiB: lower page_size."
    elif rt.num_pages is not None:
        todo = f"Lower runtime.num_pages to at most {fits}" + (
            "." if device.type != "cuda" else ", or leave it null (free_memory_fraction of the free memory).")
    elif (seqs := (fits - 1) // pps) == 0:
        todo = (f"Not one full sequence of {rt.max_seq_len} tokens fits ({pps * page_cost / GiB:.2f} GiB each): lower "
                "max_seq_len.")
    else:
        todo = (f"About {seqs} full sequences of {rt.max_seq_len} tokens fit: lower max_batch_size to at most that "
                f"or max_seq_len, or set runtime.num_pages (at most {fits}).")
    return (f"{head}: the paged caches need {need / GiB:.2f} GiB on {device} ({pages} {src}; {rt.page_size} tokens per "
            f"page, {cache.describe()}), more than {where}. {todo}")


def check_capacity(rt: RuntimeConfig, device: Optional[torch.device] = None,
                   cache: Optional[CacheFootprint] = None, host_bytes: Optional[int] = None,
                   device_bytes: Optional[int] = None) -> None:
    """Refuse capacities whose buffers cannot be allocated, or whose values the int32 step metadata
    cannot hold, with the numbers and what to lower. `device` None: where the model will run is
    not known (only the host metadata and the int32 ranges are checked); `cache` None: the cache
    cost per token is not known (caches not checked); `host_bytes` / `device_bytes` None: that
    memory is not known (not checked)."""
    pages_per_seq = math.ceil(rt.max_seq_len / rt.page_size)
    meta = metadata_nbytes(rt.max_batch_size, rt.max_num_tokens, rt.max_seq_len, rt.page_size)
    # 1. the step metadata: a pinned host staging buffer (and the same bytes again on a GPU)
    if host_bytes is not None and meta > host_bytes // 2:
        raise CapacityError(
            f"{_caps(rt)}: the step metadata alone needs {meta / GiB:.2f} GiB (a {rt.max_batch_size} x "
            f"{pages_per_seq} page table, {rt.max_num_tokens}-token buffers), more than half of this host's "
            f"{host_bytes / GiB:.2f} GiB available memory. Lower max_batch_size / max_seq_len / max_num_tokens, "
            "or raise page_size."
        )
    if device is not None and device.type == "cuda" and device_bytes is not None and meta > device_bytes:
        raise CapacityError(
            f"{_caps(rt)}: the step metadata needs {meta / GiB:.2f} GiB on {device}, more than its "
            f"{device_bytes / GiB:.2f} GiB of memory. Lower max_batch_size / max_seq_len / max_num_tokens."
        )
    # 2. the paged caches, where their size is fixed by the config (CPU, or an explicit num_pages)
    pages = planned_num_pages(rt, device) if device is not None else rt.num_pages
    if pages is not None and cache is not None and device is not None:
        on_host = device.type != "cuda"
        total = host_bytes if on_host else device_bytes
        limit = None if total is None else total - meta  # the metadata (or its device copy) is there too
        page_cost = rt.page_size * cache.bytes_per_token
        need = pages * page_cost
        if limit is not None and need > limit:
            raise CapacityError(_cache_message(rt, device, cache, pages, need, limit, meta if on_host else None))
    # 3. values the int32 step metadata holds: slot indices, token offsets, positions, cache slots
    for name, value in (("max_batch_size", rt.max_batch_size), ("max_num_tokens", rt.max_num_tokens),
                        ("max_seq_len", rt.max_seq_len)):
        if value > INT32_MAX:
            raise CapacityError(f"runtime.{name}={value}: over {INT32_MAX}, the largest value the int32 step "
                                f"metadata holds (slot indices, token offsets, positions). Lower it.")
    if pages is not None and pages * rt.page_size - 1 > INT32_MAX:
        source = f"runtime.num_pages={pages}" if rt.num_pages is not None else (
            f"{pages} pages (num_pages null: max_batch_size={rt.max_batch_size} full sequences + 1)")
        raise CapacityError(
            f"{source} x page_size={rt.page_size} = {pages * rt.page_size} cache slots per layer, over the "
            f"{INT32_MAX + 1} that the int32 cache slot index (cache_loc) can address. Lower num_pages "
            "(or max_batch_size / max_seq_len when it is null)."
        )


__all__ = ["CacheFootprint", "INT32_MAX", "available_host_bytes", "cache_footprint", "check_capacity",
           "device_memory_bytes", "planned_num_pages"]
