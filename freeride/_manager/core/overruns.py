"""Steps that run past a bubble's end: the freeze timer, and what an overrun teaches a task's margin.

A step still running ``grace`` past the bubble's real end (or past its predicted end, when no end has
come) has its worker frozen with SIGSTOP until its next grant (the scheduler's ``_freeze_running``).
Grace counts from when the manager learns of the end: it cannot act before; the overrun itself is
measured from the trainer's real end. Each freeze of a step whose time was known (not a setup, a first
step or a probe) doubles that task's extra margin, up to ``max_margin``; each clean grant lets it shrink
back by an eighth. One timer is enough: at most one worker holds a bubble at a time.
"""

from __future__ import annotations

from freeride._manager.core.api import MS, CoreConfig, CoreStats
from freeride._manager.core.tasks import TaskRuntime


class Overruns:
    def __init__(self, config: CoreConfig, stats: CoreStats) -> None:
        self._grace_ns = config.grace_ns
        self._margin_ns = config.margin_ns
        self._max_margin_ns = config.max_margin_ns
        self._stats = stats
        #: When the worker holding a bubble is frozen if it has not parked (0: no freeze due).
        self.freeze_at_ns = 0

    def arm_at_end(self, end_ns: int, now_ns: int) -> None:
        """The real end is known (at ``now_ns``): freeze ``grace`` after it, or after now if it came late."""
        self.freeze_at_ns = max(end_ns, now_ns) + self._grace_ns

    def arm_at_grant(self, deadline_ns: int, now_ns: int) -> None:
        """A grant until ``deadline_ns``: freeze ``grace`` after it, unless an earlier freeze is still due."""
        if self.freeze_at_ns == 0 or self.freeze_at_ns < now_ns:
            self.freeze_at_ns = deadline_ns + self._grace_ns

    def disarm(self) -> None:
        self.freeze_at_ns = 0

    def due(self, now_ns: int) -> bool:
        return bool(self.freeze_at_ns) and now_ns >= self.freeze_at_ns

    def record(self, task: TaskRuntime, overrun_ns: int) -> None:
        task.overruns += 1
        self._stats.overruns += 1
        self._stats.overrun_ms.append(overrun_ns / MS)

    def clean_grant(self, task: TaskRuntime) -> None:
        """A grant that ended in time: a margin widened by earlier overruns shrinks back (1/8 a time)."""
        task.margin_ns -= task.margin_ns // 8

    def frozen(self, task: TaskRuntime) -> None:
        """Its step was frozen past the end: if its estimate was wrong (not a setup or a probe), widen its margin."""
        if task.known_step_ns is not None and not task.probing:
            task.margin_ns = min(self._max_margin_ns - self._margin_ns, max(task.margin_ns * 2, self._margin_ns))
