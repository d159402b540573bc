"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, penalties, logit bias and
logprobs — batched, on the device.

`BatchSampler.run(rows, specs)` turns a step's next-token logits `[B, V]` (on the GPU) into `B`
token ids on the same device; only those ids (and, when asked for, the logprob results) cross to
the host, in the one copy per step the model runner makes. One set of tensor ops serves the whole
batch, whatever mix of requests it holds; work that no row of the step needs is not launched (a
step of plain greedy rows is one argmax, as it always was).

Per row, in this order (the order of HF `generate` and vLLM):

1. raw logits;
2. repetition penalty (HF / vLLM semantics, over the prompt AND the tokens generated so far): a
   seen token's logit is divided by p if it is > 0, multiplied by p if it is < 0;
3. frequency and presence penalties (OpenAI semantics, over the GENERATED tokens only):
   `logit -= frequency_penalty * count + presence_penalty * (count > 0)`;
4. logit bias: `logit += bias` for the request's (token id, bias) entries;
5. temperature: greedy rows (temperature 0) take the argmax of the logits processed so far;
   sampled rows divide by the temperature;
6. top-k, then top-p filtering, then the draw: the Gumbel-max trick, `argmax(logits / T + g)`,
   over the candidates left (logits sorted once per step only when some row filters). The Gumbel
   noise `g` comes from a counter-based hash of (request seed, token index within the request,
   vocab id): no random generator state, so a seeded request draws the same tokens whatever else is
   in its batch, on any device, and no per-request generator has to be kept or launched. Requests
   without a seed get one drawn from the process RNG when they are added (so tensor-parallel ranks,
   seeded identically, agree).

