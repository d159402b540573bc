"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds — batched, on the device.

`BatchSampler.sample(rows, specs)` turns a step's next-token logits `[B, V]` (on the GPU) into `B`
token ids on the same device; only those ids cross to the host. One set of tensor ops serves the
whole batch, whatever mix of greedy and sampled requests it holds:

- greedy rows (temperature 0): argmax;
- sampled rows: the Gumbel-max trick, `argmax(logits / T + g)`, over the top-k / top-p filtered
  candidates (logits sorted once per step only when some row filters). The Gumbel noise `g` comes
  from a counter-based hash of (request seed, token index within the request, vocab id): no random
  generator state, so a seeded request draws the same tokens whatever else is in its batch, on any
  device, and no per-request generator has to be kept or launched. Requests without a seed get one
  drawn from the process RNG when they are added (so tensor-parallel ranks, seeded identically,
  agree).

`target_probs` is the distribution a row samples from, written out plainly; the tests check the
sampler's empirical frequencies against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Generation stops at `max_new_tokens`, at any of `stop_token_ids`, and at the end-of-sequence
    token: `eos_token_id` if given, else the model's own (as HF `generate` does); `ignore_eos=True`
    keeps going past it."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: Optional[int] = None
    eos_token_id: Optional[int | tuple[int, ...]] = None  # None: the model's
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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


class RowSpec(NamedTuple):
    """What one row of a step samples with: its request's parameters, seed, and the index of the
    token being drawn (the hash counter)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    counter: int

    @classmethod
    def of(cls, params: SamplingParams, seed: int, counter: int) -> "RowSpec":
        return cls(params.temperature, params.top_k, params.top_p, seed, counter)


GREEDY = RowSpec(0.0, 0, 1.0, 0, 0)


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


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one row [V] samples from (float64, on the row's device): the reference."""
    x = logits.double()
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


class BatchSampler:
    """Samples a step's rows on their device. Per-row parameters travel in one small pinned buffer
    (one async copy); nothing waits on the device."""

    def __init__(self, max_batch_size: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_batch_size = int(max_batch_size)
        pin = self.device.type == "cuda"
        # per row: temperature, top_p (float64 holds both exactly enough) and top_k, seed, counter
        self._host_f = torch.zeros(self.max_batch_size, 2, dtype=torch.float32, pin_memory=pin)
        self._host_i = torch.zeros(self.max_batch_size, 3, dtype=torch.int64, pin_memory=pin)
        self._dev_f = self._host_f.to(self.device) if pin else self._host_f
        self._dev_i = self._host_i.to(self.device) if pin else self._host_i
        self._copied: Optional[torch.cuda.Event] = None
        self._vocab_ids: Optional[torch.Tensor] = None

    def sample(self, rows: torch.Tensor, specs: Sequence[RowSpec]) -> torch.Tensor:
        """Token ids [B] (int64, on rows' device) for `rows` [B, V] and one spec per row."""
        b = rows.shape[0]
        if b != len(specs):
            raise ValueError(f"sample: {b} logits rows but {len(specs)} row specs")
        if b > self.max_batch_size:
            raise ValueError(f"sample: {b} rows, over max_batch_size={self.max_batch_size}")
        greedy = rows.argmax(dim=-1)
        if all(s.temperature == 0 for s in specs):
            return greedy
        if self._copied is not None:  # the previous step's parameter copy still reads the staging buffer
            self._copied.synchronize()
        self._host_f[:b] = torch.tensor([(s.temperature, s.top_p) for s in specs], dtype=torch.float32)
        self._host_i[:b] = torch.tensor([(s.top_k, s.seed, s.counter) for s in specs], dtype=torch.int64)
        if self._dev_f is not self._host_f:
            self._dev_f[:b].copy_(self._host_f[:b], non_blocking=True)
            self._dev_i[:b].copy_(self._host_i[:b], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        temperature, top_p = self._dev_f[:b, 0], self._dev_f[:b, 1]
        top_k, seeds, counters = self._dev_i[:b, 0], self._dev_i[:b, 1], self._dev_i[:b, 2]
        vocab = rows.shape[-1]
        if self._vocab_ids is None or self._vocab_ids.numel() != vocab:
            self._vocab_ids = torch.arange(vocab, device=rows.device)
        logits = rows.float()
        keys = row_keys(seeds, counters)
        if any(s.top_k > 0 or s.top_p < 1.0 for s in specs):
            vals, idx = filtered_logits(logits, temperature, top_k, top_p)
            noise = gumbel_noise(keys, self._vocab_ids).gather(1, idx)  # noise follows the vocab id
            drawn = idx.gather(1, (vals + noise).argmax(dim=-1, keepdim=True))[:, 0]
        else:
            drawn = (logits / temperature.clamp_min(1e-6)[:, None] + gumbel_noise(keys, self._vocab_ids)).argmax(dim=-1)
        return torch.where(temperature > 0, drawn, greedy)
