"""The engine in its own thread, fed by the HTTP server between steps (continuous batching).

The generation engine is not thread-safe and must not block the server's event loop, so one
thread owns it: between two steps it takes new requests and cancellations from thread-safe inboxes,
then runs one step and hands each new token (and each finished request) to the request's asyncio
queue on the server's loop. A request arriving over HTTP therefore joins the running batch at the
next step. Validation (`validate`) reads only fixed limits and may run on the server's thread, so a
bad request is answered before it is queued.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..api import OptimizedModel
from ..runtime.engine import GenerationEngine, Request
from ..runtime.sampling import SamplingParams
from .metrics import ServingMetrics


@dataclass
class RequestHandle:
    """The server's side of one request (one choice). Events arrive on `events` (a queue the
    choices of one HTTP request may share) as (index, "token", id), (index, "error", message), and
    last (index, "finish", Request)."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    index: int = 0
    arrived: float = field(default_factory=time.monotonic)
    request_id: Optional[int] = None  # the engine's id, once the engine thread took the request
    cancelled: bool = False
    first_token: Optional[float] = None
    last_token: Optional[float] = None

    def post(self, event: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))
        except RuntimeError:  # the server's loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, om: OptimizedModel, metrics: Optional[ServingMetrics] = None, idle_wait_s: float = 0.02) -> None:
        self.om = om
        self.metrics = metrics or ServingMetrics()
        self.engine: GenerationEngine = om.engine()
        self.engine.on_finish = self._finished
        self._inbox: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}
        self._wake = threading.Event()
        self._accepting = True
        self._deadline: Optional[float] = None  # set by begin_shutdown: when the drain ends
        self._idle_wait_s = idle_wait_s
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None  # what stopped the engine thread, if anything
        # Requests that finished during a step: told after that step's tokens, so "finish" comes last.
        self._in_step = False
        self._step_finished: list[Request] = []
        self.metrics.pages_total.set(om.allocator.num_usable)

    # ------------------------------------------------------------------ server side
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autodeploy-engine", daemon=True)
        self._thread.start()

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as ids, or RequestError / CapacityError naming the value and the limit."""
        return self.engine.validate(prompt, params)

    def submit(self, prompt: list[int], params: SamplingParams, events: Optional[asyncio.Queue] = None,
               index: int = 0) -> RequestHandle:
        """Queue a validated request; it joins the batch at the engine's next step."""
        if not self._accepting:
            raise RuntimeError("the server is shutting down")
        handle = RequestHandle(prompt, params, asyncio.get_running_loop(), events or asyncio.Queue(), index)
        self._inbox.put(handle)
        self._wake.set()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request (client gone, stop string seen); its pages come back at the next step."""
        if not handle.cancelled:
            handle.cancelled = True
            self._cancels.put(handle)
            self._wake.set()

    def begin_shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting now; the engine thread lets running requests finish for up to
        `drain_timeout_s`, then cancels the rest (their clients get an error event) and exits.
        Returns at once: the HTTP server waits for the streams, which end when their requests do."""
        if self._deadline is None:
            self._accepting = False
            self._deadline = time.monotonic() + drain_timeout_s
            self._wake.set()

    def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """`begin_shutdown`, then wait for the engine thread to end."""
        self.begin_shutdown(drain_timeout_s)
        if self._thread is not None:
            self._thread.join(timeout=drain_timeout_s + 30)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                self._take_inbox()
                self._take_cancels()
                if self._deadline is not None and (time.monotonic() >= self._deadline or not eng.has_work()):
                    break  # shutting down: drained, or out of time (the rest are cancelled below)
                if eng.has_work():
                    self._step()
                else:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported by /health and to every request
            self.error = exc
        finally:
            self._stop_everything()

    def _take_inbox(self) -> None:
        while True:
            try:
                h = self._inbox.get_nowait()
            except queue.Empty:
                return
            if h.cancelled:
                continue
            try:
                rid = self.engine.add_request(h.prompt, h.params)
            except ValueError as exc:
                h.post(("error", str(exc)))
                continue
            h.request_id = rid
            self._handles[rid] = h

    def _take_cancels(self) -> None:
        while True:
            try:
                h = self._cancels.get_nowait()
            except queue.Empty:
                return
            if h.request_id is not None:
                self.engine.cancel(h.request_id, reason="cancelled by the server (client gone or stop string)")

    def _step(self) -> None:
        self._in_step = True
        try:
            new = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine failed this step's requests; serve the rest
            self.engine.abandon_inflight(f"{type(exc).__name__}: {exc}")
            new = []
        finally:
            self._in_step = False
        now = time.monotonic()
        for rid, tok in new:
            h = self._handles.get(rid)
            if h is None:
                continue
            if h.first_token is None:
                h.first_token = now
                self.metrics.ttft.observe(now - h.arrived)
            elif h.last_token is not None:
                self.metrics.itl.observe(now - h.last_token)
            h.last_token = now
            h.post(("token", tok))
        finished, self._step_finished = self._step_finished, []
        for r in finished:
            self._finished(r)
        eng = self.engine
        self.metrics.tokens(len(new), now)
        self.metrics.running.set(len(eng.running))
        self.metrics.waiting.set(len(eng.waiting) + self._inbox.qsize())
        self.metrics.pages_used.set(self.om.allocator.num_usable - self.om.allocator.num_free)

    def _finished(self, r: Request) -> None:
        if self._in_step:
            self._step_finished.append(r)
            return
        h = self._handles.pop(r.id, None)
        self.metrics.finished.labels(finish_reason=r.finish_reason or "unknown").inc()
        self.metrics.prompt.inc(len(r.prompt))
        if h is None:
            return
        if h.first_token is not None:
            self.metrics.e2e.observe(time.monotonic() - h.arrived)
        h.post(("finish", r))

    def _stop_everything(self) -> None:
        """Cancel every request still known (their pages come back) and tell their clients."""
        why = f"engine stopped: {type(self.error).__name__}: {self.error}" if self.error else "server shutting down"
        try:
            self.engine.drain()
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        for rid in list(self._handles):
            h = self._handles.pop(rid)
            self.engine.cancel(rid, reason=why)  # pages back (False if it had just finished)
            h.post(("error", why))
        while True:
            try:
                h = self._inbox.get_nowait()
            except queue.Empty:
                break
            h.post(("error", why))
