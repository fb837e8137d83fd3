"""What a side task starts dies with its worker, even when nobody is left to kill it.

A stranger's task started a child; its manager was killed with -9 while a freeze had stopped the worker's group.
The worker died with its manager (its death signal), and the child lived on, reparented and stopped for good:
the manager that kills a worker's group when it reaps the worker was gone. The worker now leaves a watch outside
its group (:func:`freeride._worker.runtime.kill_group_when_gone`). Real processes: a "worker" leading its own
group as the manager starts it, its child, a freeze of the group, and the worker's death by SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
from conftest import wait_for

from freeride._task_process import process_state

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import subprocess, sys
from freeride._worker import runtime
runtime.kill_group_when_gone()
child = subprocess.Popen(["sleep", "600"])
print(child.pid, runtime._GROUP_WATCH is not None, flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    return process_state(pid) in ("", "Z")  # reaped, or dead with its reaper not yet there


@contextlib.contextmanager
def _worker(session: bool, script: str = WORKER) -> Iterator[tuple[subprocess.Popen[str], int, bool]]:
    """The "worker" (``session``: leading a group of its own, as the manager starts it), its child's pid, and
    whether it watches its group; the child is killed at the end if the test left it alive."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=session)
    assert proc.stdout is not None
    child, watching = proc.stdout.readline().split()
    try:
        yield proc, int(child), watching == "True"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if not _gone(int(child)):
            os.kill(int(child), signal.SIGKILL)


def test_the_children_of_a_worker_killed_while_frozen_die_with_it() -> None:
    with _worker(session=True) as (worker, child, watching):
        assert watching
        os.killpg(worker.pid, signal.SIGSTOP)  # a freeze: the whole group stops
        os.kill(worker.pid, signal.SIGKILL)  # its manager killed with -9: the worker's death signal
        worker.wait()
        wait_for(lambda: _gone(child), 10, what="the stopped child to be killed with its worker")


def test_a_worker_that_exits_takes_its_children_with_it() -> None:
    with _worker(session=True) as (worker, child, _):
        assert worker.stdin is not None
        worker.stdin.close()  # it returns and exits
        worker.wait()
        wait_for(lambda: _gone(child), 10, what="the child to be killed as its worker exited")


def test_a_process_that_does_not_lead_its_group_kills_nothing_of_it() -> None:
    # Started from a shell's job, its group is the job's: it must not watch it.
    with _worker(session=False) as (worker, child, watching):
        assert not watching
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()
        assert not _gone(child)  # left alone, as without the watch


def test_a_task_that_closes_every_descriptor_leaves_its_worker_to_the_manager() -> None:
    # The watch's pipe closed with the rest while the worker lives: it kills nothing until the worker is gone (the
    # manager judges a worker that closed its channel; killed by the watch, it was recorded as killed by a signal).
    closer = WORKER.replace("sys.stdin.read()", "import os\nos.closerange(3, 1024)\nsys.stdin.read()")
    with _worker(session=True, script=closer) as (worker, child, _):
        watch = next(p for p in psutil.Process(worker.pid).children() if p.cmdline()[:1] == ["/bin/sh"])
        # Past its end-of-file, it polls for the worker's death (a sleep of its own between looks).
        wait_for(lambda: any(c.name() == "sleep" for c in watch.children()), 10, what="the watch to wait")
        assert worker.poll() is None and not _gone(child)
        worker.kill()
        worker.wait()
        wait_for(lambda: _gone(child), 10, what="the child to be killed once its worker was gone")


#: A worker of a command task: the command (in a group of its own) starts a child, then a slice's end stops the
#: group, as between two steps.
COMMAND_WORKER = """
import os, sys, tempfile, time
from pathlib import Path
from freeride.command import CommandTask
from freeride.task import TaskContext
work = Path(tempfile.mkdtemp())
task = CommandTask(["sh", "-c", "sleep 600 & echo $! > child.pid; wait"], slice_ms=5)
task.setup(TaskContext("cpu", "cpu:0", 2**28, "t-1", work))
while not (work / "child.pid").exists() or not (work / "child.pid").read_text().strip():
    task.step()
print(int((work / "child.pid").read_text()), task._watch is not None, flush=True)
if sys.stdin.read() == "close":
    while not task.done():  # the command runs to its end, its child left behind in its group
        task.step()
    task.close()
    print("closed", flush=True)
    sys.stdin.read()
"""


def test_what_a_command_task_starts_dies_with_its_worker_killed_while_the_command_is_stopped() -> None:
    # Its manager killed with -9: the worker dies, and the command with it (their death signals); the command's
    # child, in the command's group and not the worker's, lived on, stopped for good.
    with _worker(session=True, script=COMMAND_WORKER) as (worker, child, watching):
        assert watching
        # A group's stop reaches its members one by one: the command's child stops a moment after the command.
        wait_for(lambda: process_state(child) == "T", 10, what="the command's child to be stopped with it")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        wait_for(lambda: _gone(child), 10, what="the command's stopped child to be killed with its worker")


def test_a_command_task_closed_after_its_command_ended_takes_what_the_command_left_in_its_group() -> None:
    script = COMMAND_WORKER.replace('"sleep 600 & echo $! > child.pid; wait"',
                                    '"sleep 600 & echo $! > child.pid; sleep 0.01"')
    with _worker(session=True, script=script) as (worker, child, _):
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write("close")
        worker.stdin.close()
        assert worker.stdout.readline().strip() == "closed"
        wait_for(lambda: _gone(child), 10, what="the command's child to be killed as the task closed")
