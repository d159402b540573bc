"""Pure-torch host helpers that turn SequenceInfo metadata into what FlashInfer's MLA APIs take.

Nothing here imports FlashInfer, so all of it is tested on CPU.

- `mla_csr`: the CSR description `BatchMLAPagedAttentionWrapper.plan` takes (qo_indptr, kv_indptr,
  kv_indices, kv_len_arr), built from the *host mirrors* of the step's metadata — planning never
  copies anything back from the device.
- `fa_plan_work_count`: the number of work items FlashInfer's `MLAPlan` (scheduler.cuh) will
  schedule for a batch; plans over `capabilities.FA_MAX_WORK_ITEMS` would overflow its fixed
  work lists on 0.6.x, so the caller routes such steps elsewhere.
- `trtllm_block_table_width` / `fill_trtllm_block_table`: the dense block table of
  `trtllm_batch_decode_with_kv_cache_mla`, whose width must be a multiple of 128 / page_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention.registry import SCRATCH_PAGE


@dataclass(frozen=True)
class StepCounts:
    """(num_prefill_seqs, num_prefill_tokens, num_decode_seqs) of one step, from host batch_info."""

    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int

    @classmethod
    def of(cls, batch_info_host: torch.Tensor) -> "StepCounts":
        if batch_info_host.device.type != "cpu":
            raise ValueError(
                f"batch_info_host must be the host mirror (a CPU tensor), got a tensor on "
                f"{batch_info_host.device}; pass SequenceInfo.get('batch_info_host')."
            )
        a, b, c = (int(x) for x in batch_info_host.tolist())  # host tensor: no device sync
        return cls(a, b, c)

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def num_tokens(self) -> int:
        """Tokens the ops process (padding excluded)."""
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def decode_only(self) -> bool:
        return self.num_prefill_seqs == 0 and self.num_decode_seqs > 0


@dataclass(frozen=True)
class MLACsr:
    """CSR metadata of one step for BatchMLAPagedAttentionWrapper.plan (int32 CPU tensors)."""

    qo_indptr: torch.Tensor  # [nb + 1] token offsets of each sequence
    kv_indptr: torch.Tensor  # [nb + 1] offsets into kv_indices
    kv_indices: torch.Tensor  # [sum of pages] the sequences' pages, concatenated in order
    kv_len: torch.Tensor  # [nb] kv length incl. this step's tokens

    @property
    def num_seqs(self) -> int:
        return self.kv_len.numel()

    @property
    def qo_lens(self) -> torch.Tensor:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]


def mla_csr(
    cu_seqlen_host: torch.Tensor,
    seq_len_with_cache_host: torch.Tensor,
    page_table_host: torch.Tensor,
    num_seqs: int,
    page_size: int,
) -> MLACsr:
    """CSR of the first `num_seqs` sequences from host metadata (vectorised; no loop over sequences).

    kv_indices lists only the pages that hold a sequence's tokens (ceil(kv_len / page_size) each),
    so padded page-table entries never reach the kernel.
    """
    for name, t in (("cu_seqlen_host", cu_seqlen_host), ("seq_len_with_cache_host", seq_len_with_cache_host),
                    ("page_table_host", page_table_host)):
        if t.device.type != "cpu":
            raise ValueError(f"mla_csr: {name} must be a host tensor (CPU), got {t.device}; use the _host mirror.")
    if page_size < 1:
        raise ValueError(f"mla_csr: page_size={page_size}, expected >= 1.")
    nb = int(num_seqs)
    if nb < 0 or nb > seq_len_with_cache_host.numel() or nb + 1 > cu_seqlen_host.numel():
        raise ValueError(
            f"mla_csr: num_seqs={nb} outside the metadata capacity ({seq_len_with_cache_host.numel()} sequences)."
        )
    # NumPy on the host mirrors throughout (this runs in every step's prepare): torch ops on tiny CPU
    # tensors cost ~10 us each, and torch's masked index ran on the intra-op thread pool, which cost
    # ~6 ms a step at 64 x 4096 tokens when two ranks' pools shared the host's cores (measured).
    qo_indptr = np.array(cu_seqlen_host[: nb + 1].numpy(), dtype=np.int32)
    kv_len = np.array(seq_len_with_cache_host[:nb].numpy(), dtype=np.int32)
    pages = (kv_len + (page_size - 1)) // page_size
    if nb and int(pages.max()) > page_table_host.shape[1]:
        raise ValueError(
            f"mla_csr: a sequence needs {int(pages.max())} pages but the page table has {page_table_host.shape[1]} columns."
        )
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    if nb and (bool((qo_lens < 1).any()) or bool((qo_lens > kv_len).any())):
        raise ValueError(
            "mla_csr: every sequence needs 1 <= new tokens <= kv length; got new tokens "
            f"{qo_lens.tolist()} and kv lengths {kv_len.tolist()}."
        )
    kv_indptr = np.zeros(nb + 1, dtype=np.int32)
    if nb:
        np.cumsum(pages, out=kv_indptr[1:])
    used = np.arange(page_table_host.shape[1])[None, :] < pages[:, None]  # [nb, P]
    kv_indices = np.ascontiguousarray(page_table_host[:nb].numpy()[used], dtype=np.int32)
    qo_indptr, kv_indptr, kv_indices, kv_len = (torch.from_numpy(a) for a in (qo_indptr, kv_indptr, kv_indices, kv_len))
    return MLACsr(qo_indptr, kv_indptr, kv_indices, kv_len)


def _ceil_div(a: torch.Tensor | int, b: torch.Tensor | int):
    return (a + b - 1) // b


def fa_plan_work_count(qo_lens: torch.Tensor, kv_lens: torch.Tensor, num_heads: int, num_sm: int, causal: bool = True) -> int:
    """Work items FlashInfer's MLAPlan (fa2/fa3, scheduler.cuh) creates for this batch.

    Mirrors the scheduler's arithmetic: cluster size 2 when the mean packed query length
    (tokens x heads) exceeds 64, query tiles of 64 x cluster packed rows, causal KV bounds
    per tile, a KV split limit from the mean KV work per cluster, and one work item per
    (tile, KV chunk). Vectorised over tiles.
    """
    q = qo_lens.to(torch.int64)
    kv = kv_lens.to(torch.int64)
    nb = q.numel()
    if nb == 0:
        return 0
    if num_heads < 1 or num_sm < 1:
        raise ValueError(f"fa_plan_work_count: num_heads={num_heads}, num_sm={num_sm} must be >= 1.")
    packed = q * num_heads
    cluster = 2 if int(packed.sum()) // nb > 64 else 1
    clusters = num_sm // cluster
    tile = 64 * cluster
    n_tiles = _ceil_div(packed, tile)  # [nb]
    ends = torch.cumsum(n_tiles, 0)
    req = torch.searchsorted(ends, torch.arange(int(ends[-1])), right=True)  # tile -> request
    first = ends - n_tiles
    idx = torch.arange(req.numel()) - first[req]  # tile index within its request
    kv_t, q_t = kv[req], q[req]
    if causal:
        bound = kv_t - q_t + _ceil_div((idx + 1) * tile, num_heads)
        eff = torch.clamp(torch.minimum(bound, kv_t), min=0)
        eff = torch.where(idx + 1 == n_tiles[req], kv_t, eff)
    else:
        eff = kv_t
    avg = max(-(-int(eff.sum()) // clusters), 1)
    if avg <= 8:
        limit = 32
    elif avg <= 16:
        limit = 64
    elif avg <= 32:
        limit = 128
    elif avg <= 64:
        limit = 192
    else:
        limit = -(-avg // 256) * 256
    return int(torch.clamp(_ceil_div(eff, limit), min=1).sum())


def fa_plan_work_bound(qo_lens: torch.Tensor, num_heads: int, num_sm: int) -> int:
    """Cheap upper bound of `fa_plan_work_count`: query tiles (at the 64-row tile) + num_sm.

    Each tile yields ceil(eff / limit) <= eff / limit + 1 items and the split limit is at least the
    mean KV work per cluster, so the KV splits add at most one item per cluster (<= num_sm).
    """
    return int(_ceil_div(qo_lens.to(torch.int64) * num_heads, 64).sum()) + int(num_sm)


def trtllm_block_table_width(max_pages_per_seq: int, page_size: int) -> int:
    """Block-table width for trtllm-gen MLA: max pages rounded up to a multiple of 128 / page_size."""
    if page_size < 1 or 128 % page_size != 0:
        raise ValueError(
            f"trtllm-gen MLA needs a page size that divides 128 (it supports 32 and 64), got {page_size}."
        )
    mult = 128 // page_size
    return max(1, -(-int(max_pages_per_seq) // mult)) * mult


def fill_trtllm_block_table(dst: torch.Tensor, page_table: torch.Tensor) -> None:
    """Copy `page_table` [B, P] into the left of `dst` [B', W] (W >= P); the padding holds the scratch page.

    Works on host or device tensors alike (a device-side copy: no synchronisation).
    """
    if dst.dim() != 2 or page_table.dim() != 2:
        raise ValueError(f"fill_trtllm_block_table: expected 2-D tensors, got {tuple(dst.shape)} and {tuple(page_table.shape)}.")
    b, p = page_table.shape
    if dst.shape[0] < b or dst.shape[1] < p:
        raise ValueError(
            f"fill_trtllm_block_table: destination {tuple(dst.shape)} is smaller than the page table {tuple(page_table.shape)}."
        )
    dst[:b, :p].copy_(page_table)
    if dst.shape[1] > p:
        dst[:b, p:].fill_(SCRATCH_PAGE)


def trtllm_block_table(page_table: torch.Tensor, num_seqs: int, page_size: int) -> torch.Tensor:
    """A new [num_seqs, W] int32 block table (W from `trtllm_block_table_width`)."""
    w = trtllm_block_table_width(page_table.shape[1], page_size)
    out = torch.full((num_seqs, w), SCRATCH_PAGE, dtype=torch.int32, device=page_table.device)
    fill_trtllm_block_table(out, page_table[:num_seqs].to(torch.int32))
    return out
