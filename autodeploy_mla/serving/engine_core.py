"""The engine core: one model's generation engine in a busy loop, driven by messages.

vLLM V1's split, for the same reason: the engine loop must not share a GIL (or an event loop) with
HTTP parsing, JSON, tokenization and SSE. The API server process sends `AddRequest` /
`AbortRequests` / `Shutdown` over a ZeroMQ PUSH socket; the core takes whatever arrived between two
steps, runs one engine step (with the engine's host/GPU overlap, step i+1 is queued before step i's
tokens are waited for), and sends back ONE `StepOutputs` message carrying every request's new token
(and logprobs) and every request that finished. When it has no work it blocks on its input socket.

`run_core_process` is the engine-core process: it builds the model from the config (so the model,
its CUDA context and its compile caches live only there), warms it up, reports `Ready` with what
the API process needs to validate requests, runs the loop, and on exit reports `Stopped` with the
pages still held (0 unless something leaked). An error at start-up or in the loop is reported as
`CoreFailed` with the traceback, and the process exits with code 1. The core ignores SIGINT: the
API process owns shutdown (Ctrl-C reaches the whole process group) and drains it by message.
The same `EngineCore` also runs in a thread over an already-built model (`ServerThread(om)`).
"""

from __future__ import annotations

import os
import sys
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec
import zmq

from ..runtime.data_parallel import PeerRankFailed
from ..runtime.engine import GenerationEngine, Request
from .messages import (AbortRequests, AddRequest, CoreFailed, CoreInput, CoreOutput, EngineStats, Finished, Logprob,
                       ModelInfo, Progress, Ready, Shutdown, StepOutputs, Stopped, TokenOut)

#: how long an idle core blocks on its input before it re-checks its shutdown deadline and parent
IDLE_POLL_MS = 100
#: data-parallel serving: how long an idle rank waits for input between two agreements with the
#: other ranks (the longest a rank that got a request waits for idle peers to join its first step)
LOCKSTEP_IDLE_POLL_MS = 5


def _logprob(lp: Any) -> Optional[Logprob]:
    if lp is None:
        return None
    return Logprob(int(lp.token), float(lp.logprob), [(int(i), float(v)) for i, v in lp.top])


