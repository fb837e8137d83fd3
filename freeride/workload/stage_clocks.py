"""The single-device mode's seams (:mod:`freeride.workload.single_stage`): its clocks, free memory,
run delay and cost learning.

On ``cpu:N`` compute is synchronous and the host clock is the device's (:class:`HostMarks`). On
``cuda:N`` kernels are queued asynchronously, so each action is bracketed by CUDA events
(:class:`CudaMarks`), resolved to host times through an anchor only when the emulated peers need
them; the synchronize at the start of each wait is the emulation's, not the instrumented real
trainer's, which never synchronizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from freeride.measure import median
from freeride.messages import UNKNOWN_MEMORY


class Mark:
    """A point in the stage's compute stream: a host time, or a CUDA event until resolved."""

    __slots__ = ("event", "ns")

    def __init__(self, event: Any = None, ns: int | None = None) -> None:
        self.event = event
        self.ns = ns


class HostMarks:
    """CPU: compute is synchronous, so the host clock is the device's."""

    check_every_action = True

    def mark(self) -> Mark:
        return Mark(ns=time.monotonic_ns())

    def resolve(self, mark: Mark) -> int:
        assert mark.ns is not None  # host marks are born resolved
        return mark.ns

    def drain(self) -> int:
        return time.monotonic_ns()


class CudaMarks:
    """CUDA: marks are events on the stage's stream, mapped to the host clock through an anchor.

    The anchor is an event recorded on the idle stream at a known host time, taken at every
    :meth:`drain` (the synchronize at the start of each wait); marks recorded before it are
    resolved against the previous anchor at that moment, so every elapsed time is measured from an
    anchor that precedes the mark. Resolving a mark that is still queued waits for that event only.
    """

    check_every_action = False

    def __init__(self, index: int) -> None:
        import torch

        self._torch = torch
        self._stream = torch.cuda.current_stream(index)
        self._pending: list[Mark] = []
        self._anchor: Any = None
        self._anchor_ns = 0
        self.drain()

    def mark(self) -> Mark:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        mark = Mark(event=event)
        self._pending.append(mark)
        return mark

    def resolve(self, mark: Mark) -> int:
        if mark.ns is None:
            mark.event.synchronize()
            mark.ns = self._anchor_ns + round(self._anchor.elapsed_time(mark.event) * 1e6)
            mark.event = None
        return mark.ns

    def drain(self) -> int:
        self._stream.synchronize()
        for mark in self._pending:
            self.resolve(mark)
        self._pending.clear()
        anchor = self._torch.cuda.Event(enable_timing=True)
        anchor.record(self._stream)
        anchor_ns = time.monotonic_ns()
        anchor.synchronize()
        self._anchor, self._anchor_ns = anchor, anchor_ns
        return time.monotonic_ns()


def runqueue_wait_ns() -> int | None:
    """How long this thread has waited, runnable, for a CPU (``/proc/thread-self/schedstat``, Linux);
    None where the kernel does not say. On ``cpu:N`` that is time something else held the stage's
    core: a side task not yet parked, or another program."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            return int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class FreeMemory:
    """Free memory of the device for bubble reports, never raising.

    CPU: host RAM, re-sampled at most every 0.5 s (it is shared and moves slowly). CUDA:
    ``torch.cuda.mem_get_info``, sampled at every bubble, after the synchronize, when the trainer's own
    allocation is what it will be.
    """

    def __init__(self, read: Callable[[], int], refresh_interval_s: float) -> None:
        self._read = read
        self._interval_ns = int(refresh_interval_s * 1e9)
        self._at_ns = 0
        self._free = UNKNOWN_MEMORY

    def free_bytes(self) -> int:
        now = time.monotonic_ns()
        if self._free < 0 or now - self._at_ns >= self._interval_ns:
            self._at_ns = now
            try:
                self._free = int(self._read())
            except Exception:  # noqa: BLE001 - an unknown figure is reported as such, never raised
                self._free = UNKNOWN_MEMORY
        return self._free


# ------------------------------------------------------------------ learning this stage's costs


class CostLearner:
    """This stage's forward, backward and between-iteration times over the learning iterations.

    The estimate of each is the median (``freeride.measure``) of its samples, leaving out iteration 0 (first-call costs:
    allocator growth, kernel selection) once later iterations have given some.
    """

    def __init__(self) -> None:
        self._samples: dict[str, list[tuple[int, float]]] = {}

    def observe(self, what: str, iteration: int, value_ns: float) -> None:
        if value_ns >= 0:
            self._samples.setdefault(what, []).append((iteration, value_ns))

    def estimate(self, what: str) -> float | None:
        samples = self._samples.get(what, [])
        values = [v for it, v in samples if it > 0] or [v for _, v in samples]
        return median(values) if values else None
