"""Multi-process runs a test module starts in the background (a helper of the test files, not a test).

Spawned runs (gloo ranks, torchrun) are mostly process start-up and export: on the 2-core CI box they
leave a core idle while the mostly single-threaded tests run. A module that defines
`start_background_runs(items)` (conftest.py calls it once the session's tests are collected) starts
the runs its selected tests use in one driver process of its own, so that they overlap the tests
collected before the module; its fixtures wait for each result. Run alone, such a file simply waits.

- Low priority: the driver leads a session of its own (so that it can be killed with its ranks), and
  with autogroup scheduling (Linux's default on a desktop-style kernel) a session is a scheduling
  group whose own nice value is what counts against the tests' group; both are set to 19, so the
  tests run as fast as without the driver. While a fixture waits for a result, the group (and those
  of the drivers started before it) is back at nice 0 (where the test process may raise a priority),
  so that a loaded host does not starve what the tests wait for.
- One driver at a time: a driver started after another waits until that one is done (drivers start
  in collection order, which is the order the files consume them), so that the first file's runs do
  not share the idle core with runs needed minutes later.
- A driver process, not a thread: nothing here touches the test process's RNG, environment or torch
  state while other tests run.

Benchmark smoke tests (a script run end to end at tiny sizes, in a process of its own or in the driver)
are the other kind of run: `run_module` / `written` return the files such a run wrote.

A module uses it as `_BACKGROUND = BackgroundRuns(__name__, runs, fixtures, prelude)` (the attribute
must be called `_BACKGROUND`: the driver finds it there), `start_background_runs = _BACKGROUND.select`
and fixtures made by `_BACKGROUND.fixture(run)` (or its own, calling `result`), with `runs` name -> module-level
`fn(out_dir) -> picklable result`, `prelude` an optional `fn(out_dir)` run first (files every run
reads, e.g. a checkpoint; `prelude_dir()` waits for it), and `fixtures` fixture name -> the run
names a test using that fixture needs.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

#: The drivers started in this process, in order: each waits for the one before it.
_started: list["BackgroundRuns"] = []
_WAIT_S = 1800


class BackgroundRunFailed(RuntimeError):
    pass


def written(out: Path) -> dict[str, str]:
    """The text files a benchmark wrote into `out` (name -> text): what a background run of a benchmark
    script returns, since the driver's directory is gone when the session ends."""
    return {p.name: p.read_text() for p in sorted(out.iterdir()) if p.suffix in (".json", ".md", ".txt")}


