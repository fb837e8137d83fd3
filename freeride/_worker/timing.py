"""How a worker times its steps and admits the next one: the reference system's admission rule
(for the bench's side-by-side comparison) and the timing of a step that was frozen and thawed."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

#: The reference system's task loop (REFERENCE.md): a step runs only if the time left exceeds
#: 1.2 x its median step time rounded up to 10 ms, and every step is followed by a 5 ms sleep.
PAPER_ADMISSION_FACTOR = 1.2
PAPER_ROUND_NS = 10_000_000
PAPER_SLEEP_AFTER_STEP_S = 0.005


def paper_step_fits(median_ns: int | None, remaining_ns: int) -> bool:
    """The reference's admission rule; an unknown step time (the first step) always runs."""
    if median_ns is None:
        return remaining_ns > 0
    rounded = -(-median_ns // PAPER_ROUND_NS) * PAPER_ROUND_NS
    return remaining_ns > PAPER_ADMISSION_FACTOR * rounded


class ThawCounter:
    """Tells whether a step was frozen, and for how long, to time frozen steps.

    The manager freezes a worker whose step ran past a bubble's end (SIGSTOP) and thaws it with its
    next grant (SIGCONT). Timed from start to end, such a step would also count the time it spent
    frozen, often a whole compute phase: that one sample made the p95 estimate fit no bubble (the
    task starved until a re-probe) and counted the trainer's compute as harvested time.

    With a board (the manager's, as it always starts workers) the manager dates each stop and continue
    there, and the board's total says it all (:meth:`mark`, :meth:`ran_ns`). Without one, a SIGCONT
    handler counts and stamps the thaws (:meth:`install`; Python runs it before the next Python-level
    call, so :meth:`changed_since`, itself a call, always sees it). Only then: a handler wakes a step
    asleep in a wait at every thaw to run Python code (the wait returns to run it, then waits again).
    """

    def __init__(self) -> None:
        self.count = 0
        self.last_ns = 0
        #: Reads how long, in all, the manager has kept this worker stopped (its board's word; None: no board):
        #: with it a frozen step's time is exact (:meth:`ran_ns`).
        self.stood_still: Callable[[], int] | None = None

    def stood_still_ns(self) -> int:
        """The board's total (0 without one)."""
        if self.stood_still is None:
            return 0
        try:
            return self.stood_still()
        except (OSError, ValueError, TypeError):  # a closed mapping
            return 0

    def install(self) -> None:
        """Count thaws with a SIGCONT handler, where no board dates them (see the class doc)."""
        if self.stood_still is not None:
            return
        try:
            signal.signal(signal.SIGCONT, self._on_cont)
        except ValueError:  # not the main thread (an embedded runtime): frozen steps keep their wall time
            pass

    def mark(self) -> int:
        """What :meth:`changed_since` compares: the board's stood-still total, or the thaws counted."""
        return self.stood_still_ns() if self.stood_still is not None else self.count

    def _on_cont(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.last_ns = time.monotonic_ns()

    def changed_since(self, mark: int) -> bool:
        """Whether the process was stopped and continued since :meth:`mark` said ``mark``."""
        return self.mark() != mark

    def ran_ns(self, start_ns: int, end_ns: int, stood_before: int, deadline_ns: int, cpu_ns: int) -> int:
        """How long a step that was frozen between ``start_ns`` and ``end_ns`` ran (``stood_before``:
        :meth:`stood_still_ns` when it began): its wall time less the time the manager kept it stopped, where its
        board says (else the bound of :meth:`running_ns`).

        The bound counts the step as running until its grant's deadline, or the bubble's end as the boards
        say: the latest ended grant's end, which is a later bubble's once a thaw was granted one that ended
        too. A 0.2 ms step thawed by a later bubble then measured 1-70 ms, the p95 estimate fitted no bubble of
        the second ranks, and the task starved there."""
        if self.stood_still is not None:
            stood = max(0, self.stood_still_ns() - stood_before)  # 0 where the mapping closed meanwhile
            return max(0, end_ns - start_ns - stood)
        return self.running_ns(start_ns, end_ns, deadline_ns, cpu_ns)

    def running_ns(self, start_ns: int, end_ns: int, deadline_ns: int, cpu_ns: int) -> int:
        """About how long a step that was frozen (once or more) between ``start_ns`` and ``end_ns`` ran.

        The larger of the CPU time it used (exact for a compute-bound step on a CPU core, short of
        its sleeps and waits otherwise) and what it ran before its grant's deadline (it was frozen
        only after that) plus after the last thaw (short of any run between two freezes); never more
        than its wall time. Either way it is at least the bubble time the step had, so a step that
        fits no bubble still learns that it does not.
        """
        bounds = max(0, min(deadline_ns, end_ns) - start_ns) + max(0, end_ns - max(self.last_ns, start_ns))
        return min(end_ns - start_ns, max(cpu_ns, bounds))


