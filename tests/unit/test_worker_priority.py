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
