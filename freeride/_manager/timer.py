"""A wake-up at an exact ``CLOCK_MONOTONIC`` time for the loop's ``select``: a Linux timerfd.

The loop's selector is epoll, whose timeout is whole milliseconds rounded up: a freeze due 0.4 ms from
now woke the loop 1 ms from now, and a step running past a bubble's end ran that much longer than its
grace. A timerfd armed at the core's next timer (absolute, nanoseconds) becomes readable at that time,
and the loop's ``select`` returns then. It is reset only when the time changes (one ``timerfd_settime``
per change, through ctypes: Python 3.11's ``os`` has no timerfd). Where the call is missing (not
Linux) :func:`make_timer` gives None and the loop keeps epoll's millisecond wake-ups.
"""

from __future__ import annotations

import ctypes
import os

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class PreciseTimer:
    """One timerfd on ``CLOCK_MONOTONIC`` (the clock of every stamp the manager compares)."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._settime = libc.timerfd_settime
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._fd = fd
        self._at_ns = 0
        self._spec = _Itimerspec()

    def fileno(self) -> int:
        return self._fd

    def arm(self, at_ns: int | None) -> None:
        """Be readable at ``at_ns`` (None or 0: never); a time in the past makes it readable at once."""
        at = at_ns or 0
        if at == self._at_ns:
            return
        self._at_ns = at
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(at, 1_000_000_000) if at > 0 else (0, 0)
        if at > 0 and value.tv_sec == 0 and value.tv_nsec == 0:
            value.tv_nsec = 1  # zero would disarm it
        self._settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None)

    def clear(self) -> list[object]:
        """Read its expiry (the selector's callback): the loop's timers run after every wake-up anyway."""
        try:
            os.read(self._fd, 8)
        except (BlockingIOError, InterruptedError):
            pass
        self._at_ns = 0  # fired: arming the same time again must reach the kernel
        return []

    def close(self) -> None:
        os.close(self._fd)


def make_timer() -> PreciseTimer | None:
    """A timerfd, or None where the system has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return PreciseTimer(libc)
    except (OSError, AttributeError):
        return None
