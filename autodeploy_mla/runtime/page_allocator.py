"""Page allocator for the paged latent cache (DESIGN §7).

Pages are the unit of cache ownership: a sequence owns an ordered list of pages (its row of the
page table); pages return to the free pool when the sequence finishes. Page 0 is reserved as a
scratch page: padded tokens and padded page-table entries point at it, so padded work can never
write into a live sequence's cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..custom_ops.backend_registry import SCRATCH_PAGE
from .errors import CapacityError, OutOfPagesError


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int | None = None) -> None:
        if num_pages < 2:
            raise CapacityError(
                f"num_pages={num_pages}: at least 2 are needed (page {SCRATCH_PAGE} is the reserved "
                "scratch page). Raise `num_pages` or the cache memory fraction."
            )
        if page_size < 1:
            raise CapacityError(f"page_size={page_size}: must be >= 1.")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        # LIFO free list: recently freed (cache-warm) pages are reused first.
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._owned: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def pages_of(self, seq_id: int) -> list[int]:
        """The sequence's pages in order (a copy). Unknown sequences own no pages."""
        return list(self._owned.get(seq_id, ()))

    def owners(self) -> dict[int, list[int]]:
        return {k: list(v) for k, v in self._owned.items()}

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow `seq_id` to hold `num_tokens` tokens; see `ensure_many`."""
        self.ensure_many({seq_id: num_tokens})
        return self.pages_of(seq_id)

    def ensure_many(self, demands: Mapping[int, int]) -> None:
        """Grow every sequence to hold its demanded token count, all or nothing.

        Raises OutOfPagesError (changing nothing) when the free pool cannot cover the whole step,
        so a failed step never leaves some sequences grown and others not.
        """
        extra: dict[int, int] = {}
        for seq_id, num_tokens in demands.items():
            need = self.pages_needed(num_tokens)
            if self.max_pages_per_seq is not None and need > self.max_pages_per_seq:
                raise CapacityError(
                    f"sequence {seq_id} needs {need} pages for {num_tokens} tokens, over "
                    f"max_pages_per_seq={self.max_pages_per_seq} (max_seq_len / page_size)."
                )
            have = len(self._owned.get(seq_id, ()))
            if need > have:
                extra[seq_id] = need - have
        total = sum(extra.values())
        if total > len(self._free):
            raise OutOfPagesError(
                f"out of cache pages: this step needs {total} more pages but only {len(self._free)} "
                f"of {self.num_usable} are free (page_size={self.page_size}). Finish or evict "
                "sequences, lower max_batch_size, or give the cache more pages."
            )
        for seq_id, n in extra.items():
            got = [self._free.pop() for _ in range(n)]
            self._owned.setdefault(seq_id, []).extend(got)

    def free(self, seq_id: int) -> int:
        """Return all pages of `seq_id` to the pool; returns how many were freed."""
        pages = self._owned.pop(seq_id, [])
        self._free.extend(reversed(pages))
        return len(pages)