def run_module(module: str, out: Path, *args: str, timeout: int = 600) -> dict[str, str]:
    """`python -m <module> *args --out <out>` from the repository root (the package importable from a
    checkout that is not pip-installed); fails with the tail of its output; returns `written(out)`."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    out.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=repo)
    if run.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return written(out)


def _alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not yet reaped by the test process, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


class BackgroundRuns:
    def __init__(self, module: str, runs: dict[str, Callable[[Path], Any]], fixtures: dict[str, Sequence[str]],
                 prelude: Optional[Callable[[Path], None]] = None) -> None:
        self.module, self.runs, self.fixtures, self.prelude = module, runs, fixtures, prelude
        self.proc: Optional[subprocess.Popen] = None
        self.dir: Optional[Path] = None

    # ------------------------------------------------------------------ the test process
    def select(self, items: Iterable) -> None:
        """Start the runs the selected tests use (by their fixtures), if any."""
        used = {name for item in items for fix, names in self.fixtures.items() if fix in item.fixturenames
                for name in names}
        if used:
            self.start([name for name in self.runs if name in used])

    def start(self, names: Optional[Sequence[str]] = None) -> None:
        if self.proc is not None:
            return
        names = list(self.runs) if names is None else list(names)
        self.dir = Path(tempfile.mkdtemp(prefix="autodeploy_bg_"))
        prev = _started[-1] if _started else None
        after = (str(prev.dir / "all.done"), prev.proc.pid) if prev is not None and prev.dir is not None else None
        code = (f"import sys; sys.path[:0] = {sys.path!r}; import {self.module} as m; "
                f"m._BACKGROUND.main({str(self.dir)!r}, {names!r}, {after!r})")
        self.log = open(self.dir / "driver.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._priority(19)
        _started.append(self)
        atexit.register(self.stop)

    def _priority(self, nice: int) -> None:
        """`nice` for the driver and its ranks (its process group; ranks started later inherit it) and,
        where the kernel groups by session (autogroup), for its scheduling group."""
        try:
            os.setpriority(os.PRIO_PGRP, self.proc.pid, nice)
        except OSError:  # the driver gone, or raising a priority is not allowed here
            pass
        try:
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(str(nice))
        except OSError:  # no autogroup, the driver gone, or not allowed
            pass

    def _wait_for(self, path: Path, what: str) -> None:
        if path.exists():
            return
        # The tests wait: nothing to keep the driver out of the way of, so it runs at normal priority
        # meanwhile (on a loaded host a nice-19 group gets next to no time).
        ahead = _started[: _started.index(self) + 1]  # this driver and those it waits for
        for bg in ahead:
            bg._priority(0)
        try:
            deadline = time.monotonic() + _WAIT_S
            while not path.exists():
                if self.proc.poll() is not None and not path.exists():
                    log = (self.dir / "driver.log").read_text(errors="replace")[-5000:]
                    raise BackgroundRunFailed(f"the background driver exited ({self.proc.returncode}) without "
                                              f"{what}:\n{log}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"no {what} from the background driver in {_WAIT_S // 60} minutes")
                time.sleep(0.1)
        finally:
            for bg in ahead:
                if bg.proc is not None and bg.proc.poll() is None:
                    bg._priority(19)

    def prelude_dir(self) -> Path:
        """The driver's directory once the prelude wrote its files there."""
        self.start()
        self._wait_for(self.dir / "prelude.done", "the prelude's files")
        return self.dir

    def result(self, name: str) -> Any:
        self.start()
        self._wait_for(self.dir / f"{name}.pkl", f"the {name!r} run")
        status, value = pickle.loads((self.dir / f"{name}.pkl").read_bytes())
        if status == "error":
            raise BackgroundRunFailed(f"background run {name!r} failed:\n{value}")
        return value

    def fixture(self, run: str, name: Optional[str] = None) -> Any:
        """A module-scoped pytest fixture (named `name`, default `run`) returning the result of `run`:
        `smoke = _BACKGROUND.fixture("smoke")` at module level."""
        import pytest

        def result() -> Any:
            return self.result(run)

        return pytest.fixture(scope="module", name=name or run)(result)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.dir is not None:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # ------------------------------------------------------------------ the driver process
    def main(self, out_dir: str, names: list[str], after: Optional[tuple[str, int]]) -> None:
        """Wait for the driver started before this one, run the prelude, then `names` in order; each
        one's result, or its error with the traceback, pickled to <out_dir>/<name>.pkl. (Its priority
        is the test process's business: _priority.)"""
        out = Path(out_dir)
        try:
            if after is not None:
                deadline = time.monotonic() + _WAIT_S
                while not Path(after[0]).exists() and _alive(after[1]) and time.monotonic() < deadline:
                    time.sleep(0.2)
            if self.prelude is not None:
                self.prelude(out)
            (out / "prelude.done").touch()
            for name in names:
                try:
                    res = ("ok", self.runs[name](out))
                except BaseException:  # noqa: BLE001 - re-raised by the test that needs it
                    res = ("error", traceback.format_exc())
                (out / f"{name}.tmp").write_bytes(pickle.dumps(res))
                (out / f"{name}.tmp").rename(out / f"{name}.pkl")
        finally:
            (out / "all.done").touch()
