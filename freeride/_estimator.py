"""Online step-time estimation, shared by the worker (admission) and the manager's core (placement)."""

from __future__ import annotations

from collections import deque

from freeride.measure import percentiles as _percentiles
from freeride.measure import rank_index


class StepEstimator:
    """A high percentile (nearest rank, ``freeride.measure``) of the most recent step durations.

    The worker admits a step only while ``now + estimate + margin <= deadline``; a high percentile
    (p95 of the last ``window`` steps) rather than the mean keeps overruns rare when step times
    jitter, and a bounded window lets the estimate follow a task whose steps change length.
    """

    def __init__(self, window: int = 64, quantile: float = 0.95, hint_ns: int = 0) -> None:
        if window < 1 or not 0 < quantile <= 1:
            raise ValueError("window must be >= 1 and quantile in (0, 1]")
        self._samples: deque[int] = deque(maxlen=window)
        self._quantile = quantile
        self._hint_ns = hint_ns
        self._cached: int | None = None

    def add(self, duration_ns: int) -> None:
        self._samples.append(max(0, int(duration_ns)))
        self._cached = None

    def extend(self, durations_ns: list[int]) -> None:
        for d in durations_ns:
            self.add(d)

    @property
    def count(self) -> int:
        return len(self._samples)

    def estimate_ns(self) -> int | None:
        """The high-percentile step time, the hint before any sample, or None if neither."""
        if not self._samples:
            return self._hint_ns or None
        if self._cached is None:
            ordered = sorted(self._samples)
            self._cached = ordered[rank_index(len(ordered), 100 * self._quantile)]
        return self._cached

    def median_ns(self) -> int | None:
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[rank_index(len(ordered), 50)]


def percentiles(values: list[float] | deque[float]) -> tuple[int, float, float, float, float]:
    """(count, p50, p90, p99, max) of a sample, nearest rank (``freeride.measure``); zeros when empty."""
    if not values:
        return (0, 0.0, 0.0, 0.0, 0.0)
    p50, p90, p99, top = _percentiles(values, (50, 90, 99, 100))
    return (len(values), p50, p90, p99, top)
