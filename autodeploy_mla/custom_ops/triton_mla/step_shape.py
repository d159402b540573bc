"""`StepShape`: the host facts of one step every layer's launch decisions read, taken once per step
from the metadata's host mirrors (never from the device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepShape:
    """Host facts of one step that every layer's launch decisions read (DESIGN §7 host mirrors)."""

    n_pre: int  # prefill sequences (chunked-prefill continuations included)
    n_pre_tok: int  # their new tokens
    n_dec: int  # decode sequences (one token each)
    max_q: int
    max_kv: int
    prefix: int  # cached tokens under the prefill sequences
    pairs: int  # causal (query, key) pairs of the prefill part
    #: the step runs in a whole-graph CUDA graph captured for any batch of its token count
    #: (StepDescriptor.static_bounds): launches are sized from static bounds only (`_attend_static`)
    static: bool = False
    #: the prefill sequences' new-token and kv-length offsets [0, ...] (n_pre + 1 each; FA3's plan)
    qo_indptr: tuple[int, ...] = ()
    kv_indptr: tuple[int, ...] = ()

    @property
    def num_tok(self) -> int:
        return self.n_pre_tok + self.n_dec

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        return (self.n_pre, self.n_pre_tok, self.n_dec, self.max_q, self.max_kv)

    @classmethod
    def from_host(cls, batch_info_host: torch.Tensor, max_seq_info_host: torch.Tensor,
                  cu_seqlen_host: torch.Tensor, input_pos_host: torch.Tensor, static: bool = False) -> "StepShape":
        """From the `_host` mirrors (CPU tensors: reading them never syncs the device)."""
        n_pre, n_pre_tok, n_dec = (int(v) for v in batch_info_host.tolist()[:3])
        max_q, max_kv = (int(v) for v in max_seq_info_host.tolist()[:2])
        prefix = pairs = 0
        qo_indptr: tuple[int, ...] = ()
        kv_indptr: tuple[int, ...] = ()
        if n_pre > 0:
            cu = cu_seqlen_host[: n_pre + 1].numpy().astype("int64")
            q = cu[1:] - cu[:-1]
            p = input_pos_host[:n_pre].numpy().astype("int64")
            prefix, pairs = int(p.sum()), int((q * p + q * (q + 1) // 2).sum())
            qo_indptr = tuple(int(v) for v in cu - cu[0])
            kv_indptr = (0, *(int(v) for v in (p + q).cumsum()))
        return cls(n_pre, n_pre_tok, n_dec, max_q, max_kv, prefix, pairs, static, qo_indptr, kv_indptr)
