"""Timing a built model's steps through its ModelRunner, as the engine runs them.

Decode steps one at a time (`run_ours`: wall and device time, the sampling sync included) or queued
as the engine queues them (`time_decode_stream`: step i+1 launched before step i's ids are
collected), fresh prefills alone or back to back; caches filled with random latents so only the
timed step runs through the model. Shared by the end-to-end, roofline, profile and tensor-parallel
benchmarks so that their numbers mean the same thing.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

from benchmarks.lib.product import StepSequence, step_descriptor
from benchmarks.lib.timing import sync


def step_stats(ts: list[float]) -> dict[str, float]:
    ts = sorted(ts)
    return {
        "step_ms": statistics.median(ts),
        "p10_ms": ts[max(0, len(ts) // 10)],
        "p90_ms": ts[min(len(ts) - 1, (9 * len(ts)) // 10)],
        "steps": len(ts),
    }


def fill_ours(om, batch: int, context: int, extra: int) -> None:
    alloc = om.runner.allocator
    for sid in alloc.owners():
        alloc.free(sid)
    alloc.ensure_many({sid: context + extra for sid in range(batch)})
    g = torch.Generator(device=om.device).manual_seed(batch * 7 + context)
    for c in om.runner.caches.caches.values():
        if c.dtype.itemsize == 1:  # e4m3: no random kernel; fill through bf16 a page block at a time
            for lo in range(0, c.shape[0], 256):
                blk = c[lo : lo + 256]
                blk.copy_(torch.randn(blk.shape, generator=g, device=c.device, dtype=torch.bfloat16))
        else:
            c.normal_(generator=g)


def decode_step(runner, batch: int, pos: int, tok: list[int], start: Optional["torch.cuda.Event"] = None,
                launch: Optional["torch.cuda.Event"] = None, host: Optional[list[float]] = None) -> torch.Tensor:
    """One decode step of `batch` sequences at position `pos` (token tok[s] for sequence s): the logits
    rows [batch, V] they sample from (all decode: flat-batch order = sequence order). `start` is
    recorded after the step's metadata is built and copied, before the backends' prepare hooks and
    the first launch: where the step's device time starts (as ModelRunner.prepare does, in pieces).
    `launch` is recorded after the prepare hooks, right before the graph runs; `host` gets the wall
    seconds of those hooks appended (the host work an isolated step's GPU waits for)."""

    seqs = [StepSequence(s, [tok[s]], pos) for s in range(batch)]
    runner.seq_info.prepare_step(seqs, runner.allocator.pages_of, runner.padded_size(seqs))
    if start is not None:
        start.record()
    t0 = time.perf_counter()
    step = step_descriptor(runner.seq_info, runner.capture_buckets)
    for sess in runner.sessions.values():
        sess.prepare(runner.seq_info, step)
    if host is not None:
        host.append(time.perf_counter() - t0)
    if launch is not None:
        launch.record()
    return runner.execute(step)[0, :batch]


def run_ours(om, piecewise, batch: int, context: int, steps: int, warmup: int, profile: bool) -> dict[str, Any]:
    """Time decode steps with `piecewise` as the runner's step runner (None: the flat graph, eager)."""
    runner = om.runner
    saved_pw = runner.piecewise
    cuda = om.device.type == "cuda"
    tok = [1] * batch
    ts: list[float] = []
    dev_ts: list[float] = []
    run_ts: list[float] = []
    host: list[float] = []
    pos0 = context - warmup
    try:
        runner.piecewise = piecewise
        for i in range(warmup + steps):
            sync(om.device)
            t0 = time.perf_counter()
            ev0 = torch.cuda.Event(enable_timing=True) if cuda else None
            evl = torch.cuda.Event(enable_timing=True) if cuda else None
            rows = decode_step(runner, batch, pos0 + i, tok, ev0, evl, host if i >= warmup else None)
            if cuda:
                ev1 = torch.cuda.Event(enable_timing=True)
                ev1.record()
            tok = rows.argmax(-1).tolist()  # the sampling sync
            if i >= warmup:
                ts.append((time.perf_counter() - t0) * 1e3)
                if cuda:
                    dev_ts.append(ev0.elapsed_time(ev1))
                    run_ts.append(evl.elapsed_time(ev1))
        res = step_stats(ts)
        if host:  # the backends' prepare hooks (FlashInfer plans ...): host work before the graph runs
            res["prepare_host_ms"] = statistics.median(host) * 1e3
        if dev_ts:
            # GPU time from the step's first launch to its last kernel's end (incl. launch gaps)
            res["device_ms"] = statistics.median(dev_ts)
            # ... and from after the prepare hooks: the graph (or pieces) alone
            res["run_ms"] = statistics.median(run_ts)
        if profile and cuda:
            res.update(profile_kernels(om, batch, pos0 + warmup + steps, tok))
    finally:
        runner.piecewise = saved_pw
    return res


def profile_top(fn: Callable[[], Any], steps: int, top: int, device: torch.device) -> dict[str, Any]:
    """torch.profiler over `fn()` (which runs `steps` steps): device-side event time (kernels, memcpy,
    memset) per step, and the `top` kernel names by device time with their µs and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    events = device_events(prof)
    total_us = sum(us for _, us in events)
    res: dict[str, Any] = {"kernel_ms": total_us / 1e3 / steps, "kernels_per_step": len(events) / steps}
    if top:
        per: dict[str, list[float]] = {}
        for name, us in events:
            per.setdefault(name, []).append(us)
        ranked = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
        res["top"] = [{"kernel": name[:120], "us": sum(v) / steps, "launches": len(v) / steps} for name, v in ranked]
    return res


def profile_kernels(om, batch: int, pos: int, tok: list[int], steps: int = 5, top: int = 0) -> dict[str, Any]:
    """profile_top over `steps` decode steps of `batch` sequences from position `pos`."""

    def run() -> None:
        t = tok
        for i in range(steps):
            t = decode_step(om.runner, batch, pos + i, t).argmax(-1).tolist()

    return profile_top(run, steps, top, om.device)


def profile_decode(om, batch: int, context: int, steps: int = 5, top: int = 25) -> dict[str, Any]:
    """profile_kernels over `steps` decode steps of `batch` sequences at `context` cached tokens."""
    fill_ours(om, batch, context, steps + 8)
    try:
        return profile_kernels(om, batch, context, [1] * batch, steps, top)
    finally:
        for sid in list(om.runner.allocator.owners()):
            om.runner.allocator.free(sid)


def profile_prefill(om, tokens: int, steps: int = 3, top: int = 25) -> dict[str, Any]:
    """profile_top over `steps` fresh prefills of `tokens` tokens (time_prefill_stream's steps)."""
    return profile_top(lambda: time_prefill_stream(om, tokens, steps), steps, top, om.device)


def device_events(prof) -> list[tuple[str, float]]:
    """(name, device µs) of every device-side event (kernels, memcpy, memset) a profile recorded."""
    out = []
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        dt = getattr(e, "device_time", None)
        if dt is None:
            dt = getattr(e, "cuda_time", 0.0)
        out.append((e.name, float(dt)))
    return out


def time_decode(om, batch: int, context: int, steps: int, warmup: int) -> dict[str, float]:
    """Median wall and device time of a decode step (e2e_decode.run_ours with the runner as built)."""
    fill_ours(om, batch, context, warmup + steps + 8)
    try:
        r = run_ours(om, om.runner.piecewise, batch, context, steps, warmup, profile=False)
    finally:
        for sid in list(om.runner.allocator.owners()):
            om.runner.allocator.free(sid)
    return {k: r[k] for k in ("step_ms", "device_ms", "run_ms", "prepare_host_ms") if k in r}


def time_prefill(om, tokens: int, reps: int) -> dict[str, float]:

    runner = om.runner
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(2, om.vocab_size, (tokens,), generator=g).tolist()
    ts = []
    for i in range(reps + 1):
        runner.allocator.ensure(0, tokens)
        try:
            sync(om.device)
            t0 = time.perf_counter()
            _, logits = runner.forward([StepSequence(0, ids, 0)], runner.allocator.pages_of)
            logits[0, :1].argmax(-1).tolist()
            if i:  # the first is a warm-up
                ts.append((time.perf_counter() - t0) * 1e3)
        finally:
            runner.allocator.free(0)
    return {"step_ms": statistics.median(ts)}


def time_prefill_stream(om, tokens: int, steps: int) -> dict[str, float]:
    """Fresh prefills of `tokens` tokens queued back to back, as the engine runs a queue of prompts:
    `ModelRunner.launch` without waiting, so the host prepares step i+1 while the GPU runs step i.
    Per step: the GPU time from the end of the first step to the end of the last, over steps - 1
    (CUDA events; any wait for the host in between counts). The isolated step of `time_prefill`
    also pays its host preparation with the GPU idle."""

    runner = om.runner
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(2, om.vocab_size, (tokens,), generator=g).tolist()
    timed, runner.time_steps = runner.time_steps, True
    launched = []
    try:
        sync(om.device)
        for _ in range(steps):
            runner.allocator.ensure(0, tokens)  # the same pages each step: the stream orders the steps
            try:
                launched.append(runner.launch([StepSequence(0, ids, 0)], runner.allocator.pages_of, {}))
            finally:
                runner.allocator.free(0)
        for step in launched:
            runner.collect(step)
    finally:
        runner.time_steps = timed
    per = launched[0].done.elapsed_time(launched[-1].done) / (steps - 1)
    dev = [s.device_ms() for s in launched[1:]]
    return {"stream_ms": per, "stream_device_ms": statistics.median(d for d in dev if d is not None)}


def time_decode_stream(om, batch: int, context: int, steps: int, warmup: int = 3) -> dict[str, float]:
    """Decode steps queued as the engine queues them (runtime/engine.py, overlap on): step i+1 is
    launched before step i's ids are collected, its tokens taken on the device from step i's
    sampled rows (`StepSequence.src_row`), so scheduling, metadata and backend prepare of step i+1
    run while the GPU computes step i. Per step: GPU time from the end of the first step to the end of
    the last over steps - 1 (CUDA events; any wait for the host in between counts). This is the
    inter-token time of a batch in steady state; `time_decode` also pays each step's host work and
    sampling sync with the GPU idle. The first `warmup` steps are not timed (first uses of the
    device-token path)."""

    runner = om.runner
    steps += warmup
    fill_ours(om, batch, context, steps + 8)
    timed, runner.time_steps = runner.time_steps, True
    launched = []
    pos0 = context
    try:
        sync(om.device)
        prev = None
        for i in range(steps):
            if prev is None:
                seqs = [StepSequence(s, [1], pos0 + i) for s in range(batch)]
            else:
                row = {sid: r for r, sid in enumerate(prev.order)}
                seqs = [StepSequence(s, [0], pos0 + i, src_row=row[s]) for s in range(batch)]
            cur = runner.launch(seqs, runner.allocator.pages_of, {})
            if prev is not None:
                runner.collect(prev)
            launched.append(cur)
            prev = cur
        runner.collect(prev)
    finally:
        runner.time_steps = timed
        for sid in list(runner.allocator.owners()):
            runner.allocator.free(sid)
    if launched[0].done is None:  # CPU (plumbing runs): no device events
        return {}
    per = launched[warmup].done.elapsed_time(launched[-1].done) / (steps - 1 - warmup)
    return {"stream_ms": per}
