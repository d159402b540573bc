"""`ModelRunner`: how a compiled graph becomes a model that steps (vLLM's GPU model runner).

Built from a `CompiledModel` (the passes' typed hand-off) and the runtime config, it owns:
- the step metadata (`SequenceInfo`), the paged caches and the page allocator;
- one backend session per backend the graph uses (`MLABackend.setup`), published to the ops for
  the duration of each step (`step_context.using_sessions`);
- the step runner: the graph itself, or a `PiecewiseRunner` (compiled pieces, CUDA graphs);
- the graph-input binding, **by name**: every placeholder of the graph is a token input, a
  metadata field or a cache named in the `GraphSignature`; metadata and caches keep fixed
  addresses, so they are bound once, and only the `[1, T]` token views change per step.

A step: pad the batch to a CUDA-graph bucket (the runner's policy), build the metadata, describe
the step (`StepDescriptor`), let every session prepare (FlashInfer plans), run the graph, and
return one row of logits per sequence (under tensor parallelism, rank 0's rows on every rank), or
every new token's row for the sequences that ask (`StepSequence.all_logits`: prompt logprobs).
A generation step (`launch`) samples on the device (`BatchSampler`: penalties, bias, logprobs) and
copies the results to pinned host memory behind one event; `collect` waits for that event only.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config.schema import RuntimeConfig
from ..custom_ops.attention.registry import BackendSession, SessionSpec, StepDescriptor, Target, get_backend
from ..custom_ops.attention.cache_format import cache_dtype_name
from ..custom_ops.attention.step_context import using_sessions
from ..custom_ops.tp_all_reduce import WORKSPACE, SymmAllReduceWorkspace
from .artifacts import CompiledModel, TensorParallel
from .data_parallel import IDLE_SEQ_ID, new_host_group
from .errors import CapacityError, OutOfPagesError
from .kv_cache import CacheLayout, MLACacheManager, plan_num_pages
from .page_allocator import PageAllocator
from .piecewise import PiecewiseRunner, bucket_for
from .sampling import (GREEDY, MAX_LOGPROBS, BatchSampler, LogprobTensors, PromptRows, RowSpec, ScoredRows,
                       StepOutput, TokenLogprobs)
from .sequence_info import SequenceInfo, StepSequence

PagesOf = Callable[[int], Sequence[int]]


def step_descriptor(info: SequenceInfo, graph_buckets: Sequence[int] = (), mixed_graph_max_tokens: int = 0,
                    decode_graph: bool = True) -> StepDescriptor:
    """Describe the step `info` holds, and decide once how it runs. A CUDA-graph step is a decode-only
    step padded (with dummy sequences) to one of `graph_buckets`: it may be replayed from a whole-graph
    decode graph (mode "decode_graph" where `decode_graph` is on, else its bucket's pieces); or, with
    mixed graphs on, any other step padded to a bucket <= mixed_graph_max_tokens: it may be replayed
    from that bucket's mixed graph (`static_bounds`, mode "mixed_graph"). Any other step of a bucket
    replays its bucket's pieces ("piecewise"); a token count that is no bucket runs eagerly."""
    num_seqs = info.num_prefill_seqs + info.num_decode_seqs
    decode_only = info.num_prefill_seqs == 0 and info.num_decode_seqs > 0
    t = info.num_padded_tokens
    graph = decode_only and num_seqs == t and t in graph_buckets
    static = not graph and t in graph_buckets and t <= mixed_graph_max_tokens and num_seqs > 0
    if t not in graph_buckets:
        mode = "eager"
    elif graph and decode_graph:
        mode = "decode_graph"
    else:
        mode = "mixed_graph" if static else "piecewise"
    return StepDescriptor(info.num_tokens, t, num_seqs, decode_only, graph or static, static, mode,
                          None if mode == "eager" else t)


def without_static_bounds(step: StepDescriptor) -> StepDescriptor:
    """`step` run on its bucket's pieces instead of the mixed graph (a session declined static bounds)."""
    return replace(step, cuda_graph=False, static_bounds=False, mode="piecewise" if step.bucket else "eager")


def rows_from_rank0(rows: torch.Tensor) -> torch.Tensor:
    """Under tensor parallelism every rank samples from rank 0's logits rows (bitwise-equal rows on
    every rank are the norm, but a rank that differs in the last bit must not pick another token)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return rows
    rows = rows.contiguous()
    with torch.inference_mode():
        dist.broadcast(rows, src=0)
    return rows


def setup_tp_all_reduce(tp: Optional[TensorParallel], device: torch.device
                        ) -> tuple[Optional[SymmAllReduceWorkspace], str]:
    """The symmetric buffer of a graph whose all-reduces are `autodeploy::tp_all_reduce` (shard
    `all_reduce: one_shot`), and a line for the report. Collective: every rank builds its runner at the
    same point. The ranks agree on the outcome, so that either all take the one-shot path or none
    does (a rank alone on it would wait for peers that never come). A rank that fails before the
    rendezvous leaves the others waiting in it; ranks share the torch build and the driver, so a
    failure (no symmetric-memory support) is expected on all of them alike."""
    if tp is None or tp.world_size == 1 or tp.all_reduce != "one_shot":
        return None, tp.all_reduce if tp is not None and tp.world_size > 1 else ""
    if device.type != "cuda":
        return None, f"one_shot asked, {device.type} device: the collective (gloo) runs every all-reduce"
    workspace: Optional[SymmAllReduceWorkspace] = None
    reason = ""
    try:
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise RuntimeError(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy")
        workspace = SymmAllReduceWorkspace(tp.group, device, tp.one_shot_max_bytes)
    except Exception as exc:  # noqa: BLE001 - no symmetric memory here: the collective serves, and says why
        reason = f"{type(exc).__name__}: {exc}"[:300]
    ok = torch.tensor([1 if workspace is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if int(ok.item()) == 0:
        why = reason or "another rank could not set up its symmetric buffer"
        warnings.warn(f"all_reduce: one_shot: {why}; the graph's all-reduces run NCCL", stacklevel=2)
        return None, f"one_shot asked, unavailable ({why}): NCCL runs every all-reduce"
    return workspace, f"one_shot (symmetric memory) up to {tp.one_shot_max_bytes} B, NCCL above"


@dataclass
class HostLogprobs:
    """A step's logprob results in pinned host memory (valid once the step's event fired), and
    what each row is: `sampled` (sequence id, its index in the batch, k) rows first, then the
    `scored` prompt rows (sequence id, targets, k), one per target."""

    chosen: torch.Tensor  # [L] float32
    top_ids: torch.Tensor  # [L, K] int64
    top_vals: torch.Tensor  # [L, K] float32
    sampled: list[tuple[int, int, int]]
    scored: list[tuple[int, Sequence[int], int]]

    def decode(self, ids: Sequence[int]) -> tuple[dict[int, TokenLogprobs], dict[int, list[TokenLogprobs]]]:
        chosen, tids, tvals = self.chosen.tolist(), self.top_ids.tolist(), self.top_vals.tolist()

        def row(j: int, token: int, k: int) -> TokenLogprobs:
            return TokenLogprobs(token, chosen[j], tuple(zip(tids[j][:k], tvals[j][:k])))

        logprobs = {sid: row(j, ids[b], k) for j, (sid, b, k) in enumerate(self.sampled)}
        prompt: dict[int, list[TokenLogprobs]] = {}
        j = len(self.sampled)
        for sid, targets, k in self.scored:
            prompt[sid] = [row(j + i, t, k) for i, t in enumerate(targets)]
            j += len(targets)
        return logprobs, prompt


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its sequences, and where its sampled ids land."""

    order: list[int]  # sequence ids in flat-batch order (row b sampled for order[b])
    ids: torch.Tensor  # host view [num_seqs]: the sampled ids, valid once `done` has fired
    done: Optional[Any]  # CUDA event after the ids' copy to the host (None: already there)
    num_prefill_tokens: int
    num_decode_seqs: int
    start: Optional[Any] = None  # CUDA timing event before the step's first device work (time_steps)
    logprobs: Optional[HostLogprobs] = None  # when some sequence asked for logprobs

    def device_ms(self) -> Optional[float]:
        """Device time of the step, from its first kernel to its ids' copy, once collected (with
        `ModelRunner.time_steps`). Both events are stamped when the GPU reaches them, so a step
        queued while the previous one still runs starts when that one ends: the sum over steps is
        the GPU's busy time (launch gaps inside a step count as busy; the metadata copies of
        prepare, microseconds, do not)."""
        if self.start is None or self.done is None:
            return None
        return float(self.start.elapsed_time(self.done))


