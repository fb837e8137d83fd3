"""A CPU worker yields to the trainer even where the kernel schedules sessions as groups."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import os
from freeride.devices import CpuWorkerDevice, parse_device_name
CpuWorkerDevice(parse_device_name(f"cpu:{min(os.sched_getaffinity(0))}")).prepare(1 << 30)
print(os.nice(0), open("/proc/self/autogroup").read().split()[-1])
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_a_worker_in_its_own_session_lowers_its_autogroup_priority_too() -> None:
    # Regression: nice 19 alone ranked the worker only inside its own session's autogroup, so it
    # shared the core with the trainer as an equal.
    out = subprocess.run([sys.executable, "-c", CHILD], start_new_session=True, capture_output=True, text=True,
                         check=True)
    niceness, group_nice = out.stdout.split()
    assert int(niceness) == 19
    assert int(group_nice) == 19


#: In a session of its own: runs CHILD as an ordinary member of that session, then reads the session's nice.
MEMBER = f"""
import subprocess, sys
out = subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True, text=True, check=True).stdout
print(out.strip(), open("/proc/self/autogroup").read().split()[-1])
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_a_process_that_does_not_lead_its_session_leaves_the_sessions_autogroup_alone() -> None:
    # Regression: a standalone probe run in its caller's session (the demo's, `freeride bench`'s, a bench's)
    # set that session's autogroup to nice 19, and with it the shell, the managers and the trainers started
    # from it afterwards: a bench's manager waited 2.6 ms for a core at each wake-up.
    out = subprocess.run([sys.executable, "-c", MEMBER], start_new_session=True, capture_output=True, text=True,
                         check=True)
    niceness, group_nice, session_nice = out.stdout.split()
    assert int(niceness) == 19  # the process itself still yields
    assert (int(group_nice), int(session_nice)) == (0, 0)
