"""The messages between the API server process and the engine-core process (msgspec structs).

Both directions are typed: the API process sends requests, cancellations and the shutdown order
(`CoreInput`); the engine core answers with its start-up progress, one `Ready`, then exactly one
`StepOutputs` per engine step that produced anything (every request's new tokens and every request
that finished in that step, never one message per token), and `CoreFailed` if it dies of an error.
Tagged array-like structs keep a 64-request step message a few hundred bytes, and decoding them
validates types (a `SamplingParams` is re-checked by its own `__post_init__` on the engine side).
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from ..runtime.sampling import SamplingParams


# ----------------------------------------------------------------------------- API -> engine core
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """One HTTP request's prompt, run as `len(ids)` choices (n > 1 share the prompt's prefill).
    `ids` are the API process's request ids, one per choice."""

    ids: list[int]
    prompt: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Cancel these requests (client gone, stop string seen); their pages come back at once."""

    ids: list[int]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Take no new requests; let running ones finish for `drain_s` seconds, cancel the rest, exit."""

    drain_s: float


CoreInput = Union[AddRequest, AbortRequests, Shutdown]


# ----------------------------------------------------------------------------- engine core -> API
class Logprob(msgspec.Struct, array_like=True):
    """A token's log-probability and the most likely alternatives (id, logprob), descending."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class TokenOut(msgspec.Struct, array_like=True):
    """One new token of request `id`; `logprob` when the request asked for logprobs;
    `prompt_logprobs` (one per prompt token, the first None) with a request's first token when it
    asked for them (echo); `cached_tokens` with a request's first token: its prompt tokens taken
    from the prefix cache (or shared with choice 0), which it did not prefill (usage)."""

    id: int
    token: int
    logprob: Optional[Logprob] = None
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None
    cached_tokens: Optional[int] = None


class Finished(msgspec.Struct, array_like=True):
    """Request `id` ended: "length" | "stop" | "error" | "cancelled" (error: why)."""

    id: int
    reason: str
    error: Optional[str] = None


class EngineStats(msgspec.Struct, array_like=True):
    """The engine after a step. `pages_used` counts pages requests hold (cached pages no request
    holds are free); prefix_* are running totals in prompt tokens (the metrics' counters)."""

    running: int
    waiting: int
    pages_used: int
    pages_total: int
    pages_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    tokens: list[TokenOut]
    finished: list[Finished]
    stats: EngineStats
    rank: int = 0  # the data-parallel rank whose engine stepped (its stats are that rank's)


class ModelInfo(msgspec.Struct):
    """What the API process needs to validate requests and describe the model."""

    vocab_size: int
    max_seq_len: int
    max_batch_size: int
    eos_token_ids: list[int]
    pages_total: int  # usable cache pages
    device: str
    dtype: str
    startup: dict[str, object]  # the start-up phases (seconds), as the build report has them


class Progress(msgspec.Struct, tag="progress", array_like=True):
    """A start-up phase finished (for the server log)."""

    message: str


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: ModelInfo
    rank: int = 0  # data-parallel serving: every rank reports it; the server is ready when all have


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine core stopped on an error (at start-up or in its loop); `error` says what."""

    error: str
    rank: int = 0


class Stopped(msgspec.Struct, tag="stopped", array_like=True):
    """The engine core finished its shutdown; `pages_leaked` pages were still held (should be 0)."""

    pages_leaked: int
    rank: int = 0


CoreOutput = Union[StepOutputs, Progress, Ready, CoreFailed, Stopped]
