"""Another process's CPU time, as the manager reads a worker's at a freeze."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from freeride._task_process import process_cpu_ns


def test_a_process_cpu_time_is_what_it_reads_itself_and_stops_growing_when_it_exits() -> None:
    before = time.process_time_ns()
    mine = process_cpu_ns(os.getpid())
    after = time.process_time_ns()
    assert mine is not None and before <= mine <= after


def test_a_child_cpu_time_is_what_it_ran_and_none_once_it_is_reaped() -> None:
    # It spins, says how much CPU it used, then waits on its stdin (using none).
    code = ("import sys, time\nfor _ in range(10**6):\n    pass\n"
            "print(time.process_time_ns(), flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        used = int(child.stdout.readline())
        read = process_cpu_ns(child.pid)
        assert read is not None and used <= read < used + 1_000_000_000
    finally:
        child.kill()
        child.wait()
    assert process_cpu_ns(child.pid) is None
