"""Side tasks used by the benchmarks."""

from __future__ import annotations

import time

from freeride import SideTask


class SpinStep(SideTask):
    """A step that busy-waits ``step_us`` microseconds: a task whose step time is known exactly."""

    progress_unit = "steps"

    def __init__(self, step_us: float = 100.0) -> None:
        self.step_s = step_us / 1e6
        self.count = 0

    def step(self) -> None:
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            pass
        self.count += 1

    def progress(self) -> float:
        return float(self.count)
