"""The command wrapper (``freeride.command``): its program is stopped between slices, whatever thaws it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for

from freeride import command
from freeride.command import CommandTask
from freeride.testing import task_context


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_setup_leaves_the_command_stopped_even_when_a_thaw_comes_between_its_stop_and_its_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stranger trial: the manager thawed the worker's command group with the worker, between setup's SIGSTOP and
    # its wait for the stop; setup then waited as long as the command ran free, and failed STEP_TIMEOUT in setup().
    real_killpg = os.killpg
    thawed = []

    def killpg_then_thaw(pgid: int, sig: int) -> None:
        real_killpg(pgid, sig)
        if sig == signal.SIGSTOP and not thawed:
            os.waitid(os.P_PID, pgid, os.WSTOPPED | os.WNOWAIT)  # the stop took effect...
            thawed.append(pgid)
            real_killpg(pgid, signal.SIGCONT)  # ...and a thaw undid it before setup waited

    monkeypatch.setattr(command.os, "killpg", killpg_then_thaw)
    task = CommandTask([sys.executable, "-c", "while True: pass"])

    def waited_too_long(signum: int, frame: object) -> None:
        raise TimeoutError("setup() waited for a stop that a thaw had undone")

    previous = signal.signal(signal.SIGALRM, waited_too_long)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        task.setup(task_context(tmp_path))
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert task.proc is not None and thawed == [task.proc.pid]
        assert _state(task.proc.pid) == "T"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        monkeypatch.setattr(command.os, "killpg", real_killpg)
        task.close()


def test_the_stop_of_a_command_waiting_for_a_child_it_vforked_is_left_pending_not_waited_for(
    tmp_path: Path,
) -> None:
    # A CI run under load: setup() hung in its wait for the command's stop. The command (a shell's ``cmd &``) had
    # vforked; the group's stop stopped the child before its exec, and the leader, waiting for that exec in the
    # vfork, could never stop. Here the vforked child (posix_spawn's) blocks opening a FIFO before its exec.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    spawn = ("import os, sys; os.posix_spawn('/bin/true', ['true'], dict(os.environ), "
             f"file_actions=[(os.POSIX_SPAWN_OPEN, 0, {str(fifo)!r}, os.O_RDONLY, 0)])")
    proc = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    try:
        wait_for(lambda: _state(proc.pid) == "D", 30, what="the command to wait for its vforked child")

        def waited_too_long(signum: int, frame: object) -> None:
            raise TimeoutError("the stop of a command in a vfork was waited for")

        previous = signal.signal(signal.SIGALRM, waited_too_long)
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        try:
            assert command._stop_group(proc.pid, wait_s=0.2) is None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        child = next(int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        assert _state(child) == "T" and _state(proc.pid) == "D"  # nothing of the group runs meanwhile
        os.killpg(proc.pid, signal.SIGCONT)  # a slice: the child goes on to its exec, and the command to its end
        with open(fifo, "w"):
            pass
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run_to_the_end(task: CommandTask, steps: int = 2000) -> None:
    """Step the command as the worker does (``done()`` before each step) until it is done, or ``steps`` pass."""
    for _ in range(steps):
        if task.done():
            return
        task.step()
    raise AssertionError("the command never ended")


@pytest.mark.parametrize("when", ["at-once", "between-steps", "in-a-slice"])
def test_a_command_that_exits_with_an_error_fails_the_task_with_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    # Stranger trial: `/bin/false`, `sh -c 'exit 7'` and `sh -c 'sleep 1; exit 7'` were FINISHED with no failure
    # (setup's wait reaped a command that exited at once, which the process object then read as code 0; and
    # done() took any exit, such as one while the manager's thaw of the worker let the command run between
    # steps, for the end of its work).
    argv = {"at-once": ["/bin/sh", "-c", "exit 7"],
            "between-steps": [sys.executable, "-c", "raise SystemExit(7)"],
            "in-a-slice": [sys.executable, "-c", "import time; time.sleep(0.05); raise SystemExit(7)"]}[when]
    task = CommandTask(argv, slice_ms=5.0)
    if when == "at-once":  # the command is over before setup's first stop reaches it
        real_killpg = os.killpg

        def killpg_after_the_exit(pgid: int, sig: int) -> None:
            if sig == signal.SIGSTOP:
                os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT)
            real_killpg(pgid, sig)

        monkeypatch.setattr(command.os, "killpg", killpg_after_the_exit)
    task.setup(task_context(tmp_path))
    monkeypatch.undo()
    try:
        if when == "between-steps":
            assert task.proc is not None
            os.killpg(task.proc.pid, signal.SIGCONT)  # the manager thaws the worker and its command group
            os.waitid(os.P_PID, task.proc.pid, os.WEXITED | os.WNOWAIT)
        with pytest.raises(RuntimeError, match="exited with code 7"):
            _run_to_the_end(task)
    finally:
        task.close()


def test_a_command_killed_by_a_signal_fails_the_task_naming_the_signal(tmp_path: Path) -> None:
    task = CommandTask([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
                       slice_ms=5.0)
    task.setup(task_context(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="killed by signal 11 \\(SIGSEGV\\)"):
            _run_to_the_end(task)
    finally:
        task.close()


def test_a_command_that_exits_cleanly_is_done(tmp_path: Path) -> None:
    for script in ("pass", "import time; time.sleep(0.05)"):
        task = CommandTask([sys.executable, "-c", script], slice_ms=5.0)
        task.setup(task_context(tmp_path))
        try:
            _run_to_the_end(task)
        finally:
            task.close()
