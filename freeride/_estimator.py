"""Online estimation shared by the worker (admission) and the manager's core (placement): a task's step time,
and how long a bubble that has lasted so far will still last."""

from __future__ import annotations

import bisect
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


#: How many of a slot's recent lengths a grant carries (the trainer's predictor keeps 16 a slot).
SURVIVAL_LENGTHS = 16
#: The percentile of the surviving lengths an extended deadline is cut to: the trainer's own (p10).
SURVIVAL_PERCENTILE = 10.0


def within_grace(step_ns: int | None, grace_ns: int) -> bool:
    """Whether a step of (high-percentile) time ``step_ns`` may run on to the longest surviving length: an end it
    did not see coming costs it no more than the grace (:func:`surviving_end_ns`). Unknown: no."""
    return step_ns is not None and step_ns <= grace_ns


def surviving_end_ns(start_ns: int, lengths_ns: tuple[int, ...], now_ns: int, within_grace: bool = False) -> int:
    """A later deadline for a bubble that began at ``start_ns`` and has not ended by ``now_ns``, when the next
    step no longer fits the one it has; ``lengths_ns`` are its slot's recent lengths, sorted. 0 when there
    are none.

    A grant's deadline is the trainer's low-percentile prediction, made at the start, and most bubbles
    outlive it. What the slot's lengths still allow is the lengths longer than what has passed:

    * a step that overruns an end it did not see coming by no more than the grace (``within_grace``: its
      high-percentile time is within it) is sized to the **longest** of them: that overrun is one every
      grant tolerates before a freeze, and the worker starts no step after the real end once it can read
      it (the trainer's end board, its ended-grant word);
    * a longer step is sized to their ``SURVIVAL_PERCENTILE``-th percentile (nearest rank): as likely to
      be passed by the real end as the first prediction was.

    Neither decreases as ``now_ns`` grows (the candidates shrink from below), and neither passes the
    longest length seen: a bubble longer than any before gets no more time than that. Plain arithmetic on
    at most ``SURVIVAL_LENGTHS`` numbers, for the worker before a step that does not fit its deadline and
    for the core at a grant and a freeze.
    """
    if not lengths_ns:
        return 0
    i = bisect.bisect_right(lengths_ns, now_ns - start_ns)
    left = len(lengths_ns) - i
    if within_grace or left == 0:
        return start_ns + lengths_ns[-1]
    return start_ns + lengths_ns[i + rank_index(left, SURVIVAL_PERCENTILE)]
