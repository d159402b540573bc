"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

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
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")

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


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """One token from one row of logits [V] (float32, host)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=generator))
