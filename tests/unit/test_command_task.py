"""The command wrapper (``freeride.command``): its program is stopped between slices, whatever thaws it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

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
