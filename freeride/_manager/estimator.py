"""Online step-time estimation shared by the worker (admission) and the core (placement)."""

from __future__ import annotations

from collections import deque


class StepEstimator:
    """A high percentile of the most recent step durations.

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
            index = min(len(ordered) - 1, int(self._quantile * len(ordered)))
            self._cached = ordered[index]
        return self._cached

    def median_ns(self) -> int | None:
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[len(ordered) // 2]


def percentiles(values: list[float] | deque[float]) -> tuple[int, float, float, float, float]:
    """(count, p50, p90, p99, max) of a sample; zeros when empty."""
    if not values:
        return (0, 0.0, 0.0, 0.0, 0.0)
    ordered = sorted(values)
    n = len(ordered)

    def q(p: float) -> float:
        return float(ordered[min(n - 1, int(p * n))])

    return (n, q(0.50), q(0.90), q(0.99), float(ordered[-1]))
