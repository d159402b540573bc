"""Page allocator for the paged latent cache (DESIGN §7).

Pages are the unit of cache ownership: a sequence holds an ordered list of pages (its row of the
page table); pages return to the free pool when the sequence finishes. Page 0 is reserved as a
scratch page: padded tokens and padded page-table entries point at it, so padded work can never
write into a live sequence's cache.

Sharing. A page may be held by several sequences: every page not in the free pool has a reference
count (its holders), and it returns to the pool when its last holder frees it — so `num_free`
counts a shared page once, and a page is never freed twice. `fork(seq, src, n)` starts a new
sequence with the first n pages of another (the n > 1 choices of one prompt share its prefill).
Only FULL pages whose tokens are all written (or queued to be written, ahead on the stream) may be
shared, and no holder writes them again: a holder's own tokens go to the pages it gets after them.
Automatic prefix caching builds on the same counts: a cache of hashed full pages is one more
holder (`_retain` when a page enters it, `_release` when it is evicted), its LRU evicts the pages
whose only holder it is, and a new sequence takes a cached prefix as a fork takes its pages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..custom_ops.attention.registry import SCRATCH_PAGE
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
        self._refs: dict[int, int] = {}  # page -> holders, for every page not in the free pool

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

    def refcount(self, page: int) -> int:
        """How many sequences hold `page` (0: it is free)."""
        return self._refs.get(page, 0)

    def fork(self, seq_id: int, src_id: int, num_pages: int) -> list[int]:
        """Start `seq_id` (holding no pages) with the first `num_pages` pages of `src_id`, shared:
        no page is taken from the pool; `ensure` grows it after them with pages of its own.
        The caller guarantees those pages are full and never written again (see the module doc)."""
        if self._owned.get(seq_id):
            raise ValueError(f"fork: sequence {seq_id} already holds pages; fork starts a new sequence")
        src = self._owned.get(src_id, [])
        if not 0 <= num_pages <= len(src):
            raise ValueError(f"fork: sequence {src_id} holds {len(src)} pages, cannot share {num_pages}")
        pages = src[:num_pages]
        if pages:
            self._retain(pages)
            self._owned[seq_id] = list(pages)
        return list(pages)

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
            self._retain(got)
            self._owned.setdefault(seq_id, []).extend(got)

    def free(self, seq_id: int) -> int:
        """Drop `seq_id`'s hold on its pages; returns how many went back to the pool (pages that
        other sequences still hold stay theirs)."""
        return self._release(self._owned.pop(seq_id, []))

    def _retain(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] = self._refs.get(p, 0) + 1

    def _release(self, pages: list[int]) -> int:
        freed = []
        for p in pages:
            n = self._refs[p] - 1
            if n:
                self._refs[p] = n
            else:
                del self._refs[p]
                freed.append(p)
        self._free.extend(reversed(freed))
        return len(freed)
