"""Checking generated tokens against the eager Hugging Face model (the oracle of `autodeploy build`).

`hf_greedy_generate` runs the HF model with its own KV cache, greedily, stopping at the model's
end-of-sequence token as HF `generate` does (unless told not to) — the same rule `optimize()`'s
generation follows — so the two token lists are directly comparable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .models.factory import eos_token_ids


@torch.no_grad()
def hf_greedy_generate(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, *,
                       ignore_eos: bool = False) -> list[int]:
    """Greedy tokens from the eager HF model with its own KV cache; stops after the model's eos
    token (included) unless `ignore_eos`.

    A hand loop rather than `model.generate`: generate's min_new_tokens / logits processors would
    change what a random-weight model picks; this loop is plain argmax, as our greedy sampling is.
    """
    device = next(model.parameters()).device
    stop = set() if ignore_eos else set(eos_token_ids(model))
    ids = torch.tensor([list(prompt)], device=device)
    out = model(input_ids=ids, use_cache=True)
    past, new = out.past_key_values, []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        if len(new) == max_new_tokens or tok in stop:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return new


def compare_greedy(model: torch.nn.Module, prompts: Sequence[Sequence[int]], outs: Sequence[Sequence[int]],
                   max_new_tokens: int, *, exact: bool, ignore_eos: bool = False) -> dict[str, Any]:
    """Our greedy tokens vs the eager HF model's: identical when `exact` (fp32), else the first token
    must agree (16-bit rounding may diverge later; agreement is reported)."""
    per = []
    for p, o in zip(prompts, outs):
        ref = hf_greedy_generate(model, p, max_new_tokens, ignore_eos=ignore_eos)
        agree = next((i for i, (a, b) in enumerate(zip(ref, o)) if a != b), min(len(ref), len(o)))
        per.append({"prompt_len": len(p), "ours": list(o), "hf": ref, "identical": ref == list(o),
                    "agreeing_prefix": agree})
    ok = all(x["identical"] for x in per) if exact else all(x["agreeing_prefix"] >= 1 for x in per)
    return {"ok": ok, "criterion": "identical greedy tokens (fp32)" if exact else
            "first token identical; 16-bit rounding may diverge later", "prompts": per}
