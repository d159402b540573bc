"""Per-step batch metadata with fixed capacity (DESIGN §7).

`SequenceInfo.prepare_step` turns the step's sequences into every metadata tensor the cached ops
may consume, built on the host into ONE staging buffer and sent to the device in ONE copy. All
tensors are views of fixed-size buffers, so their addresses never change: CUDA graphs captured
against them replay correctly with the next step's values.

Token order: prefill sequences (including chunked-prefill continuations) first, decode sequences
(exactly one new token on top of a non-empty cache) last; nothing is padded between sequences.

Fields (device tensors; `<name>_host` is the host mirror of the same bytes):
    batch_info        int32[3]    (num_prefill_seqs, num_prefill_tokens, num_decode_seqs)
    max_seq_info      int32[2]    (max new tokens of one sequence, max kv length incl. new tokens)
    cu_seqlen         int32[B+1]  token offsets of each sequence in the flat batch
    input_pos         int32[B]    tokens already cached per sequence
    seq_len_with_cache int32[B]   input_pos + new tokens
    page_table        int32[B, P] cache pages of each sequence (unused entries: scratch page 0)
    batch_idx         int32[T]    sequence slot of each token
    cache_loc         int32[T]    flat cache slot (page * page_size + offset) of each token
    input_ids         int64[T]    token ids (graph input, viewed as [1, T])
    input_src         int64[T]    -1, or the row of the previous step's sampled ids that holds this
                                  token (a decode token sampled by a step still on the device)
    position_ids      int64[T]    absolute positions (graph input, viewed as [1, T])
    last_token        int64[B]    flat index of each sequence's last token
    logits_index      int64[B]    flat tokens whose logits rows the step returns (the graph itself
                                  when the gather_logits pass is on): each sequence's last token,
                                  or every new token of a sequence that asks for all its rows
                                  (`StepSequence.all_logits`, prompt logprobs; `logits_for="all"`:
                                  every sequence), in flat order; at most B rows in all
    sample_row        int64[B]    the row (index into those logits rows) of each sequence's last token
B = max_batch_size, T = max_num_tokens, P = ceil(max_seq_len / page_size).

Padding (`pad_to`, for CUDA-graph buckets): a decode-only step is padded with dummy decode
sequences that live on the scratch page (length 1, so every kernel sees a well-formed sequence);
any other step is padded with tokens that map to sequence 0 and write to the scratch page, and
that the ops ignore (they process `num_prefill_tokens + num_decode_seqs` tokens from host info).
"""

from __future__ import annotations

import itertools

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .errors import CapacityError
from ..custom_ops.attention.registry import SCRATCH_PAGE


@dataclass(frozen=True)
class StepSequence:
    """One sequence's share of a step: its new tokens on top of `num_cached` cached tokens."""

    seq_id: int
    token_ids: Sequence[int]
    num_cached: int
    #: The new token is the one the previous step sampled for row `src_row` (still on the device):
    #: token_ids holds one placeholder, the model runner fills the id in on the device.
    src_row: Optional[int] = None
    #: Return the logits rows of every new token, not only the last (prompt logprobs). The step's
    #: rows in all (one per other sequence) must fit max_batch_size: the engine caps such chunks.
    all_logits: bool = False

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.num_cached > 0


_ALIGN = 8


