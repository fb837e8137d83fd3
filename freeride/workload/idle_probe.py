"""The bench's yardstick for a rank's idle time: every gap between two compute actions, measured
apart from the instrumentation.

:class:`IdleProbe` wraps a stage's compute entry points (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``) on the instance, *inside* the instrumentation's
own wrappers (it is installed first), and at each entry reads the wall clock and the thread's CPU
clock and the thread's run delay. A gap's idle time is its wall time minus the CPU time the thread
spent in it and minus the time it waited, runnable, for its core (``/proc/thread-self/schedstat``:
on a loaded machine that is other processes' time, not the pipeline's): the time the rank was blocked
(a receive's or a send's wait, a collective), whatever hooked it or not, while the framework's own
work in the gap (posting sends, the loss, the optimizer step between iterations, the
instrumentation's marks) counts as busy. The gap across iterations runs
from the last action of one iteration to the first of the next. ``python -m freeride.workload
--idle-probe`` logs the gaps that end in each iteration (``idle_gaps``: start, wall and idle time in
ns, for gaps with at least ``min_gap_ns`` idle); the bench compares them with the bubbles the rank
reported inside them.

Costs three clock reads per action (a few microseconds): a bench instrument, not for production.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from freeride.devices.cpu import SCHEDSTAT_PATH, ProcField

_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class IdleProbe:
    """Idle gaps between the compute actions of the stages it wraps (module doc)."""

    def __init__(self, min_gap_ns: int = 100_000) -> None:
        self.min_gap_ns = min_gap_ns
        self._exit: tuple[int, int, int] | None = None  # (wall, thread CPU, run delay) at the last action's end
        self._gaps: list[tuple[int, int, int]] = []
        # The training thread's run delay (opened by it, at its first read; 0 where the kernel keeps none).
        self._run_delay = ProcField(SCHEDSTAT_PATH, 1)

    def _run_delay_ns(self) -> int:
        return self._run_delay.read() or 0

    def wrap(self, stage: Any) -> None:
        for name in _METHODS:
            setattr(stage, name, self.timed(getattr(stage, name)))

    def enter(self) -> None:
        """A compute action starts: the gap since the last one ended is measured (:meth:`wrap` calls it;
        an adapter whose framework marks its compute itself, such as Megatron's timers, calls it too)."""
        now, used, delayed = time.monotonic_ns(), time.thread_time_ns(), self._run_delay_ns()
        last = self._exit
        if last is not None:
            idle = (now - last[0]) - (used - last[1]) - (delayed - last[2])
            if idle >= self.min_gap_ns:
                self._gaps.append((last[0], now - last[0], idle))

    def leave(self) -> None:
        """The compute action ends."""
        self._exit = (time.monotonic_ns(), time.thread_time_ns(), self._run_delay_ns())

    def timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (a compute entry point, of a stage or a framework's dispatch table) with the gap
        before each call measured."""
        enter, leave = self.enter, self.leave

        def timed(*args: Any, **kwargs: Any) -> Any:
            enter()
            try:
                return method(*args, **kwargs)
            finally:
                leave()

        return timed

    def take(self) -> list[tuple[int, int, int]]:
        """The gaps (start, wall, idle; ns) that ended since the last call."""
        gaps, self._gaps = self._gaps, []
        return gaps

    def close(self) -> None:
        self._run_delay.close()
