"""The demo's child processes, and the one way they are stopped.

Every child (torchrun, the standalone probes, the managers) starts in its own session, with its
output in a log file and ``PR_SET_PDEATHSIG`` set so that it gets SIGTERM if the demo dies
without cleaning up. Stopping is SIGTERM to the child's process group, one monotonic deadline
for all, then SIGKILL (STYLE 5). Two things a group signal cannot reach are covered as well:

* torchrun starts each rank in a session of its own, and the managers their workers; torchrun
  stops its ranks on SIGTERM and a manager its workers, but a child killed at the deadline
  cannot. The demo therefore makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``):
  orphans re-parent to it instead of to init, and :meth:`Children.sweep` stops every descendant
  still alive at the end.
* SIGINT and SIGTERM received by the demo are only recorded (:class:`Signals`); the demo's wait
  loops check them and unwind through the same cleanup. A second signal makes the cleanup kill
  at once instead of waiting for the deadline.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from freeride.errors import FreerideError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.05
#: How long a sweep lets descendants that end by themselves end, before it stops what is left (s).
SETTLE_S = 1.0


class DemoInterrupted(FreerideError):
    """The demo received SIGINT or SIGTERM; every process it started has been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _prctl(option: int, value: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: children are still stopped explicitly; only the safety nets are missing


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def become_subreaper() -> None:
    """Orphaned descendants re-parent to this process (Linux), so that :meth:`Children.sweep` finds them."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


class Signals:
    """Records SIGINT/SIGTERM while active; :meth:`check` raises :class:`DemoInterrupted` once one came."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)  # only record: the demo's loops act on it

    def __enter__(self) -> Signals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[signum] = signal.signal(signum, self._record)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def check(self) -> None:
        if self.received:
            raise DemoInterrupted(self.received[0])

    @property
    def hurry(self) -> bool:
        """A second signal: stop children without waiting for them."""
        return len(self.received) >= 2

    def sleep(self, seconds: float) -> None:
        """Sleep, then raise if a signal came meanwhile."""
        time.sleep(seconds)
        self.check()


@dataclass
class Child:
    """One started process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Children:
    """The processes the demo started, in start order."""

    signals: Signals
    started: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> Child:  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as out:
            try:
                proc = subprocess.Popen(
                    list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent,
                    env=dict(env) if env is not None else None, cwd=cwd,
                )  # fmt: skip
            except OSError as exc:
                raise FreerideError(f"cannot start {name} ({argv[0]}): {exc.strerror or exc}") from None
        child = Child(name, proc, log_path)
        self.started.append(child)
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return child

    def wait(self, child: Child, timeout_s: float | None = None, on_tick: Any = None,
             tick_s: float = 2.0) -> int:  # fmt: skip
        """Wait for ``child`` to exit (checking for signals); ``on_tick()`` every ``tick_s``.

        Raises :class:`FreerideError` at the timeout (the child is left to :meth:`stop_all`).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_tick = time.monotonic() + tick_s
        while True:
            code = child.proc.poll()
            if code is not None:
                return code
            self.signals.check()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise FreerideError(f"{child.name} did not finish within {timeout_s:g} s; see {child.log_path}")
            if on_tick is not None and now >= next_tick:
                on_tick()
                next_tick = now + tick_s
            time.sleep(_POLL_S)

    def stop(self, children: Sequence[Child], timeout_s: float) -> None:
        """SIGTERM each running child's group, one deadline for all, then SIGKILL the rest."""
        running = [c for c in children if c.running()]
        for c in running:
            _signal_group(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in running:
            while c.running() and time.monotonic() < deadline and not self.signals.hurry:
                time.sleep(_POLL_S)
            if c.running():
                log.warning("%s (pid %d) did not stop within %g s: killing it", c.name, c.pid, timeout_s)
                _signal_group(c.proc.pid, signal.SIGKILL)
                c.proc.wait()

    def stop_all(self, timeout_s: float) -> None:
        """Stop every child still running, the latest started first."""
        self.stop(list(reversed(self.started)), timeout_s)

    def sweep(self, timeout_s: float = 5.0, settle_s: float = SETTLE_S) -> list[str]:
        """Stop every descendant still alive (orphans included, see the module doc); what was left.

        Descendants that end by themselves are given ``settle_s`` first, and reaped: a worker's group watch (a
        small shell, :func:`freeride._task_process.watch_group`) ends within a tenth of a second of its worker, and
        a sweep right after the managers stopped named four of them as "left behind" (a stranger's trial)."""
        deadline = time.monotonic() + (0 if self.signals.hurry else settle_s)
        while True:
            _reap_orphans()
            leftovers = _living_descendants()
            if not leftovers or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        names = []
        for p in leftovers:
            try:
                names.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
                p.terminate()
            except psutil.Error:
                pass
        if leftovers:
            log.warning("stopping %d process(es) left behind: %s", len(leftovers), "; ".join(names))
            _, alive = psutil.wait_procs(leftovers, timeout=0 if self.signals.hurry else timeout_s)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=timeout_s)
        return names


def _living_descendants() -> list[psutil.Process]:
    """This process's descendants but the zombies (dead, to be reaped)."""
    try:
        found = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    living = []
    for p in found:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                living.append(p)
        except psutil.Error:
            pass
    return living


def _reap_orphans() -> None:
    """Reap the orphans that re-parented to this subreaper and have exited (the demo's own children were waited
    for when they were stopped)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
