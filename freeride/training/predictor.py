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

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable
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


class _Lengths:
    """One slot's recent lengths: in order (the window) and sorted (one insort and one removal of at most
    ``window`` ints as it changes: a warm prediction is then an index into it, not a sort at each slot's
    wait), and how many were ever measured."""

    __slots__ = ("count", "history", "ordered")

    def __init__(self, window: int) -> None:
        self.history: deque[int] = deque(maxlen=window)
        self.ordered: list[int] = []
        self.count = 0


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
        #: Each warm slot's prediction, set at its every measurement: read-only for others (the tracker's
        #: marks read it directly: one lookup on the training thread, no call).
        self.warm: dict[SlotKey, int] = {}
        #: The quantile's index in a sorted history of each length (0 .. ``window``).
        self._rank = [0] + [measure.rank_index(n, 100 * quantile) for n in range(1, window + 1)]
        self._lengths: dict[SlotKey, _Lengths] = {}
        #: The last ``max_errors`` scores: (slot, predicted, measured, made after warm-up).
        self._scored: deque[tuple[SlotKey, int, int, bool]] = deque(maxlen=max_errors)

    def set_model(self, model: Callable[[int, int], float | None] | None) -> None:
        self._model = model

    def measurements(self, stage: int, slot: int) -> int:
        lengths = self._lengths.get((stage, slot))
        return 0 if lengths is None else lengths.count

    def predict_ns(self, stage: int, slot: int) -> int:
        """The expected length of this slot's next occurrence (>= 1 ns)."""
        key = (stage, slot)
        warm = self.warm.get(key)  # :meth:`observe` keeps it for a slot past its warm-up
        if warm is not None:
            return warm
        lengths = self._lengths.get(key)
        modelled = self._model(stage, slot) if self._model is not None else None
        if modelled is not None and modelled > 0:
            return max(1, int(modelled))
        if lengths is not None and lengths.history:
            return max(1, int(lengths.history[-1]))
        return self.fallback_ns

    def observe(self, stage: int, slot: int, measured_ns: int, predicted_ns: int | None = None) -> None:
        """Learn a measured length; score ``predicted_ns`` (what was announced) against it."""
        self.observe_all(stage, ((slot, measured_ns, predicted_ns),))

    def observe_all(self, stage: int, measured: Iterable[tuple[int, int, int | None]]) -> None:
        """:meth:`observe` of each ``(slot, measured_ns, predicted_ns)``, in order.

        On the training thread, once per learning batch with its iterations' waits (``RankTracker._deliver``:
        each iteration while the model profiles, then every ``learn_every``): each slot keeps its sorted
        history and its next warm prediction, and the score is stored as it came (the errors are worked out
        when asked for). One call a batch, its lookups made once: a call per wait cost the training thread as
        much again, cache-cold between compute actions.
        """
        window, warmup, rank = self.window, self.warmup, self._rank
        all_lengths, warm, score = self._lengths, self.warm, self._scored.append
        for slot, measured_ns, predicted_ns in measured:
            if measured_ns <= 0:
                continue
            key = (stage, slot)
            lengths = all_lengths.get(key)
            if lengths is None:
                lengths = all_lengths[key] = _Lengths(window)
            count = lengths.count
            measured_ns = int(measured_ns)
            if predicted_ns is not None and predicted_ns > 0:
                score((key, int(predicted_ns), measured_ns, count >= warmup))
            history, ordered = lengths.history, lengths.ordered
            if len(history) == window:
                del ordered[bisect_left(ordered, history[0])]  # the length the append below drops
            history.append(measured_ns)
            insort(ordered, measured_ns)
            lengths.count = count = count + 1
            if count >= warmup:
                warm[key] = ordered[rank[len(ordered)]]  # every length is >= 1 ns
            else:
                warm.pop(key, None)

    def prediction_error(self, after_warmup: bool = True) -> ErrorSummary:
        """Relative error of the last ``max_errors`` predictions scored (by default only after warm-up)."""
        return summarize([abs(p - m) / m for _, p, m, warm in self._scored if warm or not after_warmup])

    def slot_error(self, stage: int, slot: int) -> ErrorSummary:
        """The same, of one slot's predictions after its warm-up."""
        key = (stage, slot)
        return summarize([abs(p - m) / m for k, p, m, warm in self._scored if warm and k == key])
