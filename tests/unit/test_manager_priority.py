"""A manager that leads its session raises its autogroup's priority where it may, and says why where not.

Where the kernel shares a core between sessions first (``sched_autogroup_enabled``), a manager that sleeps
most of the time gets a small share of a core beside a trainer rank that computes without a break: on
Interleaved1F1B's slower CPU rank it waited up to 38-57 ms for the core, and read bubble starts p95
12.7 ms late (``freeride.devices.base.set_autogroup_nice``).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from freeride.devices import MANAGER_AUTOGROUP_NICE, base, set_autogroup_nice

HAS_AUTOGROUPS = Path("/proc/self/autogroup").exists()


@pytest.fixture
def leader(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process leads its session, as far as ``set_autogroup_nice`` can tell."""
    monkeypatch.setattr(base.os, "getsid", lambda pid: os.getpid())


def test_a_process_that_does_not_lead_its_session_says_so_and_writes_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(base.os, "getsid", lambda pid: os.getpid() + 1)
    group = tmp_path / "autogroup"
    group.write_text("untouched")
    assert "does not lead its session" in set_autogroup_nice(-10, str(group))
    assert group.read_text() == "untouched"


def test_a_kernel_without_autogroups_is_named(leader: None, tmp_path: Path) -> None:
    assert set_autogroup_nice(-10, str(tmp_path / "absent")) == "the kernel schedules no autogroups"


def _refusing(error: int, times: int) -> tuple[list[str], object]:
    """A kernel file write that fails ``times`` times with ``error``, then is kept in a list."""
    written: list[str] = []
    calls = [0]

    def write(path: str, text: str) -> None:
        calls[0] += 1
        if calls[0] <= times:
            raise OSError(error, os.strerror(error))
        written.append(text)

    return written, write


def test_a_busy_kernel_is_asked_again_after_its_rate_limit(leader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel takes one autogroup nice change per 100 ms machine-wide: managers and workers starting
    # together got EAGAIN.
    written, fake_write = _refusing(errno.EAGAIN, 2)
    monkeypatch.setattr(base, "_write_existing", fake_write)
    slept: list[float] = []
    assert set_autogroup_nice(-10, sleep=slept.append) == ""
    assert written == ["-10"] and len(slept) == 2 and all(s >= 0.1 for s in slept)


def test_a_kernel_busy_at_every_try_is_named(leader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _, fake_write = _refusing(errno.EAGAIN, 99)
    monkeypatch.setattr(base, "_write_existing", fake_write)
    assert "busy" in set_autogroup_nice(-10, sleep=lambda s: None)


def test_a_process_without_the_privilege_is_told_what_it_needs(leader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _, fake_write = _refusing(errno.EPERM, 99)
    monkeypatch.setattr(base, "_write_existing", fake_write)
    assert "CAP_SYS_NICE" in set_autogroup_nice(-10)


CHILD = """
from freeride.devices import MANAGER_AUTOGROUP_NICE, set_autogroup_nice
why = set_autogroup_nice(MANAGER_AUTOGROUP_NICE)
print(open("/proc/self/autogroup").read().split()[-1], why or "-")
"""


@pytest.mark.skipif(not HAS_AUTOGROUPS, reason="the kernel has no autogroups")
def test_a_session_leader_raises_its_autogroups_priority_where_it_may() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], start_new_session=True, capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    if os.geteuid() == 0:
        assert out == [str(MANAGER_AUTOGROUP_NICE), "-\n"]
    else:  # pragma: no cover - CI runs as root
        assert out[0] == "0" and "CAP_SYS_NICE" in out[1]