class EngineCore:
    """Runs `engine` from the messages on `inbox` (PULL) and reports on `outbox` (PUSH)."""

    def __init__(self, engine: GenerationEngine, inbox: zmq.Socket, outbox: zmq.Socket, pages_total: int,
                 pages_free: Callable[[], int], rank: int = 0) -> None:
        self.engine = engine
        self.rank = rank
        self.engine.on_finish = self._on_finish
        self.inbox, self.outbox = inbox, outbox
        self._decoder = msgspec.msgpack.Decoder(CoreInput)
        self._encoder = msgspec.msgpack.Encoder()
        self._pages_total, self._pages_free = pages_total, pages_free
        self._api_id: dict[int, int] = {}  # engine request id -> API request id
        self._engine_id: dict[int, int] = {}  # API request id -> engine request id
        self._requests: dict[int, Request] = {}  # engine id -> its Request, while the core knows it
        self._finished: list[Finished] = []  # requests that ended since the last message
        self._accepting = True
        self._deadline: Optional[float] = None  # end of the shutdown drain
        self._parent = os.getppid()

    # ------------------------------------------------------------------ inputs
    def _take_inputs(self, block: bool, poll_ms: int = IDLE_POLL_MS) -> None:
        if block and not self.inbox.poll(poll_ms):
            return
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._decoder.decode(raw.buffer))

    def _handle(self, msg: CoreInput) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            for api_id in msg.ids:
                rid = self._engine_id.get(api_id)
                if rid is not None:
                    self.engine.cancel(rid, reason="cancelled by the server (client gone or stop string)")
        elif isinstance(msg, Shutdown) and self._deadline is None:
            self._accepting = False
            self._deadline = time.monotonic() + max(0.0, msg.drain_s)

    def _add(self, msg: AddRequest) -> None:
        if not self._accepting:
            self._finished.extend(Finished(i, "error", "the server is shutting down") for i in msg.ids)
            return
        try:
            if len(msg.ids) == 1:
                rids = [self.engine.add_request(msg.prompt, msg.params)]
            else:
                rids = self.engine.add_group(msg.prompt, msg.params, len(msg.ids))
        except ValueError as exc:  # validated by the API process already; a disagreement is reported
            self._finished.extend(Finished(i, "error", str(exc)) for i in msg.ids)
            return
        for api_id, rid in zip(msg.ids, rids):
            self._api_id[rid], self._engine_id[api_id] = api_id, rid
            self._requests[rid] = self.engine.request(rid)

    # ------------------------------------------------------------------ outputs
    def _on_finish(self, r: Request) -> None:
        api_id = self._api_id.get(r.id)
        if api_id is not None:
            self._finished.append(Finished(api_id, r.finish_reason or "error", r.error))

    def _forget_finished(self) -> None:
        """Drop what the core and the engine keep of the requests just reported finished (the engine
        keeps every finished request for `run()`; a server that runs for weeks must not)."""
        for f in self._finished:
            rid = self._engine_id.pop(f.id, None)
            if rid is not None:
                self._api_id.pop(rid, None)
                self._requests.pop(rid, None)
                self.engine.done.pop(rid, None)

    def _token_out(self, rid: int, tok: int) -> Optional[TokenOut]:
        api_id = self._api_id.get(rid)
        if api_id is None:
            return None
        r = self._requests[rid]
        out = TokenOut(api_id, tok)
        if r.params.logprobs is not None and r.logprobs:
            out.logprob = _logprob(r.logprobs[-1])
        if len(r.generated) == 1:
            out.cached_tokens = r.cached_tokens
            if r.params.prompt_logprobs is not None:
                out.prompt_logprobs = [_logprob(lp) for lp in r.prompt_logprobs]
        return out

    def _send(self, msg: CoreOutput) -> None:
        self.outbox.send(self._encoder.encode(msg), copy=False)

    def _stats(self) -> EngineStats:
        eng = self.engine
        return EngineStats(len(eng.running), len(eng.waiting), self._pages_total - self._pages_free(), self._pages_total,
                           eng.allocator.num_cached, eng.prefix_queries, eng.prefix_hits)

    def _flush(self, new: list[tuple[int, int]]) -> None:
        tokens = [t for rid, tok in new if (t := self._token_out(rid, tok)) is not None]
        if tokens or self._finished:
            self._send(StepOutputs(tokens, self._finished, self._stats(), self.rank))
        self._forget_finished()
        self._finished = []

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Serve until shut down (drained, or its drain deadline passed). Returns the pages still
        held after every request was finished (0 unless something leaked)."""
        eng = self.engine
        if eng.lockstep is not None:
            return self._run_lockstep()
        try:
            while True:
                self._take_inputs(block=not eng.has_work())
                if self._deadline is not None and (time.monotonic() >= self._deadline or not eng.has_work()):
                    break
                if os.getppid() != self._parent:
                    break  # the API process is gone: nobody is listening
                if eng.has_work():
                    try:
                        new = eng.step()
                    except Exception as exc:  # noqa: BLE001 - the step's requests fail; serve the rest
                        eng.abandon_inflight(f"{type(exc).__name__}: {exc}")
                        new = []
                    self._flush(new)
                elif self._finished:
                    self._flush([])
        finally:
            self._stop_everything()
        return self._pages_total - self._pages_free()

    def _run_lockstep(self) -> int:
        """Data-parallel attention: this rank's engine steps in lock-step with the other ranks'
        cores (runtime/data_parallel.py), so the loop agrees with them every iteration, with work
        or without: an idle rank waits at most LOCKSTEP_IDLE_POLL_MS for input, then meets the others
        at the agreement (an idle forward when another rank runs a step). A rank that is shutting
        down (drain deadline passed, or no work left after `Shutdown`; or its API process gone)
        cancels what it still holds and says it is leaving; the ranks stop together at the first
        agreement where none has work and none stays. An error on this rank is told to the others at
        their next agreement (`Lockstep.leave`) and ends this core (CoreFailed); another rank's
        error ends it too (`PeerRankFailed`): one rank's cache and collectives cannot go on alone."""
        eng, lockstep = self.engine, self.engine.lockstep
        assert lockstep is not None
        try:
            while True:
                idle = not eng.has_work() and not eng.peers_busy
                self._take_inputs(block=idle, poll_ms=LOCKSTEP_IDLE_POLL_MS)
                gone = os.getppid() != self._parent
                if gone or (self._deadline is not None and time.monotonic() >= self._deadline):
                    self._cancel_all("server shutting down" if not gone else "the API process is gone")
                eng.leaving = gone or (self._deadline is not None and not eng.has_work())
                try:
                    new = eng.step()
                except PeerRankFailed:
                    raise
                except Exception as exc:
                    try:
                        lockstep.leave(f"{type(exc).__name__}: {exc}")
                    except Exception:  # noqa: BLE001 - a peer gone (its connection lost): the error stands
                        pass
                    raise
                self._flush(new)
                agreed = eng.last_agreement
                if agreed is not None and not agreed.any_work and not agreed.any_staying:
                    break
        finally:
            self._stop_everything()
        return self._pages_total - self._pages_free()

    def _cancel_all(self, why: str) -> None:
        """Cancel every request this rank still runs (pages back); their clients get an error."""
        for rid in list(self._api_id):
            self.engine.cancel(rid, reason=why)
        for f in self._finished:
            if f.reason == "cancelled":
                f.reason, f.error = "error", why

    def _stop_everything(self) -> None:
        """Cancel every request still known (pages back) and tell the API process."""
        why = "server shutting down" if self._deadline is not None else "engine stopped"
        try:
            self.engine.drain()
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        for rid in list(self._api_id):
            if not self.engine.cancel(rid, reason=why):
                r = self._requests.get(rid)
                if r is not None and not r.finished:
                    self._finished.append(Finished(self._api_id[rid], "error", why))
        for f in self._finished:
            if f.reason == "cancelled":
                f.reason, f.error = "error", why
        self._flush([])


