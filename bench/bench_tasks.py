"""Side tasks used by the benchmarks."""

from __future__ import annotations

import time

from freeride import SideTask


class SpinStep(SideTask):
    """A step that computes for ``step_us`` microseconds of its thread's CPU time: a task whose step
    time is known exactly.

    CPU time, not wall time: a step the manager freezes at a bubble's end (SIGSTOP), or the trainer
    preempts, still owes the rest of its work when it runs again, as a real task's step does. Spun on
    the wall clock, such a step ended as soon as it was thawed and counted a whole step of work it had
    not done (up to one step per freeze: 2-13% of the bubble time on the bench's schedules).
    """

    progress_unit = "steps"

    def __init__(self, step_us: float = 100.0) -> None:
        self.step_ns = int(step_us * 1000)
        self.count = 0

    def step(self) -> None:
        end = time.thread_time_ns() + self.step_ns
        while time.thread_time_ns() < end:
            pass
        self.count += 1

    def progress(self) -> float:
        return float(self.count)
