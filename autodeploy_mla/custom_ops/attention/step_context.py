"""How a cached op finds its model's backend session during a step (vLLM's forward-context pattern).

The model runner wraps each step in `using_sessions(sessions)`; an op reads its backend's session
with `active_session(name)`. The binding is a `contextvars.ContextVar`: it is set only for the
duration of one step, it is per thread (and per asyncio task), and it holds no state of its own —
the sessions belong to the model. Two models stepping in turn (or in two threads) each see their
own sessions. Ops never run inside a CUDA-graph *replay* (only their kernels do), so the binding
is needed only when an op actually executes: eagerly, or while a graph is being captured.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar, Token
from typing import Any, Optional

from .registry import BackendSession

_SESSIONS: ContextVar[Optional[Mapping[str, BackendSession]]] = ContextVar("autodeploy_mla_sessions", default=None)


class using_sessions:  # noqa: N801 - used like a function: `with using_sessions(...):`
    """Make `sessions` (backend name -> session) the ones ops see until the block ends.

    A plain class rather than a generator-based context manager: it is entered once per step."""

    __slots__ = ("_sessions", "_token")

    def __init__(self, sessions: Mapping[str, BackendSession]) -> None:
        self._sessions = sessions
        self._token: Optional[Token] = None

    def __enter__(self) -> None:
        self._token = _SESSIONS.set(self._sessions)

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _SESSIONS.reset(self._token)
        self._token = None


def active_sessions() -> Mapping[str, BackendSession]:
    """The sessions ops see now (empty outside a step)."""
    return _SESSIONS.get() or {}


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