def _layout(b: int, t: int, p: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The fields (name, dtype, shape) at capacity: B sequences, T tokens, P pages per sequence."""
    return [
        ("batch_info", torch.int32, (3,)),
        ("max_seq_info", torch.int32, (2,)),
        ("cu_seqlen", torch.int32, (b + 1,)),
        ("input_pos", torch.int32, (b,)),
        ("seq_len_with_cache", torch.int32, (b,)),
        ("page_table", torch.int32, (b, p)),
        ("batch_idx", torch.int32, (t,)),
        ("cache_loc", torch.int32, (t,)),
        ("input_ids", torch.int64, (t,)),
        ("input_src", torch.int64, (t,)),
        ("position_ids", torch.int64, (t,)),
        ("last_token", torch.int64, (b,)),
        ("logits_index", torch.int64, (b,)),
        ("sample_row", torch.int64, (b,)),
    ]


def _offsets(layout: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    offsets, off = [], 0
    for _, dt, shape in layout:
        off = -(-off // _ALIGN) * _ALIGN
        offsets.append(off)
        off += math.prod(shape) * dt.itemsize
    return offsets, -(-off // _ALIGN) * _ALIGN


def metadata_nbytes(max_batch_size: int, max_num_tokens: int, max_seq_len: int, page_size: int) -> int:
    """Bytes of one metadata staging buffer at these capacities (the device copy costs the same again)."""
    pages = math.ceil(max_seq_len / page_size)
    return _offsets(_layout(max_batch_size, max_num_tokens, pages))[1]


class SequenceInfo:
    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        max_seq_len: int,
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens),
                        ("max_seq_len", max_seq_len), ("page_size", page_size)):
            if int(v) < 1:
                raise CapacityError(f"{name}={v}: must be >= 1.")
        self.max_batch_size = B = int(max_batch_size)
        self.max_num_tokens = T = int(max_num_tokens)
        self.max_seq_len = int(max_seq_len)
        self.page_size = int(page_size)
        self.max_pages_per_seq = P = math.ceil(self.max_seq_len / self.page_size)
        self.device = torch.device(device)

        layout = _layout(B, T, P)
        offsets, self._nbytes = _offsets(layout)
        on_cuda = self.device.type == "cuda"
        self._host_buf = torch.zeros(self._nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        self._dev_buf = (
            torch.zeros(self._nbytes, dtype=torch.uint8, device=self.device) if on_cuda else self._host_buf
        )
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for (name, dt, shape), o in zip(layout, offsets):
            nb = math.prod(shape) * dt.itemsize
            self.host[name] = self._host_buf[o : o + nb].view(dt).view(shape)
            self.dev[name] = self._dev_buf[o : o + nb].view(dt).view(shape)
        self._host_np = {name: t.numpy() for name, t in self.host.items()}
        self._copy_done: torch.cuda.Event | None = None

        # Host-side description of the current step (plain Python, for the engine and planners).
        self.seq_ids: list[int] = []
        self.num_tokens = 0  # real tokens this step
        self.num_padded_tokens = 0  # tokens the graph runs (>= num_tokens)
        self.num_prefill_seqs = 0
        self.num_decode_seqs = 0
        self.num_device_tokens = 0  # tokens whose id the previous step sampled on the device
        self.num_logits_rows = 0  # rows of logits the step returns (logits_index)
        self._rows_per: Optional[np.ndarray] = None  # logits rows per sequence; None: one each
        self.clear()

    # ------------------------------------------------------------------ access
    @property
    def field_names(self) -> list[str]:
        return list(self.dev) + [f"{n}_host" for n in self.host]

    def get(self, name: str) -> torch.Tensor:
        """Metadata tensor by name: `<field>` is the device tensor, `<field>_host` its host mirror."""
        if name.endswith("_host") and name[: -len("_host")] in self.host:
            return self.host[name[: -len("_host")]]
        if name in self.dev:
            return self.dev[name]
        raise KeyError(f"unknown metadata field {name!r}; valid: {', '.join(self.field_names)}")

    def graph_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids), each [1, num_padded_tokens], views of the fixed buffers."""
        t = self.num_padded_tokens
        return self.dev["input_ids"][:t].unsqueeze(0), self.dev["position_ids"][:t].unsqueeze(0)

    # ------------------------------------------------------------------ building a step
    def clear(self) -> None:
        """An empty step (all capacity padded)."""
        self._write([], [], None, "last")

    def prepare_step(
        self,
        seqs: Sequence[StepSequence],
        pages_of: Callable[[int], Sequence[int]],
        pad_to: int | None = None,
        logits_for: str = "last",
    ) -> list[int]:
        """Build this step's metadata; returns the sequence ids in flat-batch order.

        `pages_of(seq_id)` gives the pages that already hold (or will hold) the sequence's tokens:
        allocate them before calling this. Validates every limit first, so a rejected step leaves
        the previous metadata untouched. `pad_to`: run the step as that many tokens (CUDA-graph
        buckets; the model runner decides). `logits_for`: "last" (each sequence's last token, or
        all its tokens where `StepSequence.all_logits`) or "all" (every token of the step) fills
        `logits_index`; at most max_batch_size rows either way.
        """
        ordered = sorted(seqs, key=lambda s: s.is_decode)  # stable: prefill first, decode last
        if len(ordered) > self.max_batch_size:
            raise CapacityError(
                f"step has {len(ordered)} sequences, over max_batch_size={self.max_batch_size}."
            )
        num_tokens = sum(len(s.token_ids) for s in ordered)
        if num_tokens > self.max_num_tokens:
            raise CapacityError(
                f"step has {num_tokens} tokens, over max_num_tokens={self.max_num_tokens}; "
                "split prefill into chunks of at most max_num_tokens."
            )
        if logits_for not in ("last", "all"):
            raise ValueError(f"logits_for={logits_for!r}: expected 'last' or 'all'")
        if logits_for == "all" and num_tokens > self.max_batch_size:
            raise CapacityError(
                f"logits_for='all' returns one row per token, at most max_batch_size={self.max_batch_size}; "
                f"the step has {num_tokens} tokens."
            )
        if pad_to is not None and not (num_tokens <= pad_to <= self.max_num_tokens):
            raise CapacityError(
                f"pad_to={pad_to} must lie in [{num_tokens} (tokens this step), "
                f"max_num_tokens={self.max_num_tokens}]."
            )
        seen: set[int] = set()
        page_rows: list[Sequence[int]] = []
        extra_rows = 0  # logits rows past one per sequence (all_logits)
        for s in ordered:
            if s.seq_id in seen:
                raise ValueError(f"sequence {s.seq_id} appears twice in one step.")
            seen.add(s.seq_id)
            if s.src_row is not None and len(s.token_ids) != 1:
                raise ValueError(f"sequence {s.seq_id}: a token sampled on the device (src_row) is one decode "
                                 f"token, got {len(s.token_ids)} tokens.")
            if len(s.token_ids) < 1 or s.num_cached < 0:
                raise ValueError(
                    f"sequence {s.seq_id}: needs >= 1 new token and num_cached >= 0, got "
                    f"{len(s.token_ids)} tokens and num_cached={s.num_cached}."
                )
            total = s.num_cached + len(s.token_ids)
            if total > self.max_seq_len:
                raise CapacityError(
                    f"sequence {s.seq_id} would reach {total} tokens, over max_seq_len={self.max_seq_len}."
                )
            pages = pages_of(s.seq_id)
            if len(pages) * self.page_size < total:
                raise CapacityError(
                    f"sequence {s.seq_id} has {len(pages)} pages ({len(pages) * self.page_size} slots) "
                    f"for {total} tokens: allocate its pages before prepare_step."
                )
            if len(pages) > self.max_pages_per_seq:
                raise CapacityError(
                    f"sequence {s.seq_id} has {len(pages)} pages, over max_pages_per_seq="
                    f"{self.max_pages_per_seq}."
                )
            page_rows.append(pages)
            if s.all_logits:
                extra_rows += len(s.token_ids) - 1
        if logits_for == "last" and len(ordered) + extra_rows > self.max_batch_size:
            raise CapacityError(
                f"step asks for {len(ordered) + extra_rows} logits rows (every new token of the sequences with "
                f"all_logits, one per other sequence), over max_batch_size={self.max_batch_size}, the rows the "
                "step returns; cap the chunks of sequences that want all their rows."
            )
        self._write(ordered, page_rows, pad_to, "all" if logits_for == "all" else "some" if extra_rows else "last")
        return list(self.seq_ids)

    def _write_rows(self, ordered: Sequence[StepSequence], lens_np: np.ndarray, logits_for: str) -> None:
        """`logits_index` and `sample_row`: one row per sequence ("last"), or every new token's
        row for every sequence ("all") or for those with all_logits ("some")."""
        h_np = self._host_np
        n_seq = len(ordered)
        h_np["logits_index"][:] = 0
        h_np["sample_row"][:] = 0
        if logits_for == "last":
            h_np["logits_index"][:n_seq] = h_np["last_token"][:n_seq]
            h_np["sample_row"][:n_seq] = np.arange(n_seq)
            self.num_logits_rows, self._rows_per = n_seq, None
            return
        wants = np.fromiter((logits_for == "all" or s.all_logits for s in ordered), bool, count=n_seq)
        rows_per = np.where(wants, lens_np, 1)
        row_end = np.cumsum(rows_per)
        num_rows = int(row_end[-1]) if n_seq else 0
        seq_of_row = np.repeat(np.arange(n_seq), rows_per)
        after = row_end[seq_of_row] - 1 - np.arange(num_rows)  # row r of sequence s: rows of s after r
        h_np["logits_index"][:num_rows] = h_np["last_token"][seq_of_row] - after
        h_np["sample_row"][:n_seq] = row_end - 1
        self.num_logits_rows, self._rows_per = num_rows, rows_per

    @property
    def rows_per_seq(self) -> list[int]:
        """Per sequence of the step (flat order): its logits rows (1, or its new tokens)."""
        return [1] * len(self.seq_ids) if self._rows_per is None else self._rows_per.tolist()

    @property
    def row_start(self) -> list[int]:
        """Per sequence of the step (flat order): its first logits row."""
        if self._rows_per is None:
            return list(range(len(self.seq_ids)))
        return (np.cumsum(self._rows_per) - self._rows_per).tolist()

    def _write(
        self, ordered: Sequence[StepSequence], page_rows: Sequence[Sequence[int]], pad_to: int | None, logits_for: str
    ) -> None:
        if self._copy_done is not None:  # the previous async copy still reads the staging buffer
            self._copy_done.synchronize()
        ps = self.page_size
        n_seq = len(ordered)
        n_dec = sum(1 for s in ordered if s.is_decode)
        n_pre = n_seq - n_dec
        lens = [len(s.token_ids) for s in ordered]
        num_tokens = sum(lens)
        t_pad = num_tokens if pad_to is None else pad_to
        pad_tok = t_pad - num_tokens
        decode_only = n_pre == 0 and n_dec > 0
        dummy_seqs = pad_tok if (decode_only and n_seq + pad_tok <= self.max_batch_size) else 0

        # Everything below writes through NumPy views of the staging buffer: per-element torch
        # tensors from Python lists dominated host time at large batches (0.8 ms at 128 seqs).
        h_np = self._host_np
        lens_np = np.asarray(lens, dtype=np.int64)
        cached_np = np.fromiter((s.num_cached for s in ordered), dtype=np.int64, count=n_seq)
        cu = h_np["cu_seqlen"]
        cu[0] = 0
        np.cumsum(np.concatenate([lens_np, np.ones(dummy_seqs, np.int64)]), out=cu[1 : 1 + n_seq + dummy_seqs])
        cu[1 + n_seq + dummy_seqs :] = cu[n_seq + dummy_seqs]
        n_act = n_seq + dummy_seqs
        for name, vals, dummy in (("input_pos", cached_np, 0), ("seq_len_with_cache", cached_np + lens_np, 1)):
            h_np[name][:n_seq] = vals
            h_np[name][n_seq:n_act] = dummy
            h_np[name][n_act:] = 0
        pt = h_np["page_table"]
        pt.fill(SCRATCH_PAGE)
        for b, pages in enumerate(page_rows):
            pt[b, : len(pages)] = pages

        tok_seq = np.repeat(np.arange(n_seq), lens_np)
        tok_pos = np.arange(num_tokens) - np.repeat(cu[:n_seq], lens_np) + np.repeat(cached_np, lens_np)
        for name in ("batch_idx", "cache_loc", "input_ids", "position_ids"):
            h_np[name][:] = 0
        h_np["input_src"][:] = -1
        self.num_device_tokens = 0
        off = 0
        for s_, n in zip(ordered, lens):
            if s_.src_row is not None:
                h_np["input_src"][off] = s_.src_row
                self.num_device_tokens += 1
            off += n
        h_np["batch_idx"][:num_tokens] = tok_seq
        h_np["cache_loc"][:num_tokens] = pt[tok_seq, tok_pos // ps].astype(np.int64) * ps + tok_pos % ps
        h_np["input_ids"][:num_tokens] = np.fromiter(  # chain: half the time of a nested generator
            itertools.chain.from_iterable(s.token_ids for s in ordered), dtype=np.int64, count=num_tokens
        )
        h_np["position_ids"][:num_tokens] = tok_pos
        # Padded tokens: dummy decode sequences (decode-only steps), else ignored tokens of sequence 0;
        # both write to the scratch page (cache_loc 0) at position 0.
        h_np["batch_idx"][num_tokens : num_tokens + dummy_seqs] = np.arange(n_seq, n_act)
        h_np["cache_loc"][num_tokens:t_pad] = SCRATCH_PAGE * ps
        h_np["last_token"][:] = 0
        h_np["last_token"][:n_seq] = cu[1 : n_seq + 1] - 1
        self._write_rows(ordered, lens_np, logits_for)
        n_dec_total = n_dec + dummy_seqs
        h_np["batch_info"][:] = (n_pre, int(lens_np[:n_pre].sum()), n_dec_total)
        max_kv = int((cached_np + lens_np).max()) if n_seq else 0
        max_new = max(int(lens_np.max()) if n_seq else 0, 1 if dummy_seqs else 0)
        h_np["max_seq_info"][:] = (max_new, max(max_kv, 1 if dummy_seqs else 0))

        if self._dev_buf is not self._host_buf:
            self._dev_buf.copy_(self._host_buf, non_blocking=True)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()

        self.seq_ids = [s.seq_id for s in ordered]
        self.num_tokens = num_tokens
        self.num_padded_tokens = t_pad
        self.num_prefill_seqs = n_pre
        self.num_decode_seqs = n_dec_total
        self.num_prefill_tokens = sum(lens[:n_pre])