Logprobs of generated tokens (`SamplingParams.logprobs`) are "processed" logprobs:
`log_softmax(logits after steps 1-4 / T)`, T the temperature (1 for greedy rows), taken BEFORE the
top-k / top-p truncation, so every candidate, the chosen one included, has a finite logprob (vLLM
documents the same choice as its `processed_logprobs` mode). Prompt logprobs
(`SamplingParams.prompt_logprobs`, echo) score the prompt with the model's own distribution:
`log_softmax(raw logits)`, no penalties, bias or temperature (vLLM's prompt logprobs are raw too):
the penalties are defined over the continuation, and scoring a prompt (loglikelihood evaluation)
asks what the model predicts.

Per-request state. Penalties need each request's token counts across steps, also when the engine
queues step i+1 before step i's ids reach the host; they live on the device, in `SamplerState`
(runtime/sampling_state.py), one slot per request that needs them, allocated only when such a
request first samples and updated on the device right after each draw.

`target_probs` / `target_logprobs` are the distribution a row samples from and its logprobs,
written out plainly on the host; the tests check the sampler against them.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from .sampling_state import MAX_LOGIT_BIAS, SamplerState

MAX_LOGPROBS = 20  # most likely alternatives per token (OpenAI's top_logprobs limit)
PENALTY_LIMIT = 2.0  # presence / frequency penalties lie in [-2, 2]
BIAS_LIMIT = 100.0  # a logit bias lies in [-100, 100]


def _normalise_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as ((token id, bias), ...): from pairs or a mapping; checked against the limits."""
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(items)} entries, over the limit of {MAX_LOGIT_BIAS}")
    out: list[tuple[int, float]] = []
    seen: set[int] = set()
    for item in items:
        try:
            tok, val = item
            if isinstance(tok, bool):
                raise TypeError
            tok = operator.index(tok)
            val = float(val)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entry {item!r}: expected (token id, bias) with an integer id "
                             "and a number") from None
        if tok < 0:
            raise ValueError(f"logit_bias: token id {tok} is negative")
        if not -BIAS_LIMIT <= val <= BIAS_LIMIT:
            raise ValueError(f"logit_bias: bias {val} for token {tok} is outside [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]")
        if tok in seen:
            raise ValueError(f"logit_bias: token id {tok} appears twice; give each token one bias")
        seen.add(tok)
        out.append((tok, val))
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples, what it reports, and when it stops.

    Generation stops at `max_new_tokens`, at any of `stop_token_ids`, and at the end-of-sequence
    token: `eos_token_id` if given, else the model's own (as HF `generate` does); `ignore_eos=True`
    keeps going past it. The processing order and the logprob definitions are in the module
    docstring. `logit_bias` takes (token id, bias) pairs or a mapping; it is kept as a tuple of pairs.
    `logprobs` / `prompt_logprobs`: None = off; k in 0..20 = the chosen (or prompt) token's logprob
    plus the k most likely alternatives."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: Optional[int] = None
    eos_token_id: Optional[int | tuple[int, ...]] = None  # None: the model's
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2], over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2], over generated tokens
    repetition_penalty: float = 1.0  # > 0, over prompt and generated tokens; 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed}: must be in [0, 2**63)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise ValueError(f"{name}={v}: must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 = off)")
        rp = self.repetition_penalty
        if not (rp > 0 and math.isfinite(rp)):
            raise ValueError(f"repetition_penalty={rp}: must be a finite number > 0 (1 = off)")
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name}={k!r}: must be None (off) or an integer in [0, {MAX_LOGPROBS}] "
                                 "(how many most likely alternatives to return with each token)")
        # Worked out once: RowSpec.of asks for every row of every step.
        object.__setattr__(self, "_row_extras", self.penalized or bool(self.logit_bias) or self.logprobs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty applies (per-request device state)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def stop_ids(self, model_eos: tuple[int, ...] = ()) -> set[int]:
        """Token ids that finish the request: stop tokens, plus the eos token(s) unless ignore_eos."""
        ids = {int(t) for t in self.stop_token_ids}
        if not self.ignore_eos:
            eos = self.eos_token_id
            if eos is None:
                ids |= set(model_eos)
            else:
                ids |= {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}
        return ids


class TokenLogprobs(NamedTuple):
    """One token's logprob and the `k` most likely alternatives at its position, (id, logprob) in
    descending order (they may include the token itself)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class RowExtras(NamedTuple):
    """The optional part of a row: penalties, bias, logprobs, and for rows with penalties or bias
    the key of the request's device state (`key`, the request id) and its prompt (read once, when
    the state is set up: the request's first row, counter 0). Plain rows carry None instead, so
    the sampler tells them apart with one `is None` test a row."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: Optional[int] = None
    key: int = -1
    prompt: Sequence[int] = ()

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stateful(self) -> bool:
        """Whether the row reads per-request device state (penalties or a logit bias)."""
        return self.penalized or bool(self.logit_bias)


class RowSpec(NamedTuple):
    """What one row of a step samples with: its request's parameters, seed, the index of the token
    being drawn (the hash counter), and the optional extras (None on plain rows)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    counter: int
    extra: Optional[RowExtras] = None

    @classmethod
    def of(cls, params: SamplingParams, seed: int, counter: int, key: int = -1, prompt: Sequence[int] = ()
           ) -> "RowSpec":
        if not params._row_extras:  # type: ignore[attr-defined]
            return cls(params.temperature, params.top_k, params.top_p, seed, counter)
        return cls(params.temperature, params.top_k, params.top_p, seed, counter,
                   RowExtras(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                             params.logit_bias, params.logprobs, key, prompt))

    @property
    def stateful(self) -> bool:
        return self.extra is not None and self.extra.stateful

    @property
    def logprobs(self) -> Optional[int]:
        return None if self.extra is None else self.extra.logprobs


GREEDY = RowSpec(0.0, 0, 1.0, 0, 0)


class ScoredRows(NamedTuple):
    """Rows of `logits` scored with the raw model distribution (prompt logprobs): row `rows[j]`'s
    logprob of token `targets[j]`, and the `k` most likely alternatives."""

    logits: torch.Tensor
    rows: Sequence[int]
    targets: Sequence[int]
    k: int


class LogprobTensors(NamedTuple):
    """Logprob results on the device: one row per sampled row that asked for logprobs (`sampled`:
    their row indices in the batch, in order), then one per scored row. `top_*` are [L, K], K the
    largest k of the step (the host keeps each row's own k first)."""

    chosen: torch.Tensor  # [L] float32: logprob of the chosen / target token
    top_ids: torch.Tensor  # [L, K] int64
    top_vals: torch.Tensor  # [L, K] float32
    sampled: list[int]


class PromptRows(NamedTuple):
    """A sequence's prompt rows of one step (prompt logprobs): its first len(targets) logits rows
    are scored against `targets` (the prompt token after each row's position), with k alternatives.
    The sequence must ask for all its rows (`StepSequence.all_logits`)."""

    targets: Sequence[int]
    k: int


class StepOutput(NamedTuple):
    """A completed step on the host: one sampled id per sequence (flat order), the sampled token's
    logprobs for the sequences that asked (sequence id -> TokenLogprobs), and their prompt rows'
    (sequence id -> one TokenLogprobs per target, in order)."""

    ids: list[int]
    logprobs: dict[int, TokenLogprobs]
    prompt_logprobs: dict[int, list[TokenLogprobs]]


class SampleOutput(NamedTuple):
    ids: torch.Tensor  # [B] int64, on the rows' device
    logprobs: Optional[LogprobTensors]


# ----------------------------------------------------------------------------- the hash
_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32), exactly: split c so no product overflows int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + ((h * hi) & 0xFFFF) * 65536) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (values kept in [0, 2**32) in int64: shifts are logical)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, counter), int64 tensors (seed < 2**63)."""
    s = seeds & _M32
    s_hi = (seeds >> 32) & _M32
    h = _fmix32(s ^ _mul32(s_hi, 0x9E3779B9))
    h = _fmix32(h ^ _mul32(counters & _M32, 0x7FEB352D))
    return _fmix32(h ^ 0x68E31DA4)


def gumbel_noise(keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [B, V] (float32) from row keys [B] and vocab ids [V] (int64)."""
    h = _fmix32(keys[:, None] ^ _mul32(vocab_ids[None, :], 0x9E3779B9))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 random bits, in (0, 1)
    return -torch.log(-torch.log(u))


