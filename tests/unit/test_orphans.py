"""The orphan sweep: a dead manager's worker group is killed only if it carries the task's marker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from freeride._manager import orphans

# A group leader that starts a child in its own group, then both sleep: a worker and what it spawned.
_FAMILY = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
          "print('ready', flush=True); time.sleep(60)"


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tasks" / "t-1"
    path.mkdir(parents=True)
    return path


def _family(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _FAMILY], start_new_session=True, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def _members(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def test_left_over_group_with_the_task_marker_is_killed(task_dir: Path) -> None:
    env = {**os.environ, orphans.MARKER_ENV: str(task_dir)}
    for leader in _family(env):
        assert len(_members(leader.pid)) == 2
        orphans.record(task_dir, leader.pid)
        assert orphans.kill_leftovers(task_dir) == 2
        leader.wait(5)
        wait_for(lambda pid=leader.pid: _members(pid) == [], 10)  # SIGKILL takes effect asynchronously
        assert not (task_dir / orphans.PID_FILE).exists()


def test_group_without_the_task_marker_is_spared(task_dir: Path) -> None:
    """A recorded id reused by unrelated processes (the old group was gone) must not get them killed."""
    env = {k: v for k, v in os.environ.items() if k != orphans.MARKER_ENV}
    for leader in _family(env):
        orphans.record(task_dir, leader.pid)
        assert orphans.kill_leftovers(task_dir) == 0
        assert len(_members(leader.pid)) == 2
        assert not (task_dir / orphans.PID_FILE).exists()


def test_no_record_or_a_garbled_one_kills_nothing(task_dir: Path) -> None:
    assert orphans.kill_leftovers(task_dir) == 0
    (task_dir / orphans.PID_FILE).write_text("not a pid")
    assert orphans.kill_leftovers(task_dir) == 0
