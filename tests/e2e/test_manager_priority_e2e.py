"""End-to-end: ``freeride manager`` in a session of its own (as ``freeride launch`` starts it) raises its
autogroup's priority; one in its caller's session leaves the session alone and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemons import DEVICE, socket_path, start_daemon, stop_daemon

from freeride.devices import MANAGER_AUTOGROUP_NICE

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")]


def _group(pid: int) -> str:
    """The autogroup ``pid`` runs in, as the kernel names it ("/autogroup-N nice K"); "" for the default
    group that a process whose session began before autogroups (a container's init, say) stays in."""
    return Path(f"/proc/{pid}/autogroup").read_text().strip()


def _group_nice(pid: int) -> int:
    return int(_group(pid).split()[-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="a nice below 0 needs CAP_SYS_NICE (CI runs as root)")
def test_a_manager_leading_its_session_runs_its_autogroup_at_the_managers_nice(tmp_path: Path) -> None:
    daemon = start_daemon(socket_path("prio-own"), tmp_path / "state", new_session=True)
    try:
        assert _group_nice(daemon.pid) == MANAGER_AUTOGROUP_NICE
    finally:
        stop_daemon(daemon)
    assert daemon.stderr is not None
    assert "keeps its nice" not in daemon.stderr.read().decode()


def test_a_manager_in_its_callers_session_leaves_that_sessions_autogroup_alone_and_says_why(
        tmp_path: Path) -> None:
    before = _group(os.getpid())
    daemon = start_daemon(socket_path("prio-shared"), tmp_path / "state")
    try:
        assert _group(daemon.pid) == before  # this test's session: the shell's, pytest's
    finally:
        stop_daemon(daemon)
    assert _group(os.getpid()) == before
    assert daemon.stderr is not None
    assert "does not lead its session" in daemon.stderr.read().decode()


def test_autogroup_nice_zero_leaves_the_managers_autogroup_alone_and_says_nothing(tmp_path: Path) -> None:
    daemon = start_daemon(socket_path("prio-zero"), tmp_path / "state", "--autogroup-nice", "0", new_session=True)
    try:
        assert _group_nice(daemon.pid) == 0
    finally:
        stop_daemon(daemon)
    assert daemon.stderr is not None
    assert "keeps its nice" not in daemon.stderr.read().decode()


@pytest.mark.parametrize("value", ["-21", "20"])
def test_an_autogroup_nice_out_of_range_exits_2_with_one_line(value: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "freeride.cli", "manager", "--device", DEVICE, "--endpoint",
                          f"unix:{socket_path('prio-bad')}", "--state-dir", str(tmp_path / "state"),
                          "--autogroup-nice", value], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"--autogroup-nice must be -20..19, got {value}" in out.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made
