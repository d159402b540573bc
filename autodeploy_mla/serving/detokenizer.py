"""Incremental detokenization of one choice, with stop strings.

Decoding the whole id list at every token (what the server did first) costs O(n) per token; this
keeps a short window instead, as HF's streamers and vLLM do: the text of the ids since
`prefix_offset` is decoded, and whatever it adds beyond the text of the ids up to `read_offset` is
new. A window that ends in half a multi-byte character (U+FFFD) waits for the next token. Stop
strings cut the text at their first occurrence; a suffix that may begin a stop string is held back
until it is known not to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (before any stop cut)
        self.emitted = ""  # what was handed out
        self.stopped = False
        self._prefix = 0  # window start
        self._read = 0  # ids whose text is in `text`
        self._longest_stop = max((len(s) for s in self.stops), default=0)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, tokens: Sequence[int]) -> str:
        """The new text these tokens complete (may be empty). Once a stop string is seen, later
        tokens are not taken (`ids` ends with the token that completed the stop string)."""
        if self.stopped:
            return ""
        if self.tokenizer is None:
            self.ids.extend(tokens)
            return ""
        if not self.stops:
            self.ids.extend(tokens)
            self._advance()
            return self._release(final=False)
        out = ""
        for t in tokens:  # one at a time: the token that completes a stop string ends the choice
            self.ids.append(t)
            self._advance()
            out += self._release(final=False)
            if self.stopped:
                break
        return out

    def _advance(self) -> None:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def finish(self) -> str:
        """The rest of the text once the choice is over (held-back text, a trailing partial character)."""
        if self.tokenizer is None or self.stopped:
            return ""
        if self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            after = self._decode(self.ids[self._prefix:])
            self.text += after[len(before):] if after.startswith(before) else ""
            self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.text
        if self.stops:
            start = max(0, len(self.emitted) - self._longest_stop)
            cuts = [c for s in self.stops if (c := text.find(s, start)) >= 0]
            if cuts:
                self.stopped = True
                text = text[: min(cuts)]
            elif not final:
                hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
                text = text[: len(text) - hold]
        delta = text[len(self.emitted):]
        self.emitted = text if len(text) >= len(self.emitted) else self.emitted
        return delta
