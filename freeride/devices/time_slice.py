"""A thread's scheduler time slice on Linux: short for the manager's loop, the kernel's own for a worker.

Linux's fair scheduler (EEVDF, 6.6+) lets a running thread finish its slice before a thread of the same
weight that wakes takes the core (0.7-3 ms by default, scaled by the core count: 1.4 ms on the 2-core
test VM). The manager's loop sleeps in ``select`` and wakes for each bubble event and each freeze for a
few hundred microseconds; where the trainer keeps every core busy (a CPU device shares its core with a
training rank), it waited for one. Measured on that VM (``perf sched timehist``, two trainer ranks
pinned one per core, 1F1B, a 0.2 ms side task per core): the loop's wait for a core from its wake-up
was p50 0.01-0.02 ms, **p90 0.6-2.2 ms**, p99 4.8-8 ms, and a bubble's end waited in the loop's socket
that long before the freeze or park it calls for.

Since Linux 6.12 a thread may ask for a shorter slice, ``sched_attr.sched_runtime`` of ``SCHED_OTHER``
(0.1-100 ms, no privilege needed), and a thread that wakes with a shorter slice than the running one's
takes the core from it at once. With 0.1 ms on the loop's thread the same run measured p90 0.02-0.33 ms;
p99 stays 3.5-3.7 ms (the trainer's group on that core can still be owed the core). The loop's total CPU
time does not change: it runs sooner, not longer.

The slice is inherited by the threads and processes a thread starts, so a worker, which its manager's
loop thread starts, puts its own back to the kernel's default (:func:`set_time_slice` with ``None``) in
:func:`~freeride.devices.base.lower_priority`: a side task never preempts the trainer sooner.

Where the kernel has no custom slices (before 6.12 it ignores the field; other systems have no call)
nothing changes and :func:`set_time_slice` says so (False); :func:`time_slice_ns` reads None there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import struct

#: The slices the kernel allows.
_MIN_SLICE_NS, _MAX_SLICE_NS = 100_000, 100_000_000
#: What the manager's loop thread asks for: the kernel's shortest.
LOOP_TIME_SLICE_NS = _MIN_SLICE_NS

#: ``sched_setattr`` / ``sched_getattr`` syscall numbers (no wrapper in glibc or in Python's ``os``).
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
#: ``struct sched_attr`` (version 1, 56 bytes): size, policy, flags, nice, priority, runtime, deadline,
#: period, util_min, util_max.
_ATTR = struct.Struct("<IIQiIQQQII")
_SCHED_OTHER = 0


@functools.cache
def _calls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or not hasattr(os, "sched_getaffinity"):  # Linux only
        return None
    try:
        return ctypes.CDLL(None, use_errno=True), numbers[0], numbers[1]
    except OSError:
        return None


def _get(tid: int) -> tuple[int, ...] | None:
    calls = _calls()
    if calls is None:
        return None
    libc, _, getattr_nr = calls
    buf = ctypes.create_string_buffer(_ATTR.size)
    if libc.syscall(getattr_nr, tid, buf, _ATTR.size, 0) != 0:
        return None
    return _ATTR.unpack(buf.raw)


def time_slice_ns(tid: int = 0) -> int | None:
    """Thread ``tid``'s slice (0: this thread); None where it cannot be read or the thread is not
    ``SCHED_OTHER``."""
    attr = _get(tid)
    if attr is None or attr[1] != _SCHED_OTHER:
        return None
    return attr[5]


def set_time_slice(slice_ns: int | None, tid: int = 0) -> bool:
    """Ask for a slice of ``slice_ns`` (clamped by the kernel to 0.1-100 ms; None: the kernel's default)
    for thread ``tid`` (0: this thread), keeping its policy and nice value. True when the kernel took it."""
    calls = _calls()
    attr = _get(tid)
    if calls is None or attr is None or attr[1] != _SCHED_OTHER:
        return False
    libc, setattr_nr, _ = calls
    _, policy, _, nice, priority, *_rest = attr
    buf = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, policy, 0, nice, priority, slice_ns or 0, 0, 0, 0, 0),
                                      _ATTR.size)
    if libc.syscall(setattr_nr, tid, buf, 0) != 0:
        return False
    now = time_slice_ns(tid)
    return now is not None and (slice_ns is None or now == min(max(slice_ns, _MIN_SLICE_NS), _MAX_SLICE_NS))
