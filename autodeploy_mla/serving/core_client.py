"""The API process's side of the engine core (vLLM's AsyncLLM role): starts the core (a process
of its own, or a thread over a model already built), sends it requests, and hands each request the
outputs that the core's one-message-per-step stream carries for it.

ZeroMQ (pyzmq) carries the messages, msgspec encodes them (serving/messages.py; why these two:
docs/serving.md). The API process binds two IPC sockets in a private temporary directory; the core
connects. One asyncio task reads the core's messages and puts each request's tokens and its end
on that request's queue (one `put_nowait` per token, no thread hop); a watchdog task notices a core
that died without saying so (killed, crashed in native code) and fails every open request, so no
client waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

import msgspec
import zmq
import zmq.asyncio

from ..runtime.sampling import SamplingParams
from .engine_core import CoreSpec, run_core_process, serve_model
from .messages import (AbortRequests, AddRequest, CoreFailed, CoreOutput, EngineStats, Finished, ModelInfo, Progress,
                       Ready, Shutdown, StepOutputs, Stopped)

log = logging.getLogger("autodeploy.serve")

STARTING, READY, FAILED, STOPPED = "starting", "ready", "failed", "stopped"
WATCHDOG_S = 0.2


class CoreHandle(Protocol):
    """Where the engine core runs: a process, or a thread of this process."""

    def start(self, input_addr: str, output_addr: str) -> None: ...

    def is_alive(self) -> bool: ...

    def exit_description(self) -> str: ...

    def join(self, timeout_s: float) -> None: ...

    def kill(self) -> None: ...


class ProcessCore:
    """The engine core in a process of its own (spawned: CUDA-safe), building the model from `config`."""

    def __init__(self, config: Any, backend_policies: Optional[dict[str, Any]] = None) -> None:
        self.config, self.backend_policies = config, backend_policies
        self.process: Optional[mp.process.BaseProcess] = None

    def start(self, input_addr: str, output_addr: str) -> None:
        spec = CoreSpec(self.config, input_addr, output_addr, self.backend_policies, started_at=time.time())
        # not a daemon: the build may start processes of its own (compile workers); the core dies
        # with this process anyway (PR_SET_PDEATHSIG, and its loop watches its parent)
        self.process = mp.get_context("spawn").Process(target=run_core_process, args=(spec,), name="autodeploy-core")
        self.process.start()

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def exit_description(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        if code is not None and code < 0:
            return f"the engine process was killed by signal {-code}"
        return f"the engine process exited with code {code}"

    def join(self, timeout_s: float) -> None:
        if self.process is not None:
            self.process.join(timeout_s)

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)


class ThreadCore:
    """The engine core in a thread of this process, over a model built already (notebooks, tests:
    it shares this process's GIL with the HTTP server, so it is not the way to serve fast)."""

    def __init__(self, om: Any) -> None:
        self.om = om
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None

    def start(self, input_addr: str, output_addr: str) -> None:
        self.thread = threading.Thread(target=self._run, args=(input_addr, output_addr), name="autodeploy-core",
                                       daemon=True)
        self.thread.start()

    def _run(self, input_addr: str, output_addr: str) -> None:
        import traceback

        from .engine_core import model_info, startup_seconds

        ctx = zmq.Context.instance()
        outbox, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        outbox.connect(output_addr)
        inbox.connect(input_addr)
        enc = msgspec.msgpack.Encoder()
        try:
            self.om.warmup()
            outbox.send(enc.encode(Ready(model_info(self.om, startup_seconds(self.om.startup())))))
            outbox.send(enc.encode(Stopped(serve_model(self.om, inbox, outbox))))
        except BaseException:  # noqa: BLE001 - reported like a process core's failure
            self.error = traceback.format_exc(limit=20)
            outbox.send(enc.encode(CoreFailed(self.error)))
        finally:
            outbox.close(linger=2000)
            inbox.close(linger=0)

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        return "the engine thread ended" + (f": {self.error.strip().splitlines()[-1]}" if self.error else "")

    def join(self, timeout_s: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)

    def kill(self) -> None:  # a thread cannot be killed; the daemon thread ends with the process
        pass


@dataclass
class RequestStream:
    """The outputs of one prompt's choices: (`TokenOut` | `Finished`) items on `queue`."""

    ids: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class EngineCoreClient:
    def __init__(self, core: CoreHandle, on_failure: Optional[Callable[[str], None]] = None,
                 on_progress: Optional[Callable[[str], None]] = None) -> None:
        self.core = core
        self.state = STARTING
        self.info: Optional[ModelInfo] = None
        self.error: Optional[str] = None
        self.stats = EngineStats(0, 0, 0, 0)
        self.progress = "starting the engine core"
        self.pages_leaked: Optional[int] = None
        self.on_failure, self.on_progress = on_failure, on_progress
        #: per finished request, hooks the server registers (metrics)
        self.on_step: Optional[Callable[[StepOutputs], None]] = None
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count()
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._dir: Optional[str] = None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Union[StepOutputs, Progress, Ready, CoreFailed, Stopped])

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Bind the sockets, start the core, and the reader and watchdog tasks. Returns at once:
        `wait_ready()` waits for the model."""
        self._dir = tempfile.mkdtemp(prefix="autodeploy-ipc-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(out_addr)
        self.core.start(in_addr, out_addr)
        self._tasks = [asyncio.create_task(self._read(), name="autodeploy-core-reader"),
                       asyncio.create_task(self._watch(), name="autodeploy-core-watchdog")]

    async def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
        """True once the core is ready; False if it failed (or `timeout_s` passed first)."""
        waiter = asyncio.ensure_future(self._ready.wait())
        done, _ = await asyncio.wait([waiter, asyncio.ensure_future(self._stopped.wait())], timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        return self.state == READY

    @property
    def alive(self) -> bool:
        return self.state == READY and self.core.is_alive()

    def begin_shutdown(self, drain_s: float) -> None:
        """Tell the core to stop taking requests, drain for `drain_s`, then cancel the rest."""
        if self.state == READY and self._ctx is not None:
            self._send(Shutdown(drain_s))

    async def shutdown(self, drain_s: float, timeout_s: float = 60.0) -> None:
        """Stop the core and close: a core still building is stopped at once (it holds no
        requests); a ready one is told to drain (`begin_shutdown`) and waited for (it reports
        `Stopped`, then exits)."""
        if self.state == STARTING:
            self.core.kill()
        self.begin_shutdown(drain_s)
        if self.state == READY:
            try:
                await asyncio.wait_for(self._stopped.wait(), drain_s + timeout_s)
            except asyncio.TimeoutError:
                log.warning("the engine core did not stop within %.0f s; killing it", drain_s + timeout_s)
        await asyncio.get_running_loop().run_in_executor(None, self.core.join, 30.0)
        self.core.kill()
        self._fail_open("server shutting down")
        if self.state != FAILED:
            self.state = STOPPED
        self._stopped.set()
        for t in self._tasks:
            t.cancel()
        if self._ctx is not None:
            self._in.close(linger=0)
            self._out.close(linger=0)
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ------------------------------------------------------------------ requests
    def add(self, prompt: list[int], params: SamplingParams, n: int = 1,
            queue: Optional[asyncio.Queue] = None) -> RequestStream:
        """Queue one prompt as `n` choices; its outputs arrive on the returned stream's queue
        (`queue`: one that several streams of one HTTP request share)."""
        ids = [next(self._ids) for _ in range(n)]
        stream = RequestStream(ids, queue if queue is not None else asyncio.Queue())
        for i in ids:
            self._streams[i] = stream
        self._send(AddRequest(ids, prompt, params))
        return stream

    def abort(self, ids: list[int]) -> None:
        """Cancel these requests (if still running); their ends still arrive on their streams."""
        live = [i for i in ids if i in self._streams]
        if live and self.state == READY:
            self._send(AbortRequests(live))

    def _send(self, msg: Any) -> None:
        self._in.send(self._enc.encode(msg), copy=False)

    # ------------------------------------------------------------------ the core's messages
    async def _read(self) -> None:
        while True:
            raw = await self._out.recv(copy=False)
            msg: CoreOutput = self._dec.decode(raw.buffer)
            if isinstance(msg, StepOutputs):
                self._dispatch(msg)
            elif isinstance(msg, Ready):
                self.info, self.state, self.progress = msg.info, READY, "ready"
                self._ready.set()
            elif isinstance(msg, Progress):
                self.progress = msg.message
                if self.on_progress is not None:
                    self.on_progress(msg.message)
            elif isinstance(msg, CoreFailed):
                self._failed(f"the engine core failed: {msg.error.strip().splitlines()[-1]}", msg.error)
            elif isinstance(msg, Stopped):
                self.pages_leaked = msg.pages_leaked
                self._fail_open("server shutting down")
                self.state = STOPPED
                self._stopped.set()

    def _dispatch(self, msg: StepOutputs) -> None:
        self.stats = msg.stats
        streams = self._streams
        for t in msg.tokens:
            s = streams.get(t.id)
            if s is not None:
                s.queue.put_nowait(t)
        for f in msg.finished:
            s = streams.pop(f.id, None)
            if s is not None:
                s.queue.put_nowait(f)
        if self.on_step is not None:
            self.on_step(msg)

    async def _watch(self) -> None:
        while self.state in (STARTING, READY):
            await asyncio.sleep(WATCHDOG_S)
            if self.state in (STARTING, READY) and not self.core.is_alive():
                await asyncio.sleep(WATCHDOG_S)  # a last message may still be on its way
                if self.state in (STARTING, READY):
                    self._failed(self.core.exit_description())

    def _failed(self, why: str, detail: str = "") -> None:
        if self.state == FAILED:
            return
        self.state, self.error = FAILED, why
        log.error("%s%s", why, f"\n{detail}" if detail else "")
        self._fail_open(why)
        self._ready.set()
        self._stopped.set()
        if self.on_failure is not None:
            self.on_failure(why)

    def _fail_open(self, why: str) -> None:
        """End every open request with an error (its client is told; nothing waits forever)."""
        for i, s in list(self._streams.items()):
            s.queue.put_nowait(Finished(i, "error", why))
        self._streams.clear()

