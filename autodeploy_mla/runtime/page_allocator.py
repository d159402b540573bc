"""Page allocator for the paged latent cache (DESIGN §7), with automatic prefix caching.

Pages are the unit of cache ownership: a sequence holds an ordered list of pages (its row of the
page table); pages return to the pool when the sequence finishes. Page 0 is reserved as a
scratch page: padded tokens and padded page-table entries point at it, so padded work can never
write into a live sequence's cache.

Sharing. A page may be held by several sequences: every held page has a reference count (its
holders), and it leaves the held set when its last holder frees it — so a shared page is counted
once, and a page is never freed twice. `fork(seq, src, n)` starts a new sequence with the first n
pages of another (the n > 1 choices of one prompt share its prefill). Only FULL pages whose tokens
are all written (or queued to be written, ahead on the stream) may be shared, and no holder writes
them again: a holder's own tokens go to the pages it gets after them.

Prefix caching (docs/prefix_caching.md). A full page of prompt tokens whose writes have completed
can be registered under its key (`register`): a digest of its tokens chained to the previous
page's digest and the cache's identity (runtime/prefix_cache.py computes them; the allocator only
maps key <-> page). Every page is in exactly one of three states:

- free: in `_free`, holds nothing anyone may read, has no key;
- held: refcount >= 1 (sequences holding it), with or without a key;
- evictable: has a key, no holder; kept in LRU order (`_evictable`, oldest first).

When its last holder frees a keyed page it becomes evictable instead of free, so a later request
with the same prefix takes it (`take_prefix`: held again, refcount 1, shared with any other taker).
Evictable pages count as free (`num_free`): `ensure_many` takes free pages first and then evicts
the least recently released evictable pages, dropping their keys *before* they are handed out, so
a key never names a page whose contents changed. A key maps to at most one page: when two requests
computed the same page concurrently, the second registration is ignored and that page stays
private (freed normally). All decisions are deterministic functions of the calls (lists and
insertion-ordered dicts, no hashing of Python objects with per-process salts), so tensor-parallel
ranks that see the same request stream make the same ones.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

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
        self._refs: dict[int, int] = {}  # page -> holders, for every held page
        self._page_of: dict[bytes, int] = {}  # key -> page (held or evictable)
        self._key_of: dict[int, bytes] = {}  # page -> key, the inverse
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed pages no one holds, LRU first
        #: pages evicted so far (their keys dropped to reuse them)
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Pages a request can get now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_cached(self) -> int:
        """Pages registered under a prefix key (held or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Cached pages no sequence holds (counted in `num_free`)."""
        return len(self._evictable)

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def pages_of(self, seq_id: int) -> list[int]:
        """The sequence's pages in order (a copy). Unknown sequences own no pages."""
        return list(self._owned.get(seq_id, ()))

    def owners(self) -> dict[int, list[int]]:
        return {k: list(v) for k, v in self._owned.items()}

    def refcount(self, page: int) -> int:
        """How many sequences hold `page` (0: it is free or evictable)."""
        return self._refs.get(page, 0)

    def cached_pages(self) -> dict[bytes, int]:
        """Every prefix key and the page it names (a copy; tests compare it across ranks)."""
        return dict(self._page_of)

    def key_of(self, page: int) -> bytes | None:
        """The prefix key `page` is cached under (None: not cached)."""
        return self._key_of.get(page)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, name cached pages (changes nothing)."""
        n = 0
        for k in keys:
            if k not in self._page_of:
                break
            n += 1
        return n

    def take_prefix(self, seq_id: int, keys: Sequence[bytes]) -> int:
        """Start `seq_id` (holding no pages) with the cached pages of its longest cached run of
        `keys` (shared, refcounted); returns how many pages it took. The caller passes only keys
        of pages it will never write (full pages before its last prompt token)."""
        if self._owned.get(seq_id):
            raise ValueError(f"take_prefix: sequence {seq_id} already holds pages; it starts a new sequence")
        pages = [self._page_of[k] for k in keys[: self.match_prefix(keys)]]
        if pages:
            for p in pages:
                self._evictable.pop(p, None)
            self._retain(pages)
            self._owned[seq_id] = pages
        return len(pages)

    def register(self, seq_id: int, keys: Sequence[bytes], first: int = 0) -> int:
        """Cache pages `first, first+1, ...` of `seq_id` under `keys` (one per page); returns how many
        became cached. Call only once the steps that wrote those pages have COMPLETED (a request
        that takes a cached page reads it at once, with no ordering on another request's writes),
        and only for full pages the sequence never writes again. Pages already cached (taken from
        the cache) and keys already naming another page are skipped."""
        pages = self._owned.get(seq_id, [])
        if first + len(keys) > len(pages):
            raise ValueError(f"register: sequence {seq_id} holds {len(pages)} pages, cannot cache pages "
                             f"{first}..{first + len(keys) - 1}")
        n = 0
        for page, key in zip(pages[first:], keys):
            if page in self._key_of or key in self._page_of:
                continue
            self._page_of[key], self._key_of[page] = page, key
            n += 1
        return n

    def clear_cache(self) -> int:
        """Forget every cached key: evictable pages go back to the free pool, held ones stay their
        holders' (uncached). Returns the pages freed."""
        freed = list(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._key_of.clear()
        self._free.extend(reversed(freed))
        return len(freed)

    # ------------------------------------------------------------------ sequences
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

        Raises OutOfPagesError (changing nothing) when the free and evictable pages cannot cover
        the whole step, so a failed step never leaves some sequences grown and others not.
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
        if total > self.num_free:
            raise OutOfPagesError(
                f"out of cache pages: this step needs {total} more pages but only {self.num_free} "
                f"of {self.num_usable} are free (page_size={self.page_size}; {len(self._evictable)} of the free "
                "ones are evictable cached prefix pages). Finish or evict sequences, lower max_batch_size, "
                "or give the cache more pages."
            )
        for seq_id, n in extra.items():
            got = [self._take_page() for _ in range(n)]
            self._retain(got)
            self._owned.setdefault(seq_id, []).extend(got)

    def _take_page(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._evictable.popitem(last=False)  # least recently released
        del self._page_of[self._key_of.pop(page)]  # its key goes before its contents change
        self.num_evicted += 1
        return page

    def free(self, seq_id: int) -> int:
        """Drop `seq_id`'s hold on its pages; returns how many no sequence holds any more (free, or
        evictable if cached). Pages that other sequences still hold stay theirs."""
        return self._release(self._owned.pop(seq_id, []))

    def _retain(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] = self._refs.get(p, 0) + 1

    def _release(self, pages: list[int]) -> int:
        freed, n_done = [], 0
        # last page first: a sequence's tail is evicted before its head (heads are the shared prefixes)
        for p in reversed(pages):
            n = self._refs[p] - 1
            if n:
                self._refs[p] = n
                continue
            del self._refs[p]
            n_done += 1
            if p in self._key_of:
                self._evictable[p] = None
            else:
                freed.append(p)
        self._free.extend(freed)
        return n_done

    def check(self) -> None:
        """Assert the invariants (tests, debugging): every usable page in exactly one state,
        refcounts equal to holders, keys and pages in one-to-one correspondence."""
        held = {p for pages in self._owned.values() for p in pages}
        counts: dict[int, int] = {}
        for pages in self._owned.values():
            assert len(set(pages)) == len(pages), f"a sequence holds a page twice: {pages}"
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
        assert counts == self._refs, f"refcounts {self._refs} != holders {counts}"
        free, evict = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is in the free list twice"
        assert not (free & held) and not (free & evict) and not (evict & held), "a page in two states"
        assert free | evict | held == set(range(SCRATCH_PAGE + 1, self.num_pages)), "a page leaked"
        assert SCRATCH_PAGE not in free | evict | held
        assert all(self._page_of[k] == p for p, k in self._key_of.items()) and len(self._page_of) == len(self._key_of)
        assert evict <= set(self._key_of) and not (free & set(self._key_of)), "an evictable page without a key"
