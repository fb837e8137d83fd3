"""Bubble length prediction: start from the model, then learn from what the trainer measures.

:class:`BubblePredictor` keeps, for every ``(stage, slot)``, the recent measured lengths of that
bubble. Until ``warmup`` measurements exist it predicts from the analytical model
(:mod:`freeride.training.schedules`) evaluated with online-profiled forward and backward times
(:class:`ComputeProfile`: an EWMA of measured compute durations). After that it predicts a
quantile of the last ``window`` measurements: a bubble repeats every iteration at the same place, so
its recent lengths say what the next one will be, robust to the odd outlier (a page fault, a GC
pause, a noisy neighbour) that would drag a mean or an EWMA. The median (``quantile=0.5``, the
default) is the most accurate single figure; a prediction that a side task's grant is cut to should
rather be conservative where a slot's length varies, so that the grant rarely outlives the real
wait: :class:`freeride.training.tracker.RankTracker` predicts the 10th percentile. Warm predictions
are cached per slot until its next measurement, so the training thread's per-bubble cost is a dict
lookup.

Every prediction that is later measured is scored (``|predicted - measured| / measured``); the
errors after warm-up are what ``prediction_error()`` summarises and what the benchmark reports.
All methods are plain data operations, cheap enough for the training thread (a sort of ``window``
numbers at each bubble end, done after the wait is over).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from freeride import measure
from freeride.errors import ConfigError


@dataclass(frozen=True)
class ErrorSummary:
    """Relative prediction error over scored bubbles (fractions: 0.05 is 5%)."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float


def percentile(values: list[float], q: float) -> float:
    """:func:`freeride.measure.percentile` (nearest rank), but 0.0 for an empty list."""
    return measure.percentile(values, q) if values else 0.0


def summarize(errors: list[float]) -> ErrorSummary:
    return ErrorSummary(
        count=len(errors),
        p50=percentile(errors, 50),
        p90=percentile(errors, 90),
        p99=percentile(errors, 99),
        max=max(errors) if errors else 0.0,
    )


class ComputeProfile:
    """EWMA of measured action durations per kind (``F``, ``B``, ``I``, ``W``), in nanoseconds."""

    def __init__(self, alpha: float = 0.2, defaults_ns: dict[str, float] | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._mean: dict[str, float] = dict(defaults_ns or {})
        self._seen: dict[str, int] = {}

    def observe(self, kind: str, duration_ns: int) -> None:
        if duration_ns <= 0:
            return
        n = self._seen.get(kind, 0)
        old = self._mean.get(kind)
        self._mean[kind] = float(duration_ns) if n == 0 or old is None else old + self.alpha * (duration_ns - old)
        self._seen[kind] = n + 1

    def mean_ns(self, kind: str, default: float = 0.0) -> float:
        return self._mean.get(kind, default)

    def samples(self, kind: str) -> int:
        return self._seen.get(kind, 0)


SlotKey = tuple[int, int]  # (stage, slot)


class BubblePredictor:
    """Per-(stage, slot) bubble length prediction, seeded by a model and learned online.

    ``model`` maps a slot key to its modelled length in nanoseconds (or None when unknown); it is
    consulted only while a slot has fewer than ``warmup`` measurements. ``quantile`` (a fraction)
    is what a warm slot predicts of its recent lengths (module doc). Errors are scored for every
    measurement, and kept apart for predictions made after warm-up.
    """

    def __init__(
        self,
        model: Callable[[int, int], float | None] | None = None,
        window: int = 9,
        warmup: int = 3,
        fallback_ns: int = 1_000_000,
        max_errors: int = 100_000,
        quantile: float = 0.5,
    ) -> None:
        if window < 1 or warmup < 0:
            raise ConfigError(f"window must be >= 1 and warmup >= 0, got {window}, {warmup}")
        if not 0 <= quantile <= 1:
            raise ConfigError(f"quantile must be in [0, 1], got {quantile}")
        self._model = model
        self.window = window
        self.warmup = warmup
        self.fallback_ns = fallback_ns
        self.quantile = quantile
        self._warm: dict[SlotKey, int] = {}  # each warm slot's prediction, set at its every measurement
        self._rank: dict[int, int] = {}  # the quantile's index in a sorted history of each length
        self._history: dict[SlotKey, deque[int]] = {}
        #: Each history, kept sorted as it changes (one insort and one removal of at most ``window`` ints): a
        #: warm prediction is then an index into it, not a sort at each slot's wait (the training thread).
        self._sorted: dict[SlotKey, list[int]] = {}
        self._count: dict[SlotKey, int] = {}
        #: The last ``max_errors`` scores: (slot, predicted, measured, made after warm-up).
        self._scored: deque[tuple[SlotKey, int, int, bool]] = deque(maxlen=max_errors)

    def set_model(self, model: Callable[[int, int], float | None] | None) -> None:
        self._model = model

    def measurements(self, stage: int, slot: int) -> int:
        return self._count.get((stage, slot), 0)

    def predict_ns(self, stage: int, slot: int) -> int:
        """The expected length of this slot's next occurrence (>= 1 ns)."""
        key = (stage, slot)
        warm = self._warm.get(key)  # :meth:`observe` keeps it for a slot past its warm-up
        if warm is not None:
            return warm
        history = self._history.get(key)
        modelled = self._model(stage, slot) if self._model is not None else None
        if modelled is not None and modelled > 0:
            return max(1, int(modelled))
        if history:
            return max(1, int(history[-1]))
        return self.fallback_ns

    def observe(self, stage: int, slot: int, measured_ns: int, predicted_ns: int | None = None) -> None:
        """Learn a measured length; score ``predicted_ns`` (what was announced) against it.

        On the training thread, once per reported slot and iteration (``RankTracker._deliver``): it keeps
        the slot's sorted history and its next warm prediction, and stores the score as it came (the
        errors are worked out when asked for).
        """
        if measured_ns <= 0:
            return
        key = (stage, slot)
        count = self._count.get(key, 0)
        measured = int(measured_ns)
        if predicted_ns is not None and predicted_ns > 0:
            self._scored.append((key, int(predicted_ns), measured, count >= self.warmup))
        history = self._history.get(key)
        if history is None:
            history = self._history[key] = deque(maxlen=self.window)
            ordered = self._sorted[key] = []
        else:
            ordered = self._sorted[key]
            if len(history) == self.window:
                del ordered[bisect.bisect_left(ordered, history[0])]  # the length the append below drops
        history.append(measured)
        bisect.insort(ordered, measured)
        self._count[key] = count = count + 1
        if count >= self.warmup:
            n = len(ordered)
            index = self._rank.get(n)
            if index is None:
                index = self._rank[n] = measure.rank_index(n, 100 * self.quantile)
            self._warm[key] = max(1, ordered[index])
        else:
            self._warm.pop(key, None)

    def prediction_error(self, after_warmup: bool = True) -> ErrorSummary:
        """Relative error of the last ``max_errors`` predictions scored (by default only after warm-up)."""
        return summarize([abs(p - m) / m for _, p, m, warm in self._scored if warm or not after_warmup])

    def slot_error(self, stage: int, slot: int) -> ErrorSummary:
        """The same, of one slot's predictions after its warm-up."""
        key = (stage, slot)
        return summarize([abs(p - m) / m for k, p, m, warm in self._scored if warm and k == key])
