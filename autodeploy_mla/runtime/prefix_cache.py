"""Prefix-cache keys: what identifies a full page of prompt tokens in the paged latent cache.

A page's cached contents (its latent and rope-key rows, in every layer) are a function of the
tokens at and before it, of the model, and of how the cache stores them (dtype, FP8 scales, page
size). So a page's key is `sha256(parent key || page tokens)`, the chain rooted at the cache's
identity digest (`cache_identity`): two prompts share a page's key only if they agree on every
token up to the end of that page, in a cache of the same identity. sha256 rather than Python's
`hash()`: Python salts str hashes per process (tensor-parallel ranks must compute the same keys)
and 64-bit hashes collide by the birthday bound on long-running servers (vLLM moved to sha256 for
the same reason).

Only prompt pages are keyed: a generated token's cache row, written by a decode step, may differ in
rounding from the row a prefill of the same tokens writes, and caching must not change any token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np


def cache_identity(parts: Iterable[object]) -> bytes:
    """A digest of everything besides tokens that changes what a page holds: the model (its
    source and dtype), each cache layer's dtype, width and FP8 scales, the page size. `parts` are
    rendered with `repr` in order, so equal parts give equal digests in every process."""
    h = hashlib.sha256(b"autodeploy-mla prefix cache v1")
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return h.digest()


def page_keys(tokens: Sequence[int], page_size: int, identity: bytes, num_pages: int | None = None) -> list[bytes]:
    """Keys of the first `num_pages` full pages of `tokens` (default: every full page)."""
    full = len(tokens) // page_size
    n = full if num_pages is None else min(num_pages, full)
    if n <= 0:
        return []
    arr = np.asarray(tokens[: n * page_size], dtype=np.int64)
    keys, parent = [], identity
    for i in range(n):
        parent = hashlib.sha256(parent + arr[i * page_size : (i + 1) * page_size].tobytes()).digest()
        keys.append(parent)
    return keys
