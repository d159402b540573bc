"""How a cached op finds its model's backend session during a step (vLLM's forward-context pattern).

The model runner wraps each step in `using_sessions(sessions)`; an op reads its backend's session
with `active_session(name)`. The binding is a `contextvars.ContextVar`: it is set only for the
duration of one step, it is per thread (and per asyncio task), and it holds no state of its own —
the sessions belong to the model. Two models stepping in turn (or in two threads) each see their
own sessions. Ops never run inside a CUDA-graph *replay* (only their kernels do), so the binding
is needed only when an op actually executes: eagerly, or while a graph is being captured.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional

from .backend_registry import BackendSession

_SESSIONS: ContextVar[Optional[Mapping[str, BackendSession]]] = ContextVar("autodeploy_mla_sessions", default=None)


@contextmanager
def using_sessions(sessions: Mapping[str, BackendSession]) -> Iterator[None]:
    """Make `sessions` (backend name -> session) the ones ops see until the block ends."""
    token = _SESSIONS.set(sessions)
    try:
        yield
    finally:
        _SESSIONS.reset(token)


def active_session(backend: str) -> Optional[BackendSession]:
    sessions = _SESSIONS.get()
    return None if sessions is None else sessions.get(backend)


def require_session(op: str, backend: str) -> BackendSession:
    """The active session of `backend`, or an error that says how ops are meant to be called."""
    sess = active_session(backend)
    if sess is None:
        raise RuntimeError(
            f"{op}: no active {backend} session. This op keeps per-model state (plans, workspaces): run it "
            "through the model (OptimizedModel / ModelRunner), or create one with "
            f"get_backend({backend!r}).setup(spec) and call the op inside `using_sessions({{{backend!r}: session}})`."
        )
    return sess
