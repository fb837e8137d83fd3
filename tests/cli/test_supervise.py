"""``freeride._cli.launch.supervise``, which runs ``launch``'s and ``bench``'s commands: time limits,
forwarded signals, what a command leaves behind; with real processes."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import psutil
from conftest import wait_for

from freeride._cli.launch import supervise


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _signal_me_when(path: Path, signum: int) -> None:
    """From a thread: once ``path`` exists, send ``signum`` to this process (as a Ctrl-C would)."""

    def go() -> None:
        wait_for(path.exists, 30)
        os.kill(os.getpid(), signum)

    threading.Thread(target=go, daemon=True).start()


def test_the_exit_code_and_the_output_come_back(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        outcome = supervise(_python("import sys; print('hi'); print('err', file=sys.stderr); sys.exit(3)"),
                            output=out)
    assert (outcome.code, outcome.signals, outcome.timed_out) == (3, (), False)
    assert log.read_text().split() == ["hi", "err"]


def test_a_command_past_its_time_is_stopped_with_its_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time, pathlib\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # only SIGKILL stops it
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
            "time.sleep(60)\n")
    outcome = supervise(_python(code), timeout_s=2.0, kill_after_s=0.5)
    assert outcome.timed_out
    assert outcome.code == 128 + signal.SIGKILL
    wait_for(lambda: _gone(int(pid_file.read_text())), 10)  # its child went with it


def test_what_a_command_leaves_running_is_killed_only_when_asked(tmp_path: Path) -> None:
    pids = []
    for kill in (True, False):
        pid_file = tmp_path / f"left-{kill}.pid"
        code = ("import subprocess, sys, pathlib\n"
                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n")
        assert supervise(_python(code), kill_group_at_exit=kill).code == 0
        pids.append(int(pid_file.read_text()))
    try:
        wait_for(lambda: _gone(pids[0]), 10)
        assert not _gone(pids[1])  # launch's behaviour: the command's own business
    finally:
        os.kill(pids[1], signal.SIGKILL)


def _sleeper(ready: Path, on_sigint: str) -> list[str]:
    """A command that handles SIGINT with ``on_sigint``, then says it is ready and sleeps."""
    return _python("import signal, sys, time, pathlib\n"
                   f"signal.signal(signal.SIGINT, {on_sigint})\n"
                   f"pathlib.Path({str(ready)!r}).write_text('x')\n"
                   "time.sleep(60)\n")


def test_a_signal_to_this_process_is_forwarded_and_reported(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs as a background job of a script
    _signal_me_when(ready, signal.SIGINT)
    outcome = supervise(_sleeper(ready, "lambda *a: sys.exit(5)"))
    assert (outcome.code, outcome.signals, outcome.timed_out) == (5, (signal.SIGINT,), False)
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_command_that_ignores_a_forwarded_signal_is_stopped_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    _signal_me_when(ready, signal.SIGINT)
    outcome = supervise(_sleeper(ready, "signal.SIG_IGN"), stop_after_signal_s=0.5, kill_after_s=5.0)
    assert outcome.signals == (signal.SIGINT,) and not outcome.timed_out
    assert outcome.code == 128 + signal.SIGTERM  # the group's SIGTERM, before any SIGKILL
