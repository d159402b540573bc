"""Per-request sampling state on the device: generated-token counts (frequency, presence and
repetition penalties), prompt-token masks (repetition penalty) and logit-bias tables, one slot per
request that needs them. Owned by the model's `BatchSampler` (no module-level state).

Why on the device, in slots. The penalties of step i+1 need the token step i drew, and with the
engine's overlap step i+1 is queued before step i's ids reach the host. So the counts are updated
on the device right after each draw (`count`: one index_put_ with accumulate), in stream order, and
the next step reads them whatever the host knows yet. Slots are fixed rows of `[S + 1, ...]`
tensors (S = max_batch_size: the engine runs at most that many requests at once); row S is a
"no state" row of zeros that rows without state read, so a step gathers its rows with one
index_select and no per-request host work.

Lifecycle. A request's slot is taken, and (re)initialised on the device, when its first row with
state is drawn (counter 0, or a key not seen before): its counts row zeroed, its prompt's tokens
set in its mask, its bias entries written, from one small async upload (pinned memory from torch's
caching host allocator, which keeps a block until its copy has run). `release(key)`, called when
the request ends, returns the slot. A later request re-initialises it on the stream before it reads
it, so the ended request's work still queued (the engine's overlap step) finishes first.

Logit bias: per-slot sparse tables `[S + 1, 300]` (ids, values; padding (0, 0.0), which adds an
exact 0.0 to token 0) written once per request, then one gather and one scatter_add over [B, 300]
per step. The alternatives cost more: dense bias rows `[S + 1, V]` are 4 V bytes a slot (505 KiB at
V = 129k) and a [B, V] gather + add every step, ~140x the 3.5 KiB a sparse row reads; a
per-step sparse upload of (row, id, bias) triplets rebuilds up to 300 entries per request in
Python on every step, on the host's critical path.

Memory, allocated on first use only: counts int32 `[S + 1, V]` (any penalty), mask bool
`[S + 1, V]` (repetition penalty), bias int64 + float32 `[S + 1, 300]` (logit bias). At S = 256,
V = 129k: 132 MB + 33 MB + 1 MB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit); the width of the bias tables


def _rep(s: Any) -> bool:
    """Row spec `s` has a repetition penalty."""
    return s.extra is not None and s.extra.repetition_penalty != 1


def _pres_freq(s: Any) -> bool:
    """Row spec `s` has a presence or frequency penalty."""
    return s.extra is not None and (s.extra.presence_penalty != 0 or s.extra.frequency_penalty != 0)


def _bias(s: Any) -> bool:
    return s.extra is not None and bool(s.extra.logit_bias)


class SamplerState:
    """Device state of the requests whose rows have penalties or a logit bias (`RowSpec.stateful`),
    keyed by `RowExtras.key` (the request id). Takes the step's RowSpecs."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        self.none = self.num_slots  # the row of zeros read by rows without state
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self.vocab: Optional[int] = None
        self.counts: Optional[torch.Tensor] = None  # int32 [S + 1, V]: generated tokens
        self.seen: Optional[torch.Tensor] = None  # bool [S + 1, V]: prompt tokens
        self.bias_ids: Optional[torch.Tensor] = None  # int64 [S + 1, MAX_LOGIT_BIAS]
        self.bias_vals: Optional[torch.Tensor] = None  # float32 [S + 1, MAX_LOGIT_BIAS]

    @property
    def allocated(self) -> bool:
        """Whether any state tensor exists (false until a request with penalties or bias samples)."""
        return any(t is not None for t in (self.counts, self.seen, self.bias_ids))

    def held(self) -> dict[int, int]:
        """Request key -> slot, for the requests holding one."""
        return dict(self._slot_of)

    def release(self, key: int) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    # ------------------------------------------------------------------ per step
    def slots(self, specs: Sequence[Any], vocab: int) -> list[int]:
        """The state slot of each row (`none` for rows without state), taking and initialising the
        slots of requests whose first stateful row this is."""
        self._ensure(specs, vocab)
        out: list[int] = []
        inits: list[tuple[int, Any]] = []
        for s in specs:
            if not s.stateful:
                out.append(self.none)
                continue
            key = s.extra.key
            if key < 0:
                raise ValueError("a row with penalties or a logit bias needs its request's key (RowExtras.key)")
            slot = self._slot_of.get(key)
            if slot is None:
                if not self._free:
                    raise RuntimeError(
                        f"sampler state: all {self.num_slots} slots (max_batch_size) are held by requests "
                        f"{sorted(self._slot_of)}; a request that ended was not released "
                        "(GenerationEngine._finish calls runner.release)"
                    )
                slot = self._free.pop()
                self._slot_of[key] = slot
                inits.append((slot, s))
            elif s.counter == 0:  # a key reused by a new request (another engine on this runner)
                inits.append((slot, s))
            out.append(slot)
        if inits:
            self._initialise(inits)
        return out

    def counting(self, specs: Sequence[Any]) -> bool:
        """Whether this step's draws must be counted (some row has a penalty)."""
        return self.counts is not None and any(_rep(s) or _pres_freq(s) for s in specs)

    def process(self, logits: torch.Tensor, specs: Sequence[Any], slot_idx: torch.Tensor, presence: torch.Tensor,
                frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
        """Penalties and bias applied to `logits` [B, V] (float32, not modified), rows reading their
        slot's state (`slot_idx` [B] on the device) and their parameters ([B] on the device).
        Rows without a penalty have neutral parameters (0, 0, 1), so they come out unchanged."""
        rep = any(_rep(s) for s in specs)
        pres_freq = any(_pres_freq(s) for s in specs)
        if rep or pres_freq:
            assert self.counts is not None
            counts = self.counts.index_select(0, slot_idx)
            present = counts > 0
            if rep:
                assert self.seen is not None
                seen = self.seen.index_select(0, slot_idx) | present
                r = repetition[:, None]
                logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
            if pres_freq:
                logits = (logits - counts.to(logits.dtype) * frequency[:, None]
                          - present.to(logits.dtype) * presence[:, None])
        if any(_bias(s) for s in specs):
            assert self.bias_ids is not None and self.bias_vals is not None
            logits = logits.scatter_add(1, self.bias_ids.index_select(0, slot_idx),
                                        self.bias_vals.index_select(0, slot_idx))
        return logits

    def count(self, slot_idx: torch.Tensor, ids: torch.Tensor) -> None:
        """Add each row's drawn token to its slot's counts (rows without state add nothing)."""
        assert self.counts is not None
        weight = (slot_idx != self.none).to(self.counts.dtype)
        self.counts.index_put_((slot_idx, ids), weight, accumulate=True)

    # ------------------------------------------------------------------ set-up
    def _ensure(self, specs: Sequence[Any], vocab: int) -> None:
        """Allocate (zeroed) the state tensors this step's rows need, once."""
        if self.vocab is None:
            self.vocab = int(vocab)
        elif vocab != self.vocab:
            raise ValueError(f"sampler state: logits rows of {vocab} entries, but the state was made for {self.vocab}")
        rows, dev = self.num_slots + 1, self.device
        if self.counts is None and any(_rep(s) or _pres_freq(s) for s in specs):
            self.counts = torch.zeros(rows, self.vocab, dtype=torch.int32, device=dev)
        if self.seen is None and any(_rep(s) for s in specs):
            self.seen = torch.zeros(rows, self.vocab, dtype=torch.bool, device=dev)
        if self.bias_ids is None and any(_bias(s) for s in specs):
            self.bias_ids = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.int64, device=dev)
            self.bias_vals = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(host)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _initialise(self, inits: Sequence[tuple[int, Any]]) -> None:
        """Zero the slots' rows, then write their prompt masks and bias entries (one int upload,
        one float upload), queued on the stream before this step reads them."""
        slots = [sl for sl, _ in inits]
        mask_slots: list[np.ndarray] = []
        mask_ids: list[np.ndarray] = []
        bias_slots: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        for sl, s in inits:
            if _rep(s) and len(s.extra.prompt):
                toks = np.unique(np.asarray(s.extra.prompt, dtype=np.int64))
                mask_slots.append(np.full(toks.shape, sl, dtype=np.int64))
                mask_ids.append(toks)
            for tok, val in s.extra.logit_bias:
                bias_slots.append(sl)
                bias_ids.append(tok)
                bias_vals.append(val)
        n_bias = len(bias_slots)
        bias_cols = [c for _, s in inits for c in range(len(s.extra.logit_bias))]
        ms = np.concatenate(mask_slots) if mask_slots else np.zeros(0, np.int64)
        mi = np.concatenate(mask_ids) if mask_ids else np.zeros(0, np.int64)
        ints = np.concatenate([np.asarray(slots, np.int64), ms, mi, np.asarray(bias_slots, np.int64),
                               np.asarray(bias_cols, np.int64), np.asarray(bias_ids, np.int64)])
        dev = self._upload(ints)
        n, m = len(slots), len(ms)
        idx = dev[:n]
        for t in (self.counts, self.seen, self.bias_ids, self.bias_vals):
            if t is not None:
                t.index_fill_(0, idx, 0)
        if m:
            assert self.seen is not None
            self.seen[dev[n : n + m], dev[n + m : n + 2 * m]] = True
        if n_bias:
            assert self.bias_ids is not None and self.bias_vals is not None
            o = n + 2 * m
            bs, bc, bi = dev[o : o + n_bias], dev[o + n_bias : o + 2 * n_bias], dev[o + 2 * n_bias : o + 3 * n_bias]
            self.bias_ids[bs, bc] = bi
            self.bias_vals[bs, bc] = self._upload(np.asarray(bias_vals, dtype=np.float32))
