"""Another process's CPU time, as the manager reads a worker's at a freeze; a worker's wait for its core."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from freeride._task_process import process_cpu_ns
from freeride.devices import CpuWorkerDevice, cpu, parse_device_name


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


def test_a_cpu_worker_device_counts_the_time_its_thread_waited_for_its_core_while_another_process_had_it() -> None:
    # A child pinned to one core with a spinning grandchild on the same core: its 100 ms of CPU time take about
    # as long again waiting for the core, which waited_ns counts; a spin alone on a core waits for next to none.
    code = """
import os, subprocess, sys, time
from freeride.devices import CpuWorkerDevice, parse_device_name
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
device = CpuWorkerDevice(parse_device_name(f"cpu:{core}"))
if device.waited_ns() is None:
    print("none")  # a kernel without the count
    sys.exit(0)
def spin(ns):
    first = device.waited_ns()
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass
    return device.waited_ns() - first
hog = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); sys.stdout.close()\\nwhile True: pass"],
                       stdout=subprocess.PIPE)
hog.stdout.readline()  # it runs, on this core (the affinity is inherited)
shared = spin(100_000_000)
hog.kill(); hog.wait()
print(shared)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    if out.stdout.strip() == "none":
        pytest.skip("this kernel keeps no run delay (/proc/thread-self/schedstat)")
    assert int(out.stdout.strip()) >= 20_000_000, out.stderr


def test_a_cpu_worker_device_without_the_kernels_count_says_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "SCHEDSTAT_PATH", "/nonexistent/schedstat")
    device = CpuWorkerDevice(parse_device_name(f"cpu:{min(os.sched_getaffinity(0))}"))
    assert device.waited_ns() is None
    assert device.waited_ns() is None


def test_a_cpu_worker_device_count_only_grows() -> None:
    device = CpuWorkerDevice(parse_device_name(f"cpu:{min(os.sched_getaffinity(0))}"))
    first = device.waited_ns()
    assert first is not None and first >= 0
    second = device.waited_ns()
    assert second is not None and second >= first