class BindingError(RuntimeError):
    """The graph's inputs do not match the signature the passes declared."""


class ModelRunner:
    def __init__(self, compiled: CompiledModel, runtime: RuntimeConfig, device: torch.device, dtype: torch.dtype,
                 target: Target, policies: Optional[Mapping[str, Any]] = None) -> None:
        self.compiled = compiled
        self.gm = compiled.gm
        self.device, self.dtype = torch.device(device), dtype
        self.runtime = runtime
        rt = runtime
        self.seq_info = SequenceInfo(rt.max_batch_size, rt.max_num_tokens, rt.max_seq_len, rt.page_size, self.device)
        sig = compiled.signature
        layouts = [CacheLayout(c.name, c.layer, c.spec) for c in sig.caches]
        num_pages = plan_num_pages(layouts, rt.page_size, rt.max_batch_size, rt.max_seq_len, self.device,
                                   rt.num_pages, rt.free_memory_fraction)
        self.caches = MLACacheManager(layouts, num_pages, rt.page_size, self.device)
        self.allocator = PageAllocator(num_pages, rt.page_size, self.seq_info.max_pages_per_seq)
        self.sessions: dict[str, BackendSession] = {}
        for name, caches in sig.caches_by_backend().items():
            spec = SessionSpec(tuple(c.dims for c in caches), dtype, self.device, target, rt.max_batch_size,
                               rt.max_num_tokens, self.seq_info.max_pages_per_seq,
                               tuple(c.spec.dtype for c in caches), tuple(c.index_topk for c in caches),
                               tuple((n, p) for n, p in (policies or {}).items() if n != name))
            self.sessions[name] = get_backend(name).setup(spec, (policies or {}).get(name))
        workspace, self.tp_all_reduce = setup_tp_all_reduce(compiled.tp, self.device)
        if workspace is not None:
            self.sessions[WORKSPACE] = workspace
        self.piecewise: Optional[PiecewiseRunner] = None
        if compiled.split is not None:
            if compiled.split.source is not self.gm:
                raise BindingError("the split graph was made from another graph than the one to run; "
                                   "`piecewise` must be the last pass that rewrites the graph")
            opts = compiled.runner
            assert opts is not None
            self.piecewise = PiecewiseRunner(compiled.split, self.device, rt.max_num_tokens, compile=opts.compile,
                                             cuda_graphs=opts.cuda_graphs, buckets=opts.buckets,
                                             decode_graph=opts.decode_graph,
                                             mixed_graph_max_tokens=opts.mixed_graph_max_tokens,
                                             dynamic_tokens=opts.dynamic_tokens)
        self._bind()
        self.warmup_report: Optional[dict[str, Any]] = None
        self.sampler = BatchSampler(rt.max_batch_size, self.device)
        # Sampled ids: the previous launched step's (on the device: the next step's decode tokens may
        # come from it), and two pinned host slots, so one step's ids can land while the next is queued.
        self._prev_ids: Optional[torch.Tensor] = None
        pin = self.device.type == "cuda"
        self._ids_host = [torch.zeros(rt.max_batch_size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._ids_slot = 0
        # Logprob results, the same two slots (allocated when a request first asks): [2B] chosen,
        # [2B * 20] top ids and values (flat, so a step's [L, K] view is contiguous).
        self._lp_host: Optional[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None
        #: record CUDA timing events around every launched step (LaunchedStep.device_ms)
        self.time_steps = False
        # Data-parallel attention (runtime/data_parallel.py): the idle step's one-token sequence holds
        # one page for good, so an idle step never waits for a page; the ranks' per-step agreement
        # runs on a gloo group of its own (host flags). Collective: every rank builds its runner here.
        self.dp_host_group: Optional[dist.ProcessGroup] = None
        #: cache pages the runner holds for itself (the idle sequence's), never a request's
        self.reserved_pages = 0
        if compiled.tp is not None and compiled.tp.data_parallel:
            self.allocator.ensure(IDLE_SEQ_ID, 1)
            self.reserved_pages = 1
            self.dp_host_group = new_host_group()

    # ------------------------------------------------------------------ binding
    def _bind(self) -> None:
        """Resolve every graph input by name once: metadata and caches have fixed addresses."""
        sig = self.compiled.signature
        names = [n.target for n in self.gm.graph.nodes if n.op == "placeholder"]
        if self.piecewise is not None:
            top = [n.target for n in self.piecewise.split.module.graph.nodes if n.op == "placeholder"]
            if top != names:
                raise BindingError(f"the split graph's inputs {top} differ from the graph's {names}")
        declared = set(sig.names())
        unknown = [n for n in names if n not in declared]
        missing = [n for n in declared if n not in names]
        if unknown or missing:
            raise BindingError(
                f"graph inputs and signature disagree: inputs not in the signature {unknown}, signature entries "
                f"with no input {missing}. A pass added or removed a graph input without declaring it."
            )
        fixed: list[Optional[torch.Tensor]] = []
        for n in names:
            if n in sig.tokens:
                fixed.append(None)
            elif n in sig.metadata:
                fixed.append(self.seq_info.get(n))
            else:
                fixed.append(self.caches.caches[n])
        self._input_names = names
        self._fixed = fixed
        self._token_slots = [(i, sig.tokens.index(n)) for i, n in enumerate(names) if n in sig.tokens]

    def graph_inputs(self) -> list[torch.Tensor]:
        """This step's graph inputs, in placeholder order (tokens as [1, T] views)."""
        tokens = self.seq_info.graph_inputs()
        args = list(self._fixed)
        for i, k in self._token_slots:
            args[i] = tokens[k]
        return args  # type: ignore[return-value]

    @property
    def input_names(self) -> list[str]:
        return list(self._input_names)

    # ------------------------------------------------------------------ one step
    @property
    def capture_buckets(self) -> tuple[int, ...]:
        return self.piecewise.capture_buckets if self.piecewise is not None else ()

    def padded_size(self, seqs: Sequence[StepSequence]) -> Optional[int]:
        """The token count a step of `seqs` runs as: the CUDA-graph bucket that holds it, or None."""
        buckets = self.capture_buckets
        if not buckets or not seqs:
            return None
        n = sum(len(s.token_ids) for s in seqs)
        return bucket_for(buckets, n, all(s.is_decode for s in seqs), self.seq_info.max_batch_size,
                          self.seq_info.max_num_tokens)

    def describe_step(self, mixed_graph: bool = True) -> StepDescriptor:
        """The descriptor of the step the metadata holds: its mode and bucket are decided here, once
        (`mixed_graph=False`: a step of a mixed-graph bucket replays its pieces instead, as the warm-up
        asks to capture them)."""
        pw = self.piecewise
        mixed_max = pw.mixed_graph_max_tokens if pw is not None and mixed_graph else 0
        return step_descriptor(self.seq_info, self.capture_buckets, mixed_max,
                               decode_graph=pw is not None and pw.decode_graph)

    def prepare(self, seqs: Sequence[StepSequence], pages_of: PagesOf, logits_for: str = "last",
                pad_to: Optional[int] = None, mixed_graph: bool = True) -> tuple[list[int], StepDescriptor]:
        """The host half of a step: pad to a CUDA-graph bucket (unless `pad_to` is given), build the
        metadata (one H2D copy), describe the step (`describe_step`), and let every backend session
        prepare (FlashInfer plans). Returns (sequence ids in flat-batch order, the step's descriptor).
        Pages must already be allocated."""
        order = self.seq_info.prepare_step(seqs, pages_of, self.padded_size(seqs) if pad_to is None else pad_to,
                                           logits_for)
        if self.seq_info.num_device_tokens:
            self._fill_device_tokens()
        step = self.describe_step(mixed_graph)
        if step.static_bounds and not all(s.static_bounds_ok(self.seq_info) for s in self.sessions.values()):
            step = without_static_bounds(step)
        for sess in self.sessions.values():
            sess.prepare(self.seq_info, step)
        return order, step

    def _fill_device_tokens(self) -> None:
        """Decode tokens sampled by the previous step are still on the device: copy them into
        input_ids there (queued after that step's sampling and this step's metadata copy)."""
        if self._prev_ids is None:
            raise RuntimeError("a step asks for tokens sampled on the device, but no step was launched before it")
        info = self.seq_info
        t = info.num_padded_tokens
        src = info.dev["input_src"][:t]
        ids = info.dev["input_ids"][:t]
        prev = self._prev_ids
        with torch.inference_mode():
            ids.copy_(torch.where(src >= 0, prev.index_select(0, src.clamp(min=0, max=prev.numel() - 1)), ids))

    def execute(self, step: StepDescriptor) -> torch.Tensor:
        """The device half of a prepared step: run the graph (its logits output)."""
        args = self.graph_inputs()
        with torch.inference_mode(), using_sessions(self.sessions):
            out = self.piecewise(step, *args) if self.piecewise is not None else self.gm(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

    def forward(self, seqs: Sequence[StepSequence], pages_of: PagesOf, logits_for: str = "last",
                mixed_graph: bool = True, pad_to: Optional[int] = None) -> tuple[list[int], torch.Tensor]:
        """`prepare` then `execute`: (sequence ids in flat-batch order, the graph's logits output)."""
        order, step = self.prepare(seqs, pages_of, logits_for, pad_to=pad_to, mixed_graph=mixed_graph)
        return order, self.execute(step)

    def _logits_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits rows [num_logits_rows, V]: the graph's own rows when gather_logits is
        on, else the `logits_index` rows of the per-token logits."""
        n = self.seq_info.num_logits_rows
        if self.compiled.logits is not None:  # the graph already returns the logits_index rows
            return logits[0, :n]
        return logits[0].index_select(0, self.seq_info.dev["logits_index"][:n])

    def step(self, seqs: Sequence[StepSequence], pages_of: PagesOf) -> tuple[list[int], torch.Tensor]:
        """One engine step: (sequence ids in flat-batch order, logits rows [num_logits_rows, V]:
        each sequence's next-token row, or all its rows where it asks)."""
        order, logits = self.forward(seqs, pages_of)
        rows = self._logits_rows(logits)
        tp = self.compiled.tp
        if tp is not None and tp.world_size > 1 and not tp.data_parallel:
            rows = rows_from_rank0(rows)
        return order, rows

    def launch(self, seqs: Sequence[StepSequence], pages_of: PagesOf, specs: Mapping[int, RowSpec],
               prompt_rows: Optional[Mapping[int, PromptRows]] = None, pad_to: Optional[int] = None) -> LaunchedStep:
        """Queue one generation step without waiting for it: metadata, backend prepare, the graph,
        sampling on the device (`specs`: sequence id -> how its row samples; others greedy), prompt
        logprobs of the sequences in `prompt_rows` (which ask for all their rows), and async copies
        of the results to a pinned host slot, behind one event. `collect` waits for them. `pad_to`: run
        the step as that many tokens (data-parallel attention: the size the ranks agreed on)."""
        timed = self.time_steps and self.device.type == "cuda"
        order, step = self.prepare(seqs, pages_of, pad_to=pad_to)
        start = torch.cuda.Event(enable_timing=True) if timed else None
        if start is not None:  # after the host work of prepare: an idle GPU waiting for it is not busy
            start.record()
        logits = self.execute(step)
        with torch.inference_mode():
            ids, logprobs = self._sample(logits, order, specs, prompt_rows or {})
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event(enable_timing=timed)
            done.record()
        info = self.seq_info
        return LaunchedStep(order, ids, done, info.num_prefill_tokens, info.num_decode_seqs, start, logprobs)

    def _sample(self, logits: torch.Tensor, order: list[int], specs: Mapping[int, RowSpec],
                prompt_rows: Mapping[int, PromptRows]) -> tuple[torch.Tensor, Optional[HostLogprobs]]:
        """The device half of sampling: each sequence's row drawn, penalty state updated, logprobs
        computed, the results' copies to a pinned host slot queued. No host sync."""
        info = self.seq_info
        nb = len(order)
        rows = self._logits_rows(logits)
        last = rows if info.num_logits_rows == nb else rows.index_select(0, info.dev["sample_row"][:nb])
        row_specs = [specs.get(sid, GREEDY) for sid in order]
        scored, scored_meta = self._scored(rows, order, prompt_rows) if prompt_rows else (None, [])
        drawn = self.sampler.draw(last, row_specs, scored)
        ids = drawn.ids
        tp = self.compiled.tp
        if tp is not None and tp.world_size > 1 and not tp.data_parallel:
            ids = rows_from_rank0(ids)  # every rank continues with rank 0's tokens (DP: its own rows)
        out = self.sampler.commit(drawn, ids)
        self._prev_ids = ids
        k = self._ids_slot
        self._ids_slot ^= 1
        slot = self._ids_host[k]
        slot[:nb].copy_(ids, non_blocking=True)
        if out.logprobs is None:
            return slot[:nb], None
        sampled = [(order[b], b, row_specs[b].logprobs) for b in out.logprobs.sampled]
        return slot[:nb], self._copy_logprobs(out.logprobs, k, sampled, scored_meta)

    def _scored(self, rows: torch.Tensor, order: list[int], prompt_rows: Mapping[int, PromptRows]
                ) -> tuple[Optional[ScoredRows], list[tuple[int, Sequence[int], int]]]:
        """The step's prompt rows to score: each asking sequence's first len(targets) rows."""
        info = self.seq_info
        idx: list[int] = []
        targets: list[int] = []
        meta: list[tuple[int, Sequence[int], int]] = []
        for b, sid in enumerate(order):
            pr = prompt_rows.get(sid)
            if pr is None or not len(pr.targets):
                continue
            n = len(pr.targets)
            if n > info.rows_per_seq[b]:
                raise ValueError(f"sequence {sid}: {n} prompt-logprob targets but {info.rows_per_seq[b]} logits "
                                 "rows; a sequence scoring its prompt must ask for all its rows (all_logits)")
            start = info.row_start[b]
            idx.extend(range(start, start + n))
            targets.extend(pr.targets)
            meta.append((sid, pr.targets, pr.k))
        if not idx:
            return None, []
        return ScoredRows(rows, idx, targets, max(k for _, _, k in meta)), meta

    def _copy_logprobs(self, lp: LogprobTensors, slot: int, sampled: list[tuple[int, int, int]],
                       scored: list[tuple[int, Sequence[int], int]]) -> HostLogprobs:
        """Queue the copies of a step's logprob results into host slot `slot` (pinned on CUDA)."""
        if self._lp_host is None:
            pin = self.device.type == "cuda"
            rows = 2 * self.seq_info.max_batch_size  # sampled rows + scored rows
            self._lp_host = [(torch.zeros(rows, dtype=torch.float32, pin_memory=pin),
                              torch.zeros(rows * MAX_LOGPROBS, dtype=torch.int64, pin_memory=pin),
                              torch.zeros(rows * MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin))
                             for _ in range(2)]
        chosen, ids, vals = self._lp_host[slot]
        n, k = lp.top_ids.shape
        chosen = chosen[:n]
        ids, vals = ids[: n * k].view(n, k), vals[: n * k].view(n, k)
        chosen.copy_(lp.chosen, non_blocking=True)
        if k:
            ids.copy_(lp.top_ids, non_blocking=True)
            vals.copy_(lp.top_vals, non_blocking=True)
        return HostLogprobs(chosen, ids, vals, sampled, scored)

    @staticmethod
    def collect(launched: LaunchedStep) -> StepOutput:
        """The launched step's results on the host: sampled ids and logprobs (waits for that step,
        not for later ones)."""
        if launched.done is not None:
            launched.done.synchronize()
        ids = launched.ids.tolist()
        if launched.logprobs is None:
            return StepOutput(ids, {}, {})
        return StepOutput(ids, *launched.logprobs.decode(ids))

    def step_size(self, seqs: Sequence[StepSequence]) -> int:
        """The token count a step of `seqs` runs as: its CUDA-graph bucket, else its tokens (the
        data-parallel lock-step agrees on the largest of the ranks')."""
        return self.padded_size(seqs) or sum(len(s.token_ids) for s in seqs)

    def idle_step(self, pad_to: Optional[int] = None) -> None:
        """Data-parallel attention: a step for a rank with nothing to run while another rank runs one
        (runtime/data_parallel.py): one token at position 0 of the idle sequence, in its reserved
        page, padded to `pad_to` tokens (the size the ranks agreed on), through the whole graph — so
        this rank takes part in every collective of the step (the experts' all-to-all) with the
        others' row count. Its logits are dropped; nothing is sampled."""
        self.forward([StepSequence(IDLE_SEQ_ID, [0], 0)], self.allocator.pages_of, pad_to=pad_to)

    def release(self, seq_id: int) -> None:
        """A request ended: the sampler's device state for it (penalties, bias) may be reused."""
        self.sampler.release(seq_id)

    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits [S, V] of every prompt position, prefilled in chunks (pages freed afterwards).

        Chunks are max_num_tokens long, or max_batch_size when gather_logits is on (the graph then
        returns at most that many rows, here one per token of the chunk). Under data-parallel attention
        every chunk runs padded to the full chunk size (the experts' dispatch needs the same token
        count on every rank: every rank must call this with prompts of the same chunk count)."""
        rid = -1
        gathered = self.compiled.logits is not None
        chunk = self.seq_info.max_num_tokens
        if gathered:
            chunk = min(chunk, self.seq_info.max_batch_size)
        tp = self.compiled.tp
        pad = chunk if tp is not None and tp.data_parallel else None
        self.allocator.ensure(rid, len(prompt))
        outs = []
        try:
            for start in range(0, len(prompt), chunk):
                toks = list(prompt[start : start + chunk])
                _, logits = self.forward([StepSequence(rid, toks, start)], self.allocator.pages_of,
                                         logits_for="all" if gathered else "last", pad_to=pad)
                outs.append(logits[0, : len(toks)].float())
        finally:
            self.allocator.free(rid)
        return torch.cat(outs)

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> dict[str, Any]:
        """Capture every CUDA graph a step of this config can replay (decode graphs, mixed graphs and
        piecewise pieces), on dummy sequences that borrow cache pages and return them, so that no later
        step pays for a capture; on CUDA also one eager step of max_num_tokens (fresh prefill and
        continuation) when that is past the top bucket. Idempotent; returns what was done.

        Per bucket b, largest first: a decode batch of b sequences (b <= max_batch_size: the decode
        graph, or the pieces where decode graphs are off), a prefill of b tokens (the mixed graph where
        b <= mixed_graph_max_tokens, else the pieces), and for a mixed-graph bucket its pieces too, but
        only where some backend session may decline a step of b tokens (`may_decline_static_bounds`:
        the Triton session sends long-prefix chunks piecewise). Where none can, every non-decode step
        of b tokens replays the mixed graph and its pieces are never replayed: not captured
        (`not_needed` says why). A step whose graph capture failed runs piecewise and captures then.

        Largest steps first: the compiled static pieces are compiled dynamic in the token count at
        their first call of >= 2 tokens (runtime/compiled_groups.py), and Inductor sizes and tunes that
        graph's kernels at that count. Ascending order made that 2 tokens when Dynamo still
        specialised the first count: V2-Lite's shared-expert silu*up kernel ran with 128-element blocks
        (one bf16 per thread) at 2048 tokens, 28 µs per layer where it needs ~8 (H200 profile,
        docs/benchmarks/e2e_roofline.md). Tuned at a large count, the same kernels cost small steps
        little: their few programs each cover more elements."""
        if self.warmup_report is not None:
            return self.warmup_report
        t0 = time.perf_counter()
        done, skipped, not_needed = [], {}, {}
        step_seconds: dict[str, float] = {}
        buckets = self.capture_buckets
        info = self.seq_info
        mixed_max = self.piecewise.mixed_graph_max_tokens if self.piecewise is not None else 0
        top = info.max_num_tokens
        past_top = self.device.type == "cuda" and (not buckets or top > max(buckets))
        # The largest steps run eagerly past the top bucket: run them once too, fresh and as a
        # continuation over cached tokens, so that kernels compiled or tuned per shape on first use
        # (Triton specialisations, cuBLAS heuristics) are not paid by the first long prompt.
        shapes = [(kind, top) for kind in (("prefill", "chunk") if past_top else ())]
        for b in sorted(buckets, reverse=True):
            shapes += [("decode", b)] if b <= info.max_batch_size else []
            shapes.append(("prefill", b))
            if b <= mixed_max:
                declining = self.sessions_declining_static_bounds(b)
                if declining:
                    shapes.append(("piecewise", b))
                else:
                    not_needed[f"piecewise:{b}"] = (
                        f"no backend session declines a step of <= {b} tokens (max_seq_len {info.max_seq_len}): "
                        "each replays the mixed graph")
        for kind, n in shapes:
            ts = time.perf_counter()
            try:
                if kind == "piecewise":  # a prefill of a mixed-graph bucket, described to run on its pieces
                    self._warm_step("prefill", n, mixed_graph=False)
                else:
                    self._warm_step(kind, n)
                done.append(f"{kind}:{n}")
            except (CapacityError, OutOfPagesError) as exc:
                skipped[f"{kind}:{n}"] = str(exc)
            step_seconds[f"{kind}:{n}"] = round(time.perf_counter() - ts, 4)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        pw = self.piecewise
        self.warmup_report = {"seconds": time.perf_counter() - t0, "steps": done, "skipped": skipped,
                              "not_needed": not_needed, "step_seconds": step_seconds,
                              "captured": pw.captured() if pw is not None else {},
                              "captures": pw.summary()["captures"] if pw is not None else {}}
        return self.warmup_report

    def sessions_declining_static_bounds(self, num_tokens: int) -> list[str]:
        """The backend sessions that may send a step of <= num_tokens tokens, which a mixed graph could
        replay, piecewise instead (`BackendSession.may_decline_static_bounds`)."""
        return [name for name, s in self.sessions.items()
                if s.may_decline_static_bounds(num_tokens, self.seq_info.max_seq_len)]

    def _warm_step(self, kind: str, n: int, mixed_graph: bool = True) -> None:
        info = self.seq_info
        ids: list[int] = []
        try:
            if kind == "decode":  # n sequences with one cached token each, one new token each
                ids = [-2 - i for i in range(n)]
                self.allocator.ensure_many({i: 2 for i in ids})
                seqs = [StepSequence(i, [0], 1) for i in ids]
            elif kind == "chunk":  # one sequence continuing after a page of cached tokens
                cached = min(self.seq_info.page_size, info.max_seq_len - n)
                if cached < 1:
                    raise CapacityError(f"a {n}-token continuation does not fit max_seq_len {info.max_seq_len}")
                ids = [-2]
                self.allocator.ensure_many({-2: cached + n})
                seqs = [StepSequence(-2, [0] * n, cached)]
            else:  # n prefill tokens over as few sequences as the limits allow
                per = info.max_seq_len
                count = -(-n // per)
                if count > info.max_batch_size:
                    raise CapacityError(f"{n} prefill tokens need {count} sequences of <= {per} tokens")
                lens = [per] * (count - 1) + [n - per * (count - 1)]
                ids = [-2 - i for i in range(count)]
                self.allocator.ensure_many(dict(zip(ids, lens)))
                seqs = [StepSequence(i, [0] * ln, 0) for i, ln in zip(ids, lens)]
            self.forward(seqs, self.allocator.pages_of, mixed_graph=mixed_graph)
        finally:
            for i in ids:
                self.allocator.free(i)

    # ------------------------------------------------------------------ report
    def attention_paths(self) -> list[dict[str, Any]]:
        """Per MLA node (layer): its backend's decode path and prefill path, with reasons, as the
        backend's session for this model routes them (attention/router.py)."""
        out, seen = [], set()
        for c in self.compiled.signature.caches:  # a sparse layer's latent cache comes before its index keys
            sess = self.sessions.get(c.backend)
            if sess is None or c.layer in seen:
                continue
            seen.add(c.layer)
            out.append({"layer": c.layer, "backend": c.backend, **sess.paths(c.dims).to_dict()})
        return out

    def report(self) -> dict[str, Any]:
        caches = self.caches
        return {
            "cache": {
                "num_pages": caches.num_pages,
                "page_size": caches.page_size,
                "layers": len({lay.layer for lay in caches.layouts}),
                "caches": len(caches.caches),  # more than layers where a layer also caches DSA index keys
                "bytes_per_layer": {n: t.numel() * t.element_size() for n, t in caches.caches.items()},
                "total_bytes": caches.total_bytes,
                "dtypes": sorted({cache_dtype_name(t.dtype) for t in caches.caches.values()}),
                "bytes_per_token": sum(lay.spec.bytes_per_token for lay in caches.layouts),
            },
            "graph_inputs": self.input_names,
            "sessions": {name: s.stats() for name, s in self.sessions.items()},
            "attention_paths": self.attention_paths(),
            "tp_all_reduce": self.tp_all_reduce,
            "pieces": self.piecewise.report if self.piecewise is not None else None,
            "piecewise_runner": self.piecewise.summary() if self.piecewise is not None else None,
            "warmup": self.warmup_report,
        }
