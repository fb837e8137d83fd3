"""Another process's CPU time, as the manager reads a worker's at a freeze; a worker's wait for its core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freeride._task_process import process_cpu_ns, process_dying, process_state, sched_times, schedstat
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


def test_a_workers_run_delay_grows_while_it_waits_for_its_core_and_not_while_it_is_stopped() -> None:
    # The manager reads it at each grant and freeze: granted time a worker spent waiting for a busy core is not its
    # step's.
    def run_delay_ns(pid: int) -> int:
        return sched_times(pid)[1]

    core = min(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    worker, rival = (subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2))
    try:
        def ran_ms(proc: subprocess.Popen[bytes], ms: float) -> None:
            start = process_cpu_ns(proc.pid) or 0
            deadline = time.monotonic() + 30
            while (process_cpu_ns(proc.pid) or 0) - start < ms * 1e6:
                assert time.monotonic() < deadline, "the spinner got no CPU"

        ran_ms(worker, 20)
        before = run_delay_ns(worker.pid)
        ran_ms(worker, 50)  # sharing one core with the rival: it waits about as long as it runs
        waited = run_delay_ns(worker.pid)
        assert 0 <= before < waited
        worker.send_signal(signal.SIGSTOP)  # SIGSTOP: a frozen worker is not runnable, once the stop has taken
        deadline = time.monotonic() + 30
        while Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the worker did not stop"
        stopped = run_delay_ns(worker.pid)
        ran_ms(rival, 50)
        assert run_delay_ns(worker.pid) == stopped
    finally:
        for proc in (worker, rival):
            proc.kill()
            proc.wait()
    assert run_delay_ns(worker.pid) == -1  # reaped: nothing to read


def test_a_process_state_reads_runnable_asleep_stopped_and_gone() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    asleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while process_state(busy.pid) != "R":  # until its interpreter is loaded (reading it, it may be in "D")
            assert time.monotonic() < deadline, "the busy loop never ran"
        while process_state(asleep.pid) != "S":  # until its interpreter has started and sleeps
            assert time.monotonic() < deadline, "the sleeper never slept"
        busy.send_signal(signal.SIGSTOP)
        while process_state(busy.pid) != "T":  # until the stop has landed
            assert time.monotonic() < deadline, "the stop never landed"
        run, delay = sched_times(busy.pid)
        assert run > 0 and delay >= 0
    finally:
        for proc in (busy, asleep):
            proc.kill()
            proc.wait()
    assert process_state(busy.pid) == "" and sched_times(busy.pid) == (-1, -1)  # reaped: gone


def test_a_proc_field_reads_its_number_until_closed_and_none_where_the_file_is_missing(tmp_path: Path) -> None:
    field = cpu.ProcField("/proc/self/statm", 1)  # resident pages
    first = field.read()
    assert first is not None and first > 0
    assert field.read() is not None  # the kept descriptor reads afresh
    field.close()
    assert field.read() is None
    assert cpu.ProcField(str(tmp_path / "no-such-file"), 0).read() is None
    short = tmp_path / "short"
    short.write_text("7\n")
    assert cpu.ProcField(str(short), 0).read() == 7
    assert cpu.ProcField(str(short), 1).read() is None  # no second field: None, and from then on


def test_a_process_is_dying_once_it_has_exited_unreaped_or_is_gone_and_not_while_it_lives() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not process_dying(child.pid)
        assert child.stdin is not None
        child.stdin.close()  # it exits; unreaped, it stays a zombie until waited for
        deadline = time.monotonic() + 30
        while process_state(child.pid) != "Z" and time.monotonic() < deadline:
            os.sched_yield()
        assert process_state(child.pid) == "Z" and process_dying(child.pid)
    finally:
        child.wait()
    assert process_dying(child.pid)  # reaped: gone


def test_a_kept_schedstat_reads_as_a_fresh_open_does_and_nothing_once_the_process_is_reaped() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    kept = schedstat(busy.pid)  # as the supervisor keeps a worker's
    try:
        first = sched_times(kept)
        deadline = time.monotonic() + 30
        while sched_times(kept)[0] <= first[0]:  # the same descriptor sees the run time grow
            assert time.monotonic() < deadline, "the busy loop never ran"
        busy.send_signal(signal.SIGSTOP)
        while process_state(busy.pid) != "T":
            assert time.monotonic() < deadline, "the stop never landed"
        assert sched_times(kept) == sched_times(busy.pid)  # stopped: both read the same figures
        assert kept.read() == sched_times(busy.pid)[1]
    finally:
        busy.kill()
        busy.wait()
    assert sched_times(kept) == (-1, -1)  # its process reaped: never another's figures
    kept.close()
    kept.close()  # twice is harmless
    assert sched_times(kept) == (-1, -1) and sched_times(schedstat(busy.pid)) == (-1, -1)
