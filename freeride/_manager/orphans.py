"""Processes a killed manager's workers left behind, found and killed by the next manager.

A worker dies with its manager (``PR_SET_PDEATHSIG``), but what the task spawned does not: those
processes stay in the worker's process group, reparented to init, holding memory and CPU. The
loop records each worker's pid (= its process group id: workers start in their own session) in
``<task dir>/worker.pid`` and removes the file when it reaps the worker, so a file that is still
there when a manager starts names a group whose leader was never reaped by its manager.

Killing a group by a recorded id needs care: once every member of the old group is gone, the id
may be reused by an unrelated process. A group is killed only if one of its members carries this
task's marker in its environment (``FREERIDE_TASK_DIR``, set for every worker and inherited by
what it spawns). A task that scrubs its children's environment leaves them alive: safe, not tidy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

MARKER_ENV = "FREERIDE_TASK_DIR"
PID_FILE = "worker.pid"


def record(task_dir: Path, pid: int) -> None:
    """Note a started worker; a failure to write only costs the clean-up after a manager crash."""
    try:
        (task_dir / PID_FILE).write_text(f"{pid}\n")
    except OSError as exc:
        log.warning("cannot record worker pid %d in %s: %s", pid, task_dir, exc)


def forget(task_dir: Path) -> None:
    with contextlib.suppress(OSError):
        (task_dir / PID_FILE).unlink()


def _marked(proc: psutil.Process, marker: str) -> bool:
    try:
        return proc.environ().get(MARKER_ENV) == marker
    except (psutil.Error, OSError):
        return False


def kill_leftovers(task_dir: Path) -> int:
    """Kill the process group a dead manager's worker of this task left; return how many died."""
    try:
        pgid = int((task_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    if members and any(_marked(p, str(task_dir)) for p in members):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # not waited for: init reaps them
    else:
        members = []
    forget(task_dir)
    return len(members)
