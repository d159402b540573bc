"""Generation engine: continuous batching over the paged cache (DESIGN §1, §7).

Every step mixes work: running sequences decode one token each (scheduled first: they hold pages
and latency matters), then waiting prompts prefill in chunks that fill the rest of the
`max_num_tokens` budget. A request reserves pages for its whole length (prompt + max_new_tokens)
when admitted, so a running request never runs out of cache mid-generation; a request that cannot
fit even into an empty cache fails alone with OutOfPagesError, the others go on. Finished requests
return their pages at once.

Requests are checked when they arrive — an empty prompt, a token id outside the vocabulary, or a
prompt + max_new_tokens over max_seq_len fails that request alone, with a message naming the value
and the limit, before it reaches the model. If a model step raises anyway, the requests of that
step fail with the error, every other request of the run is cancelled, and all their pages are
returned before the error propagates: nothing leaks.

Generation stops at the model's end-of-sequence token(s) by default, as HF `generate` does
(`SamplingParams(ignore_eos=True)` opts out; an explicit `eos_token_id` replaces the model's).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .errors import CapacityError, OutOfPagesError, RequestError
from .page_allocator import PageAllocator
from .sampling import SamplingParams, sample
from .sequence_info import SequenceInfo, StepSequence


class StepRunner(Protocol):
    """What the engine steps: ModelRunner implements it (tests may use a fake)."""

    seq_info: SequenceInfo

    def step(self, seqs: Sequence[StepSequence], pages_of: Callable[[int], Sequence[int]]
             ) -> tuple[list[int], torch.Tensor]:
        """Run one step; (sequence ids in flat-batch order, next-token logits [num_seqs, V])."""
        ...


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: Optional[str] = None  # "length" | "stop" | "error" | "cancelled"
    error: Optional[str] = None
    generator: Optional[torch.Generator] = None
    stop_ids: frozenset[int] = frozenset()

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def total_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


@dataclass
class StepStats:
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int


class GenerationEngine:
    def __init__(self, runner: StepRunner, allocator: PageAllocator, *, vocab_size: Optional[int] = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.runner = runner
        self.seq_info = runner.seq_info
        self.allocator = allocator
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: pages reserved, prefilling or decoding
        self.done: dict[int, Request] = {}
        self.steps: list[StepStats] = []

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as ints, or an error naming the value and the limit it breaks. Changes nothing."""
        try:
            prompt = [int(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise RequestError(f"prompt must be a sequence of integer token ids: {exc}") from None
        if not prompt:
            raise RequestError("empty prompt: give at least one token")
        if self.vocab_size is not None:
            for i, t in enumerate(prompt):
                if not 0 <= t < self.vocab_size:
                    raise RequestError(
                        f"token id {t} at prompt position {i} is outside the model's vocabulary "
                        f"[0, {self.vocab_size}); vocab_size={self.vocab_size}."
                    )
        limit = self.seq_info.max_seq_len
        if len(prompt) + params.max_new_tokens > limit:
            raise CapacityError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                f"{len(prompt) + params.max_new_tokens}, over max_seq_len={limit}."
            )
        return prompt

    def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queue a request (raises RequestError / CapacityError if it is invalid); returns its id."""
        prompt = self.validate(prompt, params)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(next(self._ids), prompt, params, generator=gen,
                      stop_ids=frozenset(params.stop_ids(self.eos_token_ids)))
        self.waiting.append(req)
        return req.id

    def reject(self, prompt: Sequence[int], params: SamplingParams, error: str) -> int:
        """Record a request that failed validation (it never queues); returns its id."""
        try:
            kept = [int(t) for t in prompt]
        except (TypeError, ValueError):
            kept = []
        req = Request(next(self._ids), kept, params, finish_reason="error", error=error)
        self.done[req.id] = req
        return req.id

    def cancel(self, request_id: int, reason: str = "cancelled") -> bool:
        """Finish a waiting or running request now and return its pages; False if it is not active."""
        for r in list(self.waiting):
            if r.id == request_id:
                self.waiting.remove(r)
                self._finish(r, "cancelled", error=reason)
                return True
        for r in self.running:
            if r.id == request_id:
                self._finish(r, "cancelled", error=reason)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.seq_info.max_batch_size:
            req = self.waiting[0]
            try:
                self.allocator.ensure(req.id, req.total_len)
            except OutOfPagesError as exc:
                if self.running:
                    return  # wait for running requests to free pages (FIFO: no overtaking)
                self.waiting.popleft()
                self._finish(req, "error", error=str(exc))
                continue
            self.waiting.popleft()
            self.running.append(req)

    def _schedule(self) -> list[tuple[Request, list[int]]]:
        budget = self.seq_info.max_num_tokens
        batch: list[tuple[Request, list[int]]] = []
        decoding = [r for r in self.running if r.num_cached >= len(r.prompt)]
        prefilling = [r for r in self.running if r.num_cached < len(r.prompt)]
        for r in decoding:
            if budget == 0:
                break
            batch.append((r, [r.tokens[-1]]))
            budget -= 1
        for r in prefilling:
            if budget == 0:
                break
            chunk = r.prompt[r.num_cached : r.num_cached + budget]
            batch.append((r, chunk))
            budget -= len(chunk)
        return batch

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[tuple[int, int]]:
        """Run one engine step; returns the (request id, new token) pairs sampled in it."""
        self._admit()
        batch = self._schedule()
        if not batch:
            return []
        by_id = {r.id: (r, toks) for r, toks in batch}
        seqs = [StepSequence(r.id, toks, r.num_cached) for r, toks in batch]
        try:
            order, rows = self.runner.step(seqs, self.allocator.pages_of)
            last = rows.float().cpu()
        except Exception as exc:
            for r, _ in batch:  # their cache content is now unknown: fail them, keep the rest
                self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")
            raise
        info = self.seq_info
        self.steps.append(StepStats(info.num_prefill_tokens, info.num_decode_seqs, len(order)))
        out: list[tuple[int, int]] = []
        for b, rid in enumerate(order):
            r, toks = by_id[rid]
            r.num_cached += len(toks)
            if r.num_cached < len(r.prompt):
                continue  # mid-prompt chunk: nothing to sample yet
            tok = sample(last[b], r.params, r.generator)
            r.generated.append(tok)
            out.append((r.id, tok))
            if tok in r.stop_ids:
                self._finish(r, "stop")
            elif len(r.generated) >= r.params.max_new_tokens:
                self._finish(r, "length")
        return out

    def _finish(self, r: Request, reason: str, error: Optional[str] = None) -> None:
        r.finish_reason, r.error = reason, error
        self.allocator.free(r.id)
        if r in self.running:
            self.running.remove(r)
        self.done[r.id] = r

    def run(
        self,
        prompts: Iterable[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        on_tokens: Optional[Callable[[list[tuple[int, int]]], None]] = None,
    ) -> list[Request]:
        """Generate for all prompts (continuous batching); results in prompt order.

        A prompt that fails validation becomes a request finished with `finish_reason="error"` and
        the reason in `error`; the others run. If a step raises, every unfinished request of this
        run is finished (error or cancelled) and its pages returned before the error propagates."""
        prompts = list(prompts)
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = []
        for p, sp in zip(prompts, plist):
            try:
                ids.append(self.add_request(p, sp))
            except ValueError as exc:  # RequestError, CapacityError
                ids.append(self.reject(p, sp, str(exc)))
        try:
            while any(i not in self.done for i in ids):
                new = self.step()
                if on_tokens is not None and new:
                    on_tokens(new)
        except BaseException as exc:
            for i in ids:
                if i not in self.done:
                    self.cancel(i, reason=f"cancelled: the run stopped ({type(exc).__name__}: {exc})")
            raise
        return [self.done[i] for i in ids]