# ----------------------------------------------------------------------------- the math
def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted temperature-scaled logits with filtered-out candidates at -inf, their vocab ids), [B, V].

    Top-k keeps the k largest (k = 0: all); top-p then keeps the smallest prefix of the top-k
    distribution whose probability reaches top_p (the candidate that crosses it included)."""
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    vals, idx = scaled.sort(dim=-1, descending=True)
    vocab = vals.shape[-1]
    pos = torch.arange(vocab, device=vals.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    vals = vals.masked_fill(pos[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each candidate
    vals = vals.masked_fill(before > top_p[:, None], float("-inf"))
    return vals, idx


def processed_logits(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int] = (),
                     generated: Sequence[int] = ()) -> torch.Tensor:
    """The reference of steps 1-4 for one row [V] (float64), written out token by token: repetition
    penalty over prompt + generated, frequency / presence penalties over generated, logit bias."""
    x = logits.detach().double().cpu().clone()
    p = params.repetition_penalty
    if p != 1:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t, c in Counter(generated).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    for t, b in params.logit_bias:
        x[t] += b
    return x.to(logits.device)


def target_probs(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int] = (),
                 generated: Sequence[int] = ()) -> torch.Tensor:
    """The distribution one row [V] samples from (float64, on the row's device): the reference.
    `prompt` / `generated`: the request's tokens so far, for the penalties."""
    x = processed_logits(logits, params, prompt, generated)
    if params.greedy:
        out = torch.zeros_like(x)
        out[int(x.argmax())] = 1.0
        return out
    vals, idx = filtered_logits(x[None], torch.tensor([params.temperature], dtype=x.dtype, device=x.device),
                                torch.tensor([params.top_k], device=x.device),
                                torch.tensor([params.top_p], dtype=x.dtype, device=x.device))
    out = torch.zeros_like(x)
    out[idx[0]] = torch.softmax(vals[0], dim=-1)
    return out


def target_logprobs(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int] = (),
                    generated: Sequence[int] = ()) -> torch.Tensor:
    """The logprobs [V] (float64) the sampler reports for a row: log_softmax of the processed
    logits over the temperature (1 for greedy), before top-k / top-p."""
    x = processed_logits(logits, params, prompt, generated)
    return torch.log_softmax(x / (params.temperature if params.temperature > 0 else 1.0), dim=-1)


# ----------------------------------------------------------------------------- the sampler
@dataclass
class _Draw:
    """A step between its draw and its commit (the ids may be replaced by rank 0's under TP)."""

    ids: torch.Tensor
    logits: Optional[torch.Tensor] = None  # processed logits [B, V] (before temperature)
    temperature: Optional[torch.Tensor] = None  # [B] on the device
    slots: Optional[torch.Tensor] = None  # [B] state slot per row (counts to update), or None
    sampled_lp: list[int] = field(default_factory=list)  # rows whose chosen token's logprob is asked
    lp_index: Optional[torch.Tensor] = None  # device: sampled_lp, then scored rows, then targets
    scored: Optional[ScoredRows] = None
    k: int = 0


