"""The manager loop's short scheduler time slice, and the worker that puts the kernel's default back."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from freeride.devices.time_slice import LOOP_TIME_SLICE_NS, set_time_slice, time_slice_ns

T = TypeVar("T")


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread of its own (the slice belongs to a thread; the test's stays as it was)."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _custom_slices() -> bool:
    return bool(_in_thread(lambda: set_time_slice(LOOP_TIME_SLICE_NS)))


needs_custom_slices = pytest.mark.skipif(not _custom_slices(), reason="the kernel has no custom time slices (< 6.12)")


@needs_custom_slices
def test_a_thread_takes_the_short_slice_and_gives_it_back_and_other_threads_keep_theirs() -> None:
    default = time_slice_ns()

    def short_then_default() -> tuple[int | None, int | None]:
        assert set_time_slice(LOOP_TIME_SLICE_NS)
        short = time_slice_ns()
        assert set_time_slice(None)
        return short, time_slice_ns()

    short, back = _in_thread(short_then_default)
    assert short == LOOP_TIME_SLICE_NS
    assert back == default and back != LOOP_TIME_SLICE_NS
    assert time_slice_ns() == default


@needs_custom_slices
def test_a_slice_out_of_the_kernels_range_is_clamped_and_said_so() -> None:
    assert _in_thread(lambda: (set_time_slice(1), time_slice_ns())) == (True, LOOP_TIME_SLICE_NS)


CHILD = """
import os
from freeride.devices import CpuWorkerDevice, parse_device_name
from freeride.devices.time_slice import time_slice_ns
before = time_slice_ns()
CpuWorkerDevice(parse_device_name(f"cpu:{min(os.sched_getaffinity(0))}")).prepare(1 << 30)
print(before, time_slice_ns())
"""


@needs_custom_slices
def test_a_worker_started_by_the_loops_thread_puts_the_kernels_default_slice_back() -> None:
    # The slice is inherited: a worker at the loop's 0.1 ms would take the core from the trainer at each wake.
    default = time_slice_ns()

    def start_worker() -> str:
        set_time_slice(LOOP_TIME_SLICE_NS)  # this thread is the manager's loop
        return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout

    inherited, after = (int(x) for x in _in_thread(start_worker).split())
    assert inherited == LOOP_TIME_SLICE_NS
    assert after == default