# ----------------------------------------------------------------------------- the process
@dataclass
class CoreSpec:
    """What the engine-core process is started with (pickled by multiprocessing's spawn)."""

    config: Any  # AppConfig
    input_addr: str  # the API process binds; the core connects (PULL)
    output_addr: str  # (PUSH)
    backend_policies: Optional[dict[str, Any]] = None
    started_at: float = 0.0  # time.time() when the API process started it (the spawn's cost is measured)
    #: data-parallel serving: this core's rank, and the torchrun-style environment of its process group
    #: (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); None: one core, no process group
    rank: int = 0
    rank_env: Optional[dict[str, str]] = None


def model_info(om: Any, startup: dict[str, Any]) -> ModelInfo:
    return ModelInfo(vocab_size=int(om.vocab_size), max_seq_len=int(om.seq_info.max_seq_len),
                     max_batch_size=int(om.seq_info.max_batch_size), eos_token_ids=[int(t) for t in om.eos_token_ids],
                     pages_total=int(om.allocator.num_usable - om.runner.reserved_pages),
                     device=str(om.device), dtype=str(om.dtype).replace("torch.", ""), startup=startup)


def startup_seconds(rep: Any) -> dict[str, Any]:
    """The start-up phases' seconds (a `StartupReport`), flat, for the ready message and the log."""
    d = rep.to_dict()
    out = {"load_s": d["load"]["seconds"], "passes_s": d["passes"]["seconds"], "runner_s": d["runner"]["seconds"],
           "compile_s": d["compile"]["seconds"], "capture_s": d["capture"]["total_seconds"],
           "warmup_s": d["warmup"]["seconds"], "total_s": d["total_seconds"]}
    return {k: v for k, v in out.items() if v is not None}


def serve_model(om: Any, inbox: zmq.Socket, outbox: zmq.Socket, rank: int = 0) -> int:
    """Run an `EngineCore` over a built model until shut down; returns the pages left held."""
    alloc = om.allocator
    # pages for requests: the usable ones less those the runner keeps (data-parallel idle sequence)
    core = EngineCore(om.engine(), inbox, outbox, alloc.num_usable - om.runner.reserved_pages, lambda: alloc.num_free,
                      rank=rank)
    return core.run()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a killed API server leaves no engine
    holding the GPU). Elsewhere the loop's parent check does it, once the model is built."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_core_process(spec: CoreSpec) -> None:
    """The engine-core process: build, warm up, `Ready`, loop, `Stopped` (exit code 0), or
    `CoreFailed` (exit code 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(spec.output_addr)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.input_addr)
    enc = msgspec.msgpack.Encoder()

    def say(msg: CoreOutput) -> None:
        if spec.rank == 0 or not isinstance(msg, Progress):  # one start-up log: rank 0's
            outbox.send(enc.encode(msg))

    code = 0
    try:
        spawned = time.time() - spec.started_at if spec.started_at else None
        from ..api import join_process_group, optimize

        if spec.rank_env is not None:  # data-parallel serving: the group this rank's build shards by
            join_process_group(spec.rank_env, str(spec.config.model.device))

        if spawned is not None:
            say(Progress(f"engine process up {spawned:.1f} s after its start (interpreter, imports); "
                         f"{time.time() - spec.started_at:.1f} s with the model's imports"))
        t0 = time.perf_counter()
        om = optimize(None, spec.config, backend_policies=spec.backend_policies,
                      on_pass=lambda rec: say(Progress(f"pass {rec.name}: {rec.seconds:.2f} s  {rec.summary}")))
        say(Progress(f"built in {time.perf_counter() - t0:.1f} s; warming up (compile, CUDA graphs)"))
        om.warmup()
        rep = om.startup()
        for line in rep.lines():
            say(Progress(f"start-up: {line}"))
        startup = startup_seconds(rep)
        if spec.rank_env is not None and not om.data_parallel:
            raise ValueError(
                f"serving over {spec.rank_env.get('WORLD_SIZE')} ranks needs data-parallel attention "
                "(transforms.shard.attention=data, experts=expert, mlp=replicate or tensor): each rank serves its own "
                "requests. Tensor-parallel serving (every rank stepping the same batch) is not built.")
        say(Ready(model_info(om, startup), spec.rank))
        leaked = serve_model(om, inbox, outbox, spec.rank)
        say(Stopped(leaked, spec.rank))
    except BaseException:  # noqa: BLE001 - reported to the API process, then a non-zero exit
        say(CoreFailed(traceback.format_exc(limit=20), spec.rank))
        code = 1
    finally:
        outbox.close(linger=5000)
        inbox.close(linger=0)
        ctx.term()
    sys.exit(code)
