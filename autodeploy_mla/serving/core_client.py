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
    """Where the engine core runs: a process, a thread of this process, or one process per
    data-parallel rank (`ranks` of them: one input address each, one shared output address)."""

    ranks: int

    def start(self, input_addrs: list[str], output_addr: str) -> None: ...

    def is_alive(self) -> bool: ...

    def exit_description(self) -> str: ...

    def join(self, timeout_s: float) -> None: ...

    def kill(self) -> None: ...


class ProcessCore:
    """The engine core in a process of its own (spawned: CUDA-safe), building the model from `config`."""

    ranks = 1

    def __init__(self, config: Any, backend_policies: Optional[dict[str, Any]] = None) -> None:
        self.config, self.backend_policies = config, backend_policies
        self.process: Optional[mp.process.BaseProcess] = None

    def start(self, input_addrs: list[str], output_addr: str) -> None:
        spec = CoreSpec(self.config, input_addrs[0], output_addr, self.backend_policies, started_at=time.time())
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

    ranks = 1

    def __init__(self, om: Any) -> None:
        self.om = om
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None

    def start(self, input_addrs: list[str], output_addr: str) -> None:
        self.thread = threading.Thread(target=self._run, args=(input_addrs[0], output_addr), name="autodeploy-core",
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


def data_parallel_configs(config: Any, world_size: int) -> list[Any]:
    """Each rank's config for data-parallel serving: the shard pass on over `world_size` ranks and,
    on CUDA, the rank's own GPU. Refuses, before any process starts, a layout that is not
    data-parallel attention (the only one whose ranks serve requests of their own)."""
    shard = dict((config.transforms or {}).get("shard") or {})
    if shard.get("attention") != "data":
        raise ValueError(
            f"serving over {world_size} ranks needs data-parallel attention: transforms.shard.attention=data (got "
            f"{shard.get('attention', 'tensor')!r}), with experts=expert and mlp=replicate or tensor (docs/parallel_layouts.md). "
            "Tensor-parallel serving (every rank stepping the same batch) is not built; serve with --world-size 1.")
    out = []
    for r in range(world_size):
        transforms = {**(config.transforms or {}), "shard": {**shard, "enabled": True, "world_size": world_size}}
        update: dict[str, Any] = {"transforms": transforms}
        dev = str(config.model.device)
        if dev.startswith("cuda"):
            update["model"] = config.model.model_copy(update={"device": f"cuda:{r}"})
        out.append(config.model_copy(update=update, deep=True))
    return out


class RankedCores:
    """Data-parallel serving: one engine-core process per rank, each with its own model copy
    (attention weights whole, its share of the experts), cache and requests; the ranks meet once per
    step (runtime/data_parallel.py) and every forward's expert all-to-all joins them. The API process
    sends each request to one rank (`EngineCoreClient`: the least loaded by tokens) and reads every
    rank's step messages from one socket."""

    def __init__(self, configs: list[Any], backend_policies: Optional[dict[str, Any]] = None) -> None:
        if len(configs) < 2:
            raise ValueError(f"RankedCores: {len(configs)} config(s); data-parallel serving needs >= 2 ranks")
        self.configs, self.backend_policies = configs, backend_policies
        self.ranks = len(configs)
        self.processes: list[mp.process.BaseProcess] = []

    def start(self, input_addrs: list[str], output_addr: str) -> None:
        from ..api import rendezvous_port

        port, n = rendezvous_port(), self.ranks
        for r, cfg in enumerate(self.configs):
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(r)}
            spec = CoreSpec(cfg, input_addrs[r], output_addr, self.backend_policies, started_at=time.time(), rank=r,
                            rank_env=env)
            p = mp.get_context("spawn").Process(target=run_core_process, args=(spec,), name=f"autodeploy-core-{r}")
            p.start()
            self.processes.append(p)

    @property
    def pid(self) -> Optional[int]:
        return self.processes[0].pid if self.processes else None

    @property
    def pids(self) -> list[Optional[int]]:
        return [p.pid for p in self.processes]

    def is_alive(self) -> bool:
        """True while every rank lives: the ranks step together, so one gone stops them all."""
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def exit_description(self) -> str:
        for r, p in enumerate(self.processes):
            code = p.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"the engine process of rank {r} of {self.ranks} {how}"
        return "the engine processes are running"

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(10)


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
        #: data-parallel serving (core.ranks > 1): each request's rank and token cost, each rank's load
        self.ranks = int(getattr(core, "ranks", 1))
        self._owner: dict[int, int] = {}
        self._cost: dict[int, int] = {}
        self.rank_load = [0] * self.ranks
        self.rank_requests = [0] * self.ranks  # requests (choices) sent to each rank so far
        self._rank_stats: dict[int, EngineStats] = {}
        self._ready_infos: dict[int, ModelInfo] = {}
        self._stopped_ranks: set[int] = set()
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
        in_addrs = [f"ipc://{self._dir}/in" + (str(r) if self.ranks > 1 else "") for r in range(self.ranks)]
        out_addr = f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._ins = []
        for addr in in_addrs:  # one input socket per rank: a request goes to the rank chosen for it
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self._ins.append(sock)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(out_addr)
        self.core.start(in_addrs, out_addr)
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
            for r in range(self.ranks):
                self._send(Shutdown(drain_s), r)

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
        if self.state != FAILED:  # failed: nothing to drain, and ranks that outlived a dead peer wait for it
            await asyncio.get_running_loop().run_in_executor(None, self.core.join, 30.0)
        self.core.kill()
        self._fail_open("server shutting down")
        if self.state != FAILED:
            self.state = STOPPED
        self._stopped.set()
        for t in self._tasks:
            t.cancel()
        if self._ctx is not None:
            for sock in self._ins:
                sock.close(linger=0)
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
        rank = self.pick_rank()
        cost = len(prompt) + params.max_new_tokens  # per choice: its prompt and the tokens it may add
        for i in ids:
            self._streams[i] = stream
            self._owner[i], self._cost[i] = rank, cost
        self.rank_load[rank] += cost * n
        self.rank_requests[rank] += n
        self._send(AddRequest(ids, prompt, params), rank)
        return stream

    def pick_rank(self) -> int:
        """Data-parallel serving: the rank with the fewest tokens to go over its open requests
        (prompt + max new tokens each; the lowest rank on a tie). Always 0 with one core."""
        return min(range(self.ranks), key=lambda r: (self.rank_load[r], r))

    def abort(self, ids: list[int]) -> None:
        """Cancel these requests (if still running); their ends still arrive on their streams."""
        live = [i for i in ids if i in self._streams]
        if live and self.state == READY:
            for r in sorted({self._owner.get(i, 0) for i in live}):
                self._send(AbortRequests([i for i in live if self._owner.get(i, 0) == r]), r)

    def _send(self, msg: Any, rank: int = 0) -> None:
        self._ins[rank].send(self._enc.encode(msg), copy=False)

    def _forget(self, i: int) -> None:
        r = self._owner.pop(i, None)
        if r is not None:
            self.rank_load[r] -= self._cost.pop(i, 0)

    # ------------------------------------------------------------------ the core's messages
    async def _read(self) -> None:
        while True:
            raw = await self._out.recv(copy=False)
            msg: CoreOutput = self._dec.decode(raw.buffer)
            if isinstance(msg, StepOutputs):
                self._dispatch(msg)
            elif isinstance(msg, Ready):
                self._ready_infos[msg.rank] = msg.info
                if len(self._ready_infos) == self.ranks:  # every rank: serve
                    info = self._ready_infos[0]
                    pages = sum(i.pages_total for i in self._ready_infos.values())
                    self.info = msgspec.structs.replace(info, pages_total=pages)
                    self.state, self.progress = READY, "ready"
                    self._ready.set()
                else:
                    self.progress = f"{len(self._ready_infos)} of {self.ranks} ranks ready"
            elif isinstance(msg, Progress):
                self.progress = msg.message
                if self.on_progress is not None:
                    self.on_progress(msg.message)
            elif isinstance(msg, CoreFailed):
                who = f" (rank {msg.rank} of {self.ranks})" if self.ranks > 1 else ""
                why = f"the engine core{who} failed: {msg.error.strip().splitlines()[-1]}"
                if self.ranks > 1 and not self.core.is_alive():  # a peer died first: say which
                    why += f" ({self.core.exit_description()})"
                self._failed(why, msg.error)
            elif isinstance(msg, Stopped):
                self._stopped_ranks.add(msg.rank)
                self.pages_leaked = (self.pages_leaked or 0) + msg.pages_leaked
                if len(self._stopped_ranks) == self.ranks:
                    self._fail_open("server shutting down")
                    self.state = STOPPED
                    self._stopped.set()

    def _dispatch(self, msg: StepOutputs) -> None:
        if self.ranks > 1:  # one rank's step: the gauges count every rank
            self._rank_stats[msg.rank] = msg.stats
            msg.stats = EngineStats(*(sum(getattr(st, f) for st in self._rank_stats.values())
                                      for f in EngineStats.__struct_fields__))
        self.stats = msg.stats
        streams = self._streams
        for t in msg.tokens:
            s = streams.get(t.id)
            if s is not None:
                s.queue.put_nowait(t)
        for f in msg.finished:
            self._forget(f.id)
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
            self._forget(i)
        self._streams.clear()

