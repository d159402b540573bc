"""Generation engine: continuous batching over the paged cache (DESIGN §1, §7), with the host's
work for the next step overlapped with the device's work on the current one.

Every step mixes work: running sequences decode one token each (scheduled first: they hold pages
and latency matters), then waiting prompts prefill in chunks that fill the rest of the
`max_num_tokens` budget. A request reserves pages for its whole length (prompt + max_new_tokens)
when admitted, so a running request never runs out of cache mid-generation; a request that cannot
fit even into an empty cache fails alone with OutOfPagesError, the others go on. Finished requests
return their pages at once.

Overlap (`overlap=True`, the default). The runner's `launch` queues a whole step on the device —
metadata copy, backend prepare, the graph, sampling, and an async copy of the sampled ids to the
host — without waiting. The engine then schedules and launches the next step *before* it waits for
the current one's ids: a decode token sampled by a step still in flight is taken from the device
(`StepSequence.src_row`), so scheduling, metadata building and FlashInfer planning run while the GPU
computes, and each step costs one host wait (`collect`). A request that stops at a stop token in
step i has one token of step i+1 computed for nothing; it is discarded. Freeing its pages at once
is safe: every later use of those pages is queued on the same stream after step i+1.

Requests are checked when they arrive — an empty prompt, a token id outside the vocabulary, or a
prompt + max_new_tokens over max_seq_len fails that request alone, with a message naming the value
and the limit, before it reaches the model. If a model step raises anyway, the requests of that
step fail with the error, every other request of the run is cancelled, and all their pages are
returned before the error propagates: nothing leaks.

Generation stops at the model's end-of-sequence token(s) by default, as HF `generate` does
(`SamplingParams(ignore_eos=True)` opts out; an explicit `eos_token_id` replaces the model's).

Logprobs. A request with `params.logprobs` gets one `TokenLogprobs` per generated token in
`Request.logprobs`, appended with the token. One with `params.prompt_logprobs` gets
`Request.prompt_logprobs`, one entry per prompt token (the first None), complete by the time its
first generated token is appended: its prefill chunks ask for every token's logits row, and since
a step returns at most max_batch_size rows, such a chunk is capped to the rows the step has left
(a long prompt scored this way prefills in chunks of at most max_batch_size tokens).

Several choices of one prompt (`add_group`, OpenAI's `n`). Choice 0 prefills normally. Each other
choice shares choice 0's full prompt pages (reference-counted in the PageAllocator) and prefills
only the tail after them, at least one token, so that it samples its first token from its own
logits. It is admitted only once choice 0's writes of those pages are queued (a step launched
before this one: the same stream orders the reads after the writes, as for the overlap above), and
reserves only the pages it does not share. Choices are requests of their own: each can be cancelled
alone, and fails or finishes alone. A choice whose choice 0 ended before it could share (cancelled,
failed, or finished early) prefills its whole prompt itself. Shared pages stay until their last
holder ends; choice 0 ending after the others took its pages changes nothing for them.

Automatic prefix caching (`prefix_caching=True`, docs/prefix_caching.md). Each request's full
prompt pages get keys when it is queued (runtime/prefix_cache.py: chained sha256, off the step's
critical path). At admission it takes the longest run of cached pages among its full pages before
its last prompt token (`PageAllocator.take_prefix`; shared and refcounted), so it always prefills
at least its last token (its logits) and never writes a page it shares; prefill starts after them
(`Request.cached_tokens`). Its own full prompt pages are registered when the step that wrote their
last token COMPLETES (`_complete`, before that step's tokens can finish the request), never when
it is merely queued: a request that takes a cached page reads it in its next launched step, which
is then ordered after every write of that page. A waiting request whose next uncached page is being
written by a running request (`_writing`) waits for it (FIFO, as a choice waits for choice 0):
requests that arrive together with one system prompt prefill it once, not once each. Pages whose
holders all ended stay cached and count as free; the allocator evicts them least-recently-released
when pages are needed. A request that asks for prompt logprobs takes nothing from the cache (it
needs every prompt row's logits) but caches its pages for others. Every decision is a function of the request stream and of the order
in which steps complete (the same on every tensor-parallel rank), never of timing or of a
per-process hash salt.

Data-parallel attention (`lockstep`, runtime/data_parallel.py). Each rank's engine runs its own
requests, but every forward step calls the experts' all-to-all, so before each step the ranks agree
(one host all-reduce of "I have a batch", "I have work", "I failed" and its step's size): when some
rank has a batch, every rank runs one forward — its batch, or an idle step (`StepRunner.idle_step`)
— padded to the largest rank's size (the experts' dispatch needs the same row count everywhere);
when no rank has work, `run` returns on every rank at the same step; when one failed, `run` raises
on every rank at the same step (the failing rank its error, the others `PeerRankFailed`). With
`lockstep` None (tensor-parallel attention, one process) nothing of this runs: no collective, no
change.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

import torch

from .data_parallel import Lockstep, PeerRankFailed, StepAgreement
from .errors import CapacityError, OutOfPagesError, RequestError
from .page_allocator import PageAllocator
from .prefix_cache import page_keys
from .sampling import PromptRows, RowSpec, SamplingParams, StepOutput, TokenLogprobs
from .sequence_info import SequenceInfo, StepSequence


class StepRunner(Protocol):
    """What the engine steps: ModelRunner implements it."""

    seq_info: SequenceInfo

    def launch(self, seqs: Sequence[StepSequence], pages_of: Callable[[int], Sequence[int]],
               specs: Mapping[int, RowSpec], prompt_rows: Optional[Mapping[int, PromptRows]] = None,
               pad_to: Optional[int] = None) -> Any: ...

    def collect(self, launched: Any) -> StepOutput: ...

    def release(self, seq_id: int) -> None:
        """The request `seq_id` ended: per-request runner state (the sampler's) may be reused."""

    def idle_step(self, pad_to: Optional[int] = None) -> None:
        """Data-parallel attention only: one forward with nothing of this rank's to run, so that this
        rank takes part in the step's collectives (ModelRunner.idle_step), padded to `pad_to` tokens."""

    def step_size(self, seqs: Sequence[StepSequence]) -> int:
        """Data-parallel attention only: the token count a step of `seqs` runs as (its CUDA-graph
        bucket, else its tokens), what the lock-step's agreement compares across ranks."""


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int = 0
    generated: list[int] = field(default_factory=list)
    num_scheduled: int = 0  # tokens of the sequence queued so far (in the cache, or being written)
    pending: int = 0  # tokens sampled by steps still in flight
    finish_reason: Optional[str] = None  # "length" | "stop" | "error" | "cancelled"
    error: Optional[str] = None
    stop_ids: frozenset[int] = frozenset()
    #: one per generated token (params.logprobs set), aligned with `generated`
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: one per prompt token (params.prompt_logprobs set), the first None; complete once the first
    #: generated token is appended
    prompt_logprobs: list[Optional[TokenLogprobs]] = field(default_factory=list)
    choice: int = 0  # index in its group (add_group)
    #: choice 0 of its group, whose full prompt pages this choice shares, until its first token
    #: (None: it prefills alone, or has its first token)
    leader: Optional["Request"] = field(default=None, repr=False, compare=False)
    shared_tokens: int = 0  # prompt tokens whose cache pages it shares with choice 0 (0: none)
    #: prompt tokens it did not prefill: taken from the prefix cache, or shared with choice 0
    cached_tokens: int = 0
    #: prefix-cache keys of its full prompt pages (empty with prefix caching off)
    page_keys: list[bytes] = field(default_factory=list, repr=False, compare=False)
    num_registered: int = 0  # of those pages, how many it has offered to the prefix cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def total_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def num_cached(self) -> int:
        """Tokens of the sequence in the cache once the steps in flight are done."""
        return self.num_scheduled


@dataclass
class StepStats:
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    device_ms: Optional[float] = None  # set when the step completes, if the runner times steps


@dataclass
class _InFlight:
    launched: Any
    rows: dict[int, tuple[Request, bool]]  # seq id -> (request, whether this step samples for it)
    stats: Optional[StepStats] = None
    prompt_at: dict[int, int] = field(default_factory=dict)  # seq id -> prompt index of its first scored row
    #: seq id -> the sequence's length once this step's writes land, for sequences prefilling
    prompt_end: dict[int, int] = field(default_factory=dict)


class GenerationEngine:
    def __init__(self, runner: StepRunner, allocator: PageAllocator, *, vocab_size: Optional[int] = None,
                 eos_token_ids: Sequence[int] = (), overlap: bool = True, prefix_caching: bool = True,
                 cache_identity: bytes = b"", lockstep: Optional[Lockstep] = None) -> None:
        """`prefix_caching`: take and offer cached prompt pages (module docstring). `cache_identity`:
        the digest that roots every page key (`prefix_cache.cache_identity`: model, cache dtypes and
        scales, page size); engines over one allocator must pass the same one for the same cache.
        `lockstep`: data-parallel attention's per-step agreement of the ranks (module docstring)."""
        self.lockstep = lockstep
        #: lock-step: the size the last agreement padded every rank's step to (None: no lock-step)
        self._pad_to: Optional[int] = None
        #: lock-step: whether some rank still had work at the last agreement (True until one says not)
        self.peers_busy = lockstep is not None
        #: lock-step: this rank wants to stop (a serving core shutting down; sent with each agreement)
        self.leaving = False
        #: lock-step: the last agreement (None before the first)
        self.last_agreement: Optional[StepAgreement] = None
        #: lock-step: forwards run for another rank's sake (nothing of this rank's to run)
        self.idle_steps = 0
        self.runner = runner
        self.prefix_caching = prefix_caching
        self.cache_identity = cache_identity
        #: prompt tokens of the requests admitted with prefix caching on, and how many came from the cache
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: key of a full prompt page -> the running request that writes it, until it is cached
        self._writing: dict[bytes, Request] = {}
        self.seq_info = runner.seq_info
        self.allocator = allocator
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.overlap = overlap
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: pages reserved, prefilling or decoding
        self.done: dict[int, Request] = {}
        self._active: dict[int, Request] = {}  # waiting or running, by id
        self.steps: list[StepStats] = []
        self._inflight: Optional[_InFlight] = None
        #: device time of the completed steps, when the runner times them (ModelRunner.time_steps)
        self.gpu_busy_ms = 0.0
        #: called with each step's new (request id, token) pairs, and with each finished request
        self.on_finish: Optional[Callable[[Request], None]] = None

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
            for t, _ in params.logit_bias:
                if t >= self.vocab_size:
                    raise RequestError(
                        f"logit_bias token id {t} is outside the model's vocabulary [0, {self.vocab_size}); "
                        f"vocab_size={self.vocab_size}."
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
        return self._queue(self.validate(prompt, params), params).id

    def add_group(self, prompt: Sequence[int], params: SamplingParams, n: int) -> list[int]:
        """Queue `n` choices of one prompt (OpenAI's `n`); returns their ids, choice 0 first.

        Choice i samples with seed `params.seed + i` when a seed is given (vLLM's convention: the
        group is reproducible and its choices differ), else with a seed of its own drawn from the
        process RNG. The choices share the prompt's prefill (module docstring). Validation as
        `add_request`, plus n >= 1 and the seeds' range; nothing is queued if it fails."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(f"n={n!r}: the number of choices must be an integer >= 1")
        prompt = self.validate(prompt, params)
        if params.seed is not None and params.seed + n - 1 >= 2**63:
            raise RequestError(f"seed={params.seed} with n={n}: choice i uses seed + i, which must stay below 2**63")
        ps = self.allocator.page_size
        shared = (len(prompt) - 1) // ps * ps  # full pages, leaving each choice >= 1 token to prefill
        leader = self._queue(prompt, params)
        ids = [leader.id]
        for i in range(1, n):
            p = params if params.seed is None else replace(params, seed=params.seed + i)
            req = self._queue(prompt, p, choice=i)
            if shared:
                req.leader, req.shared_tokens = leader, shared
            ids.append(req.id)
        return ids

    def _queue(self, prompt: list[int], params: SamplingParams, choice: int = 0) -> Request:
        # Unseeded requests draw a seed from the process RNG (identically seeded on every TP rank).
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        req = Request(next(self._ids), prompt, params, seed=seed,
                      stop_ids=frozenset(params.stop_ids(self.eos_token_ids)), choice=choice)
        if self.prefix_caching:
            req.page_keys = page_keys(prompt, self.allocator.page_size, self.cache_identity)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt)
        self.waiting.append(req)
        self._active[req.id] = req
        return req

    def request(self, request_id: int) -> Request:
        """The request `request_id`, waiting, running or done (its tokens and logprobs so far)."""
        req = self._active.get(request_id) or self.done.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id} in this engine")
        return req

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
        """Finish a waiting or running request now and return its pages; False if it is not active.
        A step in flight that holds it still completes; its token for this request is discarded."""
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
        return bool(self.waiting or self.running or self._inflight)

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.seq_info.max_batch_size:
            req = self.waiting[0]
            lead = req.leader
            if lead is not None:
                if lead.finished:  # choice 0 ended before this choice could share: prefill alone
                    req.leader, req.shared_tokens = None, 0
                    lead = None
                elif lead.num_scheduled < req.shared_tokens:
                    return  # choice 0's writes of the shared pages are not all queued yet (FIFO: wait)
            ps = self.allocator.page_size
            takes = lead is None and self.prefix_caching and req.params.prompt_logprobs is None
            if takes:
                # full pages before the last prompt token: it prefills >= 1 token, writes none of them
                keys = req.page_keys[: (len(req.prompt) - 1) // ps]
                hit = self.allocator.match_prefix(keys)
                if hit < len(keys) and keys[hit] in self._writing:
                    return  # a running request is writing its next page: take it once cached (FIFO: wait)
            cached = 0
            try:
                if lead is not None:
                    self.allocator.fork(req.id, lead.id, req.shared_tokens // ps)
                    cached = req.shared_tokens
                elif takes:
                    cached = self.allocator.take_prefix(req.id, keys) * ps
                self.allocator.ensure(req.id, req.total_len)
            except OutOfPagesError as exc:
                self.allocator.free(req.id)  # a fork's / the cache's references go back
                if self.running:
                    return  # wait for running requests to free pages (FIFO: no overtaking)
                self.waiting.popleft()
                self._finish(req, "error", error=str(exc))
                continue
            req.num_scheduled = req.cached_tokens = cached  # the shared / cached pages hold these tokens
            if self.prefix_caching:
                if lead is None:
                    self.prefix_queries += len(req.prompt)
                    self.prefix_hits += cached
                for k in req.page_keys[cached // ps :]:
                    self._writing.setdefault(k, req)
            self.waiting.popleft()
            self.running.append(req)

    def _schedule(self) -> list[tuple[Request, StepSequence, bool]]:
        """The next step: (request, its share, whether the step samples a token for it).

        Two budgets: tokens (max_num_tokens) and logits rows (max_batch_size: one per sequence,
        or one per new token of a prefill chunk that scores its prompt, which leaves a row to each
        prompt after it, so that it does not hold back their prefill)."""
        budget = self.seq_info.max_num_tokens
        rows = self.seq_info.max_batch_size
        out: list[tuple[Request, StepSequence, bool]] = []
        prev = self._inflight.rows if self._inflight is not None else {}
        prev_row = {sid: b for b, sid in enumerate(self._inflight.launched.order)} if self._inflight else {}
        for r in self.running:
            if budget == 0:
                break
            if r.num_scheduled < len(r.prompt) or len(r.generated) + r.pending >= r.params.max_new_tokens:
                continue
            if r.pending:  # its last token is being sampled by the step in flight: take it on the device
                assert r.id in prev and prev[r.id][1]
                seq = StepSequence(r.id, [0], r.num_scheduled, src_row=prev_row[r.id])
            else:
                seq = StepSequence(r.id, [r.tokens[-1]], r.num_scheduled)
            out.append((r, seq, True))
            budget -= 1
            rows -= 1
        prefilling = [r for r in self.running if r.num_scheduled < len(r.prompt)]
        for i, r in enumerate(prefilling):
            if budget == 0 or rows == 0:
                break
            scores = r.params.prompt_logprobs is not None
            # a scoring chunk leaves a row to each prompt after it (they need one each)
            n = min(budget, max(1, rows - (len(prefilling) - i - 1))) if scores else budget
            chunk = r.prompt[r.num_scheduled : r.num_scheduled + n]
            ends_prompt = r.num_scheduled + len(chunk) == len(r.prompt)
            out.append((r, StepSequence(r.id, chunk, r.num_scheduled, all_logits=scores), ends_prompt))
            budget -= len(chunk)
            rows -= len(chunk) if scores else 1
        return out

    # ------------------------------------------------------------------ stepping
    def _next_batch(self) -> list[tuple[Request, StepSequence, bool]]:
        self._admit()
        return self._schedule()

    def _agree(self, batch: list) -> None:
        """Lock-step (data-parallel attention): agree with the other ranks; run an idle forward when
        another rank runs a step and this one has nothing to run. No-op without `lockstep`."""
        if self.lockstep is None:
            return
        size = self.runner.step_size([seq for _, seq, _ in batch]) if batch else 0
        agreed = self.lockstep.agree(bool(batch), self.has_work(), tokens=size, staying=not self.leaving)
        self.last_agreement = agreed
        if agreed.any_failed:  # another rank failed: stop here too (run() cancels this rank's requests)
            raise PeerRankFailed(self.lockstep.rank, self.lockstep.failures(None))
        self.peers_busy = agreed.any_work
        self._pad_to = agreed.tokens or None  # every rank's step runs as the largest rank's size
        if agreed.any_batch and not batch:
            self.runner.idle_step(pad_to=self._pad_to)
            self.idle_steps += 1

    def _launch(self, batch: Optional[list[tuple[Request, StepSequence, bool]]] = None) -> Optional[_InFlight]:
        if batch is None:
            batch = self._next_batch()
        if not batch:
            return None
        specs = {r.id: RowSpec.of(r.params, r.seed, len(r.generated) + r.pending, r.id, r.prompt)
                 for r, _, samples in batch if samples}
        prompt_rows: dict[int, PromptRows] = {}
        prompt_at: dict[int, int] = {}
        for r, seq, _ in batch:
            if seq.all_logits and r.params.prompt_logprobs is not None:
                at = seq.num_cached + 1  # row j predicts prompt[num_cached + 1 + j]; past the prompt: the sample
                prompt_rows[r.id] = PromptRows(r.prompt[at : at + len(seq.token_ids)], r.params.prompt_logprobs)
                prompt_at[r.id] = at
        try:
            pad = {"pad_to": self._pad_to} if self.lockstep is not None else {}
            launched = self.runner.launch([seq for _, seq, _ in batch], self.allocator.pages_of, specs,
                                          prompt_rows=prompt_rows or None, **pad)
        except Exception as exc:
            for r, _, _ in batch:  # their cache content is now unknown: fail them, keep the rest
                self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")
            raise
        for r, seq, samples in batch:
            r.num_scheduled += len(seq.token_ids)
            r.pending += int(samples)
        stats = StepStats(launched.num_prefill_tokens, launched.num_decode_seqs, len(batch))
        self.steps.append(stats)
        prompt_end = {r.id: r.num_scheduled for r, seq, _ in batch if seq.num_cached < len(r.prompt)}
        return _InFlight(launched, {r.id: (r, samples) for r, _, samples in batch}, stats, prompt_at, prompt_end)

    def _register_written(self, step: _InFlight) -> None:
        """Offer the prompt pages this completed step filled to the prefix cache (before its tokens
        can finish a request and free them). A request cancelled meanwhile offers nothing: its pages
        went back when it was cancelled."""
        ps = self.allocator.page_size
        for sid, end in step.prompt_end.items():
            r = step.rows[sid][0]
            full = min(end, len(r.prompt)) // ps
            if r.finished or full <= r.num_registered:
                continue
            self.allocator.register(r.id, r.page_keys[r.num_registered : full], r.num_registered)
            self._done_writing(r, full)
            r.num_registered = full

    def _done_writing(self, r: Request, upto: Optional[int] = None) -> None:
        """`r` writes none of its prompt pages before `upto` (default: any) any more."""
        for k in r.page_keys[r.num_registered : upto]:
            if self._writing.get(k) is r:
                del self._writing[k]

    def _complete(self, step: _InFlight) -> list[tuple[int, int]]:
        try:
            result = self.runner.collect(step.launched)
        except Exception as exc:
            for r, _ in step.rows.values():
                if not r.finished:
                    self._finish(r, "error", error=f"{type(exc).__name__}: {exc}")
            raise
        device_ms = getattr(step.launched, "device_ms", None)
        if device_ms is not None and (ms := device_ms()) is not None:
            self.gpu_busy_ms += ms
            if step.stats is not None:
                step.stats.device_ms = ms
        if self.prefix_caching:
            self._register_written(step)
        for sid, scored in result.prompt_logprobs.items():  # before the tokens: the last chunk's come first
            at = step.prompt_at[sid]
            step.rows[sid][0].prompt_logprobs[at : at + len(scored)] = scored
        out: list[tuple[int, int]] = []
        for sid, tok in zip(step.launched.order, result.ids):
            r, samples = step.rows[sid]
            if not samples:
                continue
            r.pending -= 1
            if r.finished:  # stopped or cancelled after this step was queued: its token is not used
                continue
            if r.leader is not None:  # its first token: the leader is needed no more
                if r.params.prompt_logprobs is not None:
                    n = r.shared_tokens + 1  # the leader scored the shared part, in an earlier step
                    r.prompt_logprobs[:n] = r.leader.prompt_logprobs[:n]
                r.leader = None
            if r.params.logprobs is not None:
                r.logprobs.append(result.logprobs[sid])
            r.generated.append(tok)
            out.append((r.id, tok))
            if tok in r.stop_ids:
                self._finish(r, "stop")
            elif len(r.generated) >= r.params.max_new_tokens:
                self._finish(r, "length")
        return out

    def step(self) -> list[tuple[int, int]]:
        """Advance by one step; returns the (request id, new token) pairs that became known.

        With overlap, this queues the next step and then completes the one in flight, so a step's
        tokens are returned by the call after the one that queued it.

        With `lockstep` (data-parallel attention) every rank must call it equally often: it agrees
        with the others first and may run an idle forward (module docstring)."""
        batch = self._next_batch()
        self._agree(batch)
        if not self.overlap:
            launched = self._launch(batch)
            return self._complete(launched) if launched is not None else []
        nxt = self._launch(batch)
        prev, self._inflight = self._inflight, nxt
        return self._complete(prev) if prev is not None else []

    def _finish(self, r: Request, reason: str, error: Optional[str] = None) -> None:
        r.finish_reason, r.error = reason, error
        if r.page_keys:
            self._done_writing(r)
        self.allocator.free(r.id)
        self.runner.release(r.id)
        if r in self.running:
            self.running.remove(r)
        self._active.pop(r.id, None)
        self.done[r.id] = r
        if self.on_finish is not None:
            self.on_finish(r)

    def abandon_inflight(self, error: str) -> None:
        """After a failed step: fail the requests of the step still in flight (its results are not
        trusted) and forget it, so the engine can go on with the others."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        for r, _ in step.rows.values():
            if not r.finished:
                self._finish(r, "error", error=error)

    def drain(self) -> None:
        """Complete the step in flight (its tokens are applied; nothing new is queued)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._complete(step)

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
        if self.lockstep is not None:
            self.peers_busy = True  # every rank steps until an agreement says no rank has work
        try:
            while any(i not in self.done for i in ids) or (self.lockstep is not None and self.peers_busy):
                new = self.step()
                if on_tokens is not None and new:
                    on_tokens(new)
                if not new and self._inflight is None and not self.waiting and not self.running:
                    stuck = [i for i in ids if i not in self.done]
                    if stuck:  # (none: the last ones failed at admission, e.g. too big for the cache)
                        raise RuntimeError(f"engine stalled with requests {stuck} unfinished and nothing to run")
            self.drain()
        except BaseException as exc:
            self._inflight = None
            # peers_busy False: the last agreement said no rank has work, so the others have left their
            # loops and make no further agreement to meet (an error in the final drain stays this rank's)
            if self.lockstep is not None and self.peers_busy and not isinstance(exc, PeerRankFailed):
                try:  # tell the other ranks, at their next agreement, instead of leaving them waiting
                    self.lockstep.leave(f"{type(exc).__name__}: {exc}")
                except Exception as tell:  # noqa: BLE001 - the original error is the one to raise
                    exc.add_note(f"the other data-parallel ranks could not be told: {type(tell).__name__}: {tell}")
            for i in ids:
                if i not in self.done:
                    self.cancel(i, reason=f"cancelled: the run stopped ({type(exc).__name__}: {exc})")
            raise
        return [self.done[i] for i in ids]
