"""The imperative wrapper: run an arbitrary command as a side task, best effort.

The command runs in its own process group, stopped (SIGSTOP) right after it starts, inside the
grant that runs setup.
Each ``step`` thaws it with SIGCONT for a short slice and freezes it again with SIGSTOP, so the
runtime's deadline logic applies unchanged: a slice is a step of known length.

Best effort, by nature:

* On a GPU, SIGSTOP does not stop kernels that are already queued: they drain after the freeze
  and can overrun the bubble by their length.
* There is no checkpoint: a command that is restarted (after an eviction or a manager restart)
  starts again from the beginning. Write an iterative task where resumption matters.
* Grandchildren that leave the command's process group are not frozen.
* On a ``cpu:N`` device the trainer stops the worker and the command at a bubble's end (the manager's end board
  names both groups); the manager's thaws continue only the worker: the command runs in its task's slices alone.

What the command starts in its group dies with it whichever way the worker ends: a manager killed with -9 takes
the worker with it and the command with the worker (their death signals), and a watch outside the group kills
the rest once the command is gone (:func:`freeride._task_process.watch_group`); else they lived on, reparented,
and stopped for good where a slice's end had stopped the group.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from typing import Any

from freeride._task_process import watch_group
from freeride.errors import ConfigError
from freeride.task import SideTask, TaskContext

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _child_preexec() -> None:  # pragma: no cover - runs in the child before exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setpgid(0, 0)


#: How long :func:`_stop_group` waits for the command's leader to stop before it leaves the stop pending.
STOP_WAIT_S = 0.5
_STOP_POLL_S = 0.0005


def _stop_group(pid: int, wait_s: float = STOP_WAIT_S) -> int | None:
    """SIGSTOP the command's process group and wait until its leader is stopped (or gone), ``wait_s`` at most:
    its exit code (``os.waitstatus_to_exitcode``'s) when it is gone, which this wait reaped, else None.

    A SIGCONT between the stop and the wait (from another process: the manager's thaws continued the command's
    group with the worker's until they no longer did) clears the stop before it is waited for: waiting for a stop
    alone then blocked setup() for as long as the command ran free, outside any bubble, until the task failed
    STEP_TIMEOUT "in setup()". A stop undone so is sent again.

    The wait is bounded: a leader that waits for a child it vforked (a shell's ``cmd &``, ``posix_spawn``) stops
    only once that child has exec'd, and the group's stop may have stopped the child first; the leader then
    waits for ever, and an unbounded wait with it (setup() hung so, under load, in one test run in ten). Nothing
    of the group runs meanwhile (the child is stopped, the leader waits for it, its own stop pending), and the
    next slice's SIGCONT lets both go on. So past ``wait_s`` the stop is left pending and this returns None."""
    os.killpg(pid, signal.SIGSTOP)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            waited, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
        except ChildProcessError:
            return None
        if waited:
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                return os.waitstatus_to_exitcode(status)  # gone: reaped here, so the caller must keep its code
            if os.WIFCONTINUED(status):
                os.killpg(pid, signal.SIGSTOP)  # a thaw undid the stop: again
                continue
        # A reported stop may be one a thaw has undone since: the process's own state says.
        if _stopped(pid):
            return None
        if time.monotonic() >= deadline:
            log.debug("the command's leader (pid %d) has not stopped within %.1f s (it may wait for a vforked "
                      "child that stopped first); its stop stays pending", pid, wait_s)
            return None
        time.sleep(_STOP_POLL_S)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped now (its state in /proc: T)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return True  # gone: nothing runs


class CommandTask(SideTask):
    """Run ``argv`` (no shell) in slices of ``slice_ms`` inside bubbles."""

    progress_unit = "slices"
    checkpoints = False  # a program cannot be checkpointed: a restart runs it again from its beginning

    def __init__(self, argv: list[str], slice_ms: float = 2.0) -> None:
        if not argv or not all(isinstance(a, str) and a for a in argv):
            raise ConfigError("a command task needs a non-empty argv of non-empty strings")
        if not 0.1 <= slice_ms <= 1000:
            raise ConfigError(f"slice_ms must be in [0.1, 1000], got {slice_ms}")
        self.argv = list(argv)
        self.slice_s = slice_ms / 1000
        self.proc: subprocess.Popen[bytes] | None = None
        self.slices = 0
        self.returncode: int | None = None
        #: The write end of the watch on the command's group (module doc), closed by :meth:`close`.
        self._watch: int | None = None

    def setup(self, ctx: TaskContext) -> None:
        # The manager's threads are irrelevant here: a worker process is single-threaded.
        try:
            self.proc = subprocess.Popen(  # noqa: S603 - argv list, never a shell
                self.argv,
                cwd=str(ctx.work_dir),
                preexec_fn=_child_preexec,  # noqa: PLW1509
            )
        except (FileNotFoundError, PermissionError) as exc:  # the user's argv, not freeride: one line, no traceback
            raise ConfigError(f"cannot run {self.argv[0]!r} (in {ctx.work_dir}, on this host's PATH): "
                              f"{exc.strerror}") from None
        # Setup runs inside a grant, so the few instructions the command runs before this stop
        # are inside a bubble too. (Stopping in preexec would deadlock: Popen waits for exec.)
        try:
            self._watch = watch_group(self.proc.pid)
        except OSError as exc:
            log.warning("no watch on the command's process group (%s): what it starts may outlive a manager "
                        "killed with -9", exc)
        ended = _stop_group(self.proc.pid)
        if ended is not None:  # reaped by that wait: the process object would read a reaped child as code 0
            self.proc.returncode = ended

    def step(self) -> None:
        assert self.proc is not None
        if self._ended():
            return  # it ended between two steps (in a slice's last moments, or killed from outside)
        os.killpg(self.proc.pid, signal.SIGCONT)
        time.sleep(self.slice_s)
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        self.slices += 1
        self._ended()

    def done(self) -> bool:
        """The command has exited with code 0; an exit with another code or by a signal raises (the task fails
        with it, where it used to be FINISHED as if the work were done)."""
        return self.proc is not None and self._ended()

    def _ended(self) -> bool:
        """Whether the command has exited, cleanly; :class:`RuntimeError` naming the code or the signal if not."""
        assert self.proc is not None
        self.returncode = self.proc.poll()
        if self.returncode is None or self.returncode == 0:
            return self.returncode == 0
        if self.returncode < 0:
            try:
                name = f" ({signal.Signals(-self.returncode).name})"
            except ValueError:
                name = ""
            raise RuntimeError(f"command {self.argv[0]!r} was killed by signal {-self.returncode}{name}")
        raise RuntimeError(f"command {self.argv[0]!r} exited with code {self.returncode}")

    def progress(self) -> float:
        return float(self.slices)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                os.killpg(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self._watch is not None:  # its end kills what the command left in its group, now that it is gone
            os.close(self._watch)
            self._watch = None