class BatchSampler:
    """Samples a step's rows on their device. Per-row parameters travel in small pinned buffers
    (async copies, double-buffered so that writing step i+1's never waits for step i's copy, which
    is queued behind step i's graph); nothing waits on the device. `state` holds the per-request
    penalty / bias state (allocated on first use)."""

    # per-row staging columns
    _F = ("temperature", "top_p", "presence", "frequency", "repetition")
    _I = ("top_k", "seed", "counter", "slot")

    def __init__(self, max_batch_size: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_batch_size = int(max_batch_size)
        pin = self.device.type == "cuda"
        b = self.max_batch_size
        self._host_f = [torch.zeros(b, len(self._F), dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._host_i = [torch.zeros(b, len(self._I), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        # logprob indices: sampled rows (<= B), scored rows and their targets (<= B each)
        self._host_x = [torch.zeros(3 * b, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._dev_f = self._host_f[0].to(self.device) if pin else None
        self._dev_i = self._host_i[0].to(self.device) if pin else None
        self._dev_x = self._host_x[0].to(self.device) if pin else None
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._slot = 0
        self._vocab_ids: Optional[torch.Tensor] = None
        self.state = SamplerState(b, self.device)

    # ------------------------------------------------------------------ public
    def sample(self, rows: torch.Tensor, specs: Sequence[RowSpec]) -> torch.Tensor:
        """Token ids [B] (int64, on rows' device) for `rows` [B, V] and one spec per row."""
        return self.run(rows, specs).ids

    def run(self, rows: torch.Tensor, specs: Sequence[RowSpec], scored: Optional[ScoredRows] = None
            ) -> SampleOutput:
        """`draw` then `commit`: the ids and, when any row asks, the logprob results."""
        d = self.draw(rows, specs, scored)
        return self.commit(d, d.ids)

    def release(self, key: int) -> None:
        """The request `key` ended: its state slot (if any) may be reused (re-initialised first)."""
        self.state.release(key)

    def draw(self, rows: torch.Tensor, specs: Sequence[RowSpec], scored: Optional[ScoredRows] = None) -> _Draw:
        """Process and sample `rows` [B, V], one spec per row; nothing is updated yet (`commit`)."""
        b = rows.shape[0]
        if b != len(specs):
            raise ValueError(f"sample: {b} logits rows but {len(specs)} row specs")
        if b > self.max_batch_size:
            raise ValueError(f"sample: {b} rows, over max_batch_size={self.max_batch_size}")
        extras = [i for i, s in enumerate(specs) if s.extra is not None]  # the one pass over plain rows
        stateful = any(specs[i].stateful for i in extras)
        sampled_lp = [i for i in extras if specs[i].logprobs is not None]
        if scored is not None and not scored.rows:
            scored = None
        if not stateful:
            greedy = rows.argmax(dim=-1)
            if not sampled_lp and scored is None and all(s.temperature == 0 for s in specs):
                return _Draw(greedy)
        slots = self.state.slots(specs, rows.shape[-1]) if stateful else None
        dev_f, dev_i, dev_x = self._upload(specs, slots, sampled_lp, scored)
        temperature, top_p = dev_f[:b, 0], dev_f[:b, 1]
        top_k, seeds, counters = dev_i[:b, 0], dev_i[:b, 1], dev_i[:b, 2]
        vocab = rows.shape[-1]
        if self._vocab_ids is None or self._vocab_ids.numel() != vocab:
            self._vocab_ids = torch.arange(vocab, device=rows.device)
        logits = rows.float()
        slot_idx = None
        if stateful:
            slot_idx = dev_i[:b, 3]
            logits = self.state.process(logits, specs, slot_idx, dev_f[:b, 2], dev_f[:b, 3], dev_f[:b, 4])
            greedy = logits.argmax(dim=-1)
        ids = greedy
        if any(s.temperature > 0 for s in specs):
            keys = row_keys(seeds, counters)
            if any(s.top_k > 0 or s.top_p < 1.0 for s in specs):
                vals, idx = filtered_logits(logits, temperature, top_k, top_p)
                noise = gumbel_noise(keys, self._vocab_ids).gather(1, idx)  # noise follows the vocab id
                drawn = idx.gather(1, (vals + noise).argmax(dim=-1, keepdim=True))[:, 0]
            else:
                scaled = logits / temperature.clamp_min(1e-6)[:, None]
                drawn = (scaled + gumbel_noise(keys, self._vocab_ids)).argmax(dim=-1)
            ids = torch.where(temperature > 0, drawn, greedy)
        k = max([specs[i].logprobs for i in sampled_lp] + ([scored.k] if scored is not None else []), default=0)
        return _Draw(ids, logits, temperature, slot_idx if self.state.counting(specs) else None, sampled_lp,
                     dev_x, scored, min(k, vocab))

    def commit(self, d: _Draw, ids: torch.Tensor) -> SampleOutput:
        """After the draw (and, under tensor parallelism, after every rank took rank 0's `ids`):
        count the drawn tokens into the penalty state, and compute the logprobs asked for."""
        if d.slots is not None:
            self.state.count(d.slots, ids)
        if not d.sampled_lp and d.scored is None:
            return SampleOutput(ids, None)
        return SampleOutput(ids, self._logprobs(d, ids))

    # ------------------------------------------------------------------ internals
    def _upload(self, specs: Sequence[RowSpec], slots: Optional[list[int]], sampled_lp: list[int],
                scored: Optional[ScoredRows]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Write the step's per-row parameters into this step's staging slot and queue their copy."""
        b = len(specs)
        slot = self._slot
        self._slot ^= 1
        if self._copied[slot] is not None:  # the copy of two steps ago: long done, normally
            self._copied[slot].synchronize()
        host_f, host_i = self._host_f[slot], self._host_i[slot]
        if slots is None:
            host_f[:b] = torch.tensor([(s.temperature, s.top_p, 0.0, 0.0, 1.0) for s in specs], dtype=torch.float32)
            host_i[:b] = torch.tensor([(s.top_k, s.seed, s.counter, 0) for s in specs], dtype=torch.int64)
        else:
            plain = RowExtras()
            host_f[:b] = torch.tensor([(s.temperature, s.top_p, e.presence_penalty, e.frequency_penalty,
                                        e.repetition_penalty) for s in specs for e in (s.extra or plain,)],
                                      dtype=torch.float32)
            host_i[:b] = torch.tensor([(s.top_k, s.seed, s.counter, sl) for s, sl in zip(specs, slots)],
                                      dtype=torch.int64)
        host_x = None
        if sampled_lp or scored is not None:
            host_x = self._host_x[slot]
            n_s = len(scored.rows) if scored is not None else 0
            vals = list(sampled_lp) + (list(scored.rows) + list(scored.targets) if scored is not None else [])
            host_x[: len(sampled_lp) + 2 * n_s] = torch.tensor(vals, dtype=torch.int64)
        if self._dev_f is None:  # CPU: the staging buffers are the device's
            return host_f, host_i, host_x
        self._dev_f[:b].copy_(host_f[:b], non_blocking=True)
        self._dev_i[:b].copy_(host_i[:b], non_blocking=True)
        if host_x is not None:
            self._dev_x.copy_(host_x, non_blocking=True)
        self._copied[slot] = torch.cuda.Event()
        self._copied[slot].record()
        return self._dev_f, self._dev_i, self._dev_x if host_x is not None else None

    def _logprobs(self, d: _Draw, ids: torch.Tensor) -> LogprobTensors:
        """log_softmax over the processed (sampled rows, / temperature) and raw (scored rows) logits,
        the chosen / target token's value and the top k, all on the device."""
        assert d.lp_index is not None and d.logits is not None and d.temperature is not None
        parts, targets = [], []
        n_a = len(d.sampled_lp)
        if n_a:
            a = d.lp_index[:n_a]
            t = d.temperature.index_select(0, a)
            t = torch.where(t > 0, t, torch.ones_like(t))
            parts.append(d.logits.index_select(0, a) / t[:, None])
            targets.append(ids.index_select(0, a))
        if d.scored is not None:
            n_s = len(d.scored.rows)
            parts.append(d.scored.logits.index_select(0, d.lp_index[n_a : n_a + n_s]).float())
            targets.append(d.lp_index[n_a + n_s : n_a + 2 * n_s])
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        tgt = targets[0] if len(targets) == 1 else torch.cat(targets)
        lsm = torch.log_softmax(x, dim=-1)
        chosen = lsm.gather(1, tgt[:, None])[:, 0]
        if d.k > 0:
            top_vals, top_ids = lsm.topk(d.k, dim=-1)
        else:
            top_vals = lsm.new_empty(lsm.shape[0], 0)
            top_ids = tgt.new_empty(lsm.shape[0], 0)
        return LogprobTensors(chosen, top_ids, top_vals, d.sampled_lp)

