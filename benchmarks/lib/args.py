"""Argument types the benchmark scripts share."""

from __future__ import annotations


def ints(text: str) -> list[int]:
    """`"1,8,64"` -> [1, 8, 64] (an empty item is skipped)."""
    return [int(x) for x in text.split(",") if x]
