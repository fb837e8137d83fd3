"""The arithmetic of freeride's figures, in one place: the demo's summary and the bench use it.

Definitions (DESIGN section 6), all from quantities measured in the same run:

* **overhead** = ``T_mode / T_base - 1``: how much longer training took with freeride (or any
  mode) than the baseline without side tasks, on the same trainer config.
* **bubble time** ``B``: the sum of the measured bubble lengths of a device (or of all devices).
  **bubble fraction** = ``B / wall time`` of that device.
* **harvest efficiency** ``H = (progress / standalone throughput) / B``: the side task's progress,
  converted to the seconds it would have needed with the device to itself, as a share of the bubble
  time that was offered. 1.0 means every bubble second did a standalone second of work.
* **cost saving**, with the reference's model made explicit. With ``r`` the price ratio of a training
  device-hour to a dedicated side-task device-hour, ``W`` the side work in dedicated-device seconds
  (summed over devices), ``n`` training devices, ``T_base`` the baseline training time and
  ``dT = T_mode - T_base`` the extra training time::

      saving = (W / r - n * dT) / (n * T_base)

  the value of the side work priced at the dedicated device's rate, less the cost of the extra
  training time, over the cost of the baseline training. ``W`` is measured against the standalone
  throughput *on the same device*: at ``r = 1`` that is "a second device of the same kind"; at
  ``r = 22`` (the reference's $3.96/h server vs a $0.18/h RTX 3080) the dedicated device is assumed
  to be as fast as ours, which flatters no one: it only scales the value down.

**Percentiles: one definition, nearest rank.** ``percentile(values, q)`` is the smallest sample
``x`` such that at least ``q`` percent of the samples are ``<= x``: with ``n`` sorted samples, the
one of rank ``ceil(q / 100 * n)`` (rank 1 for ``q = 0``). It is NumPy's ``method="inverted_cdf"``
(Hyndman and Fan's type 1). Every percentile the project prints or acts on uses it: the manager's
latency windows and bubble statistics, the step-time estimator's p95 (admission) and median, the
fixed-memory histogram (the same rank, reported as its bucket's midpoint), the predictor's error
summary and slot medians, standalone step times, the demo and every bench. Why this definition
rather than linear interpolation (NumPy's default): a reported ``p99 = 0.72 ms`` then reads exactly
"99% of the samples took at most 0.72 ms", which is how the targets are stated; every figure is a
value that was observed; the histogram, which keeps counts and no samples, can compute the same rank
(an interpolated figure it cannot); and an index is all the manager's hot paths need. The median is
``percentile(values, 50)``, the lower of the two middle samples of an even count.

**Intervals and trials.** The bench's trials are paired: within a trial every mode runs once (in
a random order) next to a ``none`` run, so the per-trial ratio ``T_mode / T_none`` cancels what the
trial shares (the machine's load of the moment, the frequency of its cores). The overhead's
estimate is the mean of the per-trial ratios minus one, with a Student-t interval on them
(:func:`paired_overhead`; the t quantile from ``scipy.stats.t``, never a z of 1.96, which for 2
trials is 6.5 times too narrow) or a BCa bootstrap (:func:`bootstrap_interval`, ``scipy.stats``),
which assumes no normality but needs more trials to mean anything. :func:`stop_decision` is the
adaptive rule: keep adding trials until every watched interval's half-width is within the target
(one percentage point by default), or the trial or time budget is spent, and then say which.

Nothing here measures anything; every function is plain arithmetic on its arguments and raises
``ValueError`` on inputs that would make a figure meaningless (a zero baseline, negative times).
SciPy is imported only by the interval functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from freeride._extras import require

__all__ = [
    "PRICE_RATIOS",
    "PRICE_RATIO_TEXT",
    "SAVING_TEXT",
    "CostInputs",
    "Interval",
    "StopDecision",
    "StopRule",
    "bootstrap_interval",
    "bubble_fraction",
    "cost_saving",
    "harvest_efficiency",
    "median",
    "overhead",
    "paired_overhead",
    "paired_ratio",
    "percentile",
    "percentiles",
    "rank_index",
    "stop_decision",
    "t_interval",
    "trials_needed",
    "work_seconds",
]

#: Price ratios the bench reports: the same device; the reference's server vs a dedicated RTX 3080
#: per GPU (a $3.96/h 4-GPU server is $0.99/h a GPU: 5.5x); the reference's own 22x.
PRICE_RATIOS: tuple[float, ...] = (1.0, 5.5, 22.0)

#: :func:`cost_saving` in words, for every place that prints a saving.
SAVING_TEXT = ("(value of the side work - cost of the extra training time) / cost of the training alone; the side "
               "work is valued at the price of a dedicated device doing it as fast as it runs alone here")

#: What each of :data:`PRICE_RATIOS` stands for (price ratio r = an hour of a training device / an hour of the
#: dedicated device that would otherwise do the side work).
PRICE_RATIO_TEXT: dict[float, str] = {
    1.0: "the dedicated device costs as much as a training device (a second device of the same kind)",
    5.5: "the reference's prices per GPU: its $3.96/h 4-GPU server is $0.99/h a GPU, an RTX 3080 $0.18/h",
    22.0: "the reference's own ratio, its whole server ($3.96/h) to one RTX 3080 ($0.18/h): applied per device, "
          "it values the side work at a quarter of the 5.5x figure",
}


def _check_time(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite time >= 0, got {value!r}")


def overhead(t_mode_s: float, t_base_s: float) -> float:
    """``T_mode / T_base - 1`` (0.01 = training took 1% longer)."""
    _check_time("t_mode_s", t_mode_s)
    _check_time("t_base_s", t_base_s)
    if t_base_s == 0:
        raise ValueError("the baseline time is 0: no overhead can be computed")
    return t_mode_s / t_base_s - 1.0


def bubble_fraction(bubble_s: float, wall_s: float) -> float:
    """Share of a device's wall time spent in bubbles."""
    _check_time("bubble_s", bubble_s)
    _check_time("wall_s", wall_s)
    if wall_s == 0:
        raise ValueError("the wall time is 0: no bubble fraction can be computed")
    return bubble_s / wall_s


def work_seconds(progress: float, standalone_rate_per_s: float) -> float:
    """Side-task progress as seconds of standalone work on the same device."""
    if not math.isfinite(progress) or progress < 0:
        raise ValueError(f"progress must be finite and >= 0, got {progress!r}")
    if not math.isfinite(standalone_rate_per_s) or standalone_rate_per_s <= 0:
        raise ValueError(f"the standalone throughput must be > 0, got {standalone_rate_per_s!r}")
    return progress / standalone_rate_per_s


def harvest_efficiency(progress: float, standalone_rate_per_s: float, bubble_s: float) -> float:
    """``(progress / standalone throughput) / B``; 0 when there was no bubble time."""
    _check_time("bubble_s", bubble_s)
    work = work_seconds(progress, standalone_rate_per_s)
    return work / bubble_s if bubble_s > 0 else 0.0


@dataclass(frozen=True)
class CostInputs:
    """What :func:`cost_saving` needs, with units in the names."""

    work_device_s: float  # W: side work in dedicated-device seconds, summed over devices
    t_mode_s: float  # training time with side tasks
    t_base_s: float  # training time without
    devices: int  # training devices (n)


def cost_saving(inputs: CostInputs, price_ratio: float) -> float:
    """``(W / r - n * dT) / (n * T_base)``; see the module docstring. Negative when it costs."""
    _check_time("work_device_s", inputs.work_device_s)
    _check_time("t_mode_s", inputs.t_mode_s)
    _check_time("t_base_s", inputs.t_base_s)
    if inputs.devices < 1:
        raise ValueError(f"devices must be >= 1, got {inputs.devices}")
    if inputs.t_base_s == 0:
        raise ValueError("the baseline time is 0: no saving can be computed")
    if not math.isfinite(price_ratio) or price_ratio <= 0:
        raise ValueError(f"the price ratio must be > 0, got {price_ratio!r}")
    extra_s = inputs.t_mode_s - inputs.t_base_s
    n = inputs.devices
    return (inputs.work_device_s / price_ratio - n * extra_s) / (n * inputs.t_base_s)




# ------------------------------------------------------------------ percentiles (nearest rank)


def rank_index(n: int, q: float) -> int:
    """The 0-based index of the nearest-rank ``q``-th percentile among ``n`` sorted samples.

    ``ceil(q / 100 * n) - 1``, at least 0. The product is formed before the division and nudged
    down by a relative 1e-12 so that binary fractions do not push an exact rank up by one
    (``0.07 * 100`` is ``7.000000000000001`` in floating point; ``7 * 100 / 100`` is 7).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    exact = q * n / 100.0
    rank = math.ceil(exact - 1e-12 * max(1.0, exact))
    return min(n, max(1, rank)) - 1


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (``q`` in [0, 100]; see the module doc); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return float(ordered[rank_index(len(ordered), q)])


def percentiles(values: Iterable[float], qs: Sequence[float]) -> tuple[float, ...]:
    """Several nearest-rank percentiles of one sample, sorting it once; NaNs for no values."""
    ordered = sorted(values)
    if not ordered:
        for q in qs:
            rank_index(1, q)  # validates q
        return tuple(math.nan for _ in qs)
    return tuple(float(ordered[rank_index(len(ordered), q)]) for q in qs)


def median(values: Iterable[float]) -> float:
    """``percentile(values, 50)``: the lower middle sample of an even count; NaN for no values."""
    return percentile(values, 50)


# ------------------------------------------------------------------ intervals


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided confidence interval ``[low, high]`` over ``n`` samples.

    With one sample the interval is unbounded (``low = -inf``, ``high = inf``): one trial says
    nothing about the spread between trials.
    """

    estimate: float
    low: float
    high: float
    n: int
    confidence: float = 0.95
    method: str = "t"

    @property
    def half_width(self) -> float:
        """The larger distance from the estimate to an end (the two are equal for ``t``)."""
        return max(self.estimate - self.low, self.high - self.estimate)

    def shifted(self, offset: float) -> Interval:
        """The same interval moved by ``offset`` (a ratio's interval as an overhead's: ``-1``)."""
        return Interval(self.estimate + offset, self.low + offset, self.high + offset, self.n, self.confidence,
                        self.method)

    def to_json(self) -> dict[str, float | int | str | None]:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"estimate": self.estimate, "low": finite(self.low), "high": finite(self.high),
                "half_width": finite(self.half_width), "n": self.n, "confidence": self.confidence,
                "method": self.method}


def _finite_values(values: Iterable[float]) -> list[float]:
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values")
    if not all(math.isfinite(x) for x in xs):
        raise ValueError(f"values must be finite, got {xs!r}")
    return xs


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def t_quantile(confidence: float, dof: int) -> float:
    """The two-sided Student-t quantile ``t_{(1 + confidence) / 2, dof}`` (``scipy.stats.t``)."""
    _check_confidence(confidence)
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    require("bench", "freeride.measure's t intervals", ["scipy"])
    from scipy import stats

    return float(stats.t.ppf((1.0 + confidence) / 2.0, dof))


def t_interval(values: Iterable[float], confidence: float = 0.95) -> Interval:
    """The mean and its Student-t interval: ``mean +- t_{n-1} * s / sqrt(n)``, ``s`` the sample
    standard deviation (n - 1 in the denominator)."""
    _check_confidence(confidence)
    xs = _finite_values(values)
    n = len(xs)
    mean = math.fsum(xs) / n
    if n == 1:
        return Interval(mean, -math.inf, math.inf, 1, confidence, "t")
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    half = t_quantile(confidence, n - 1) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n, confidence, "t")


def bootstrap_interval(values: Iterable[float], confidence: float = 0.95, resamples: int = 9999,
                       seed: int = 0) -> Interval:
    """The mean and its BCa bootstrap interval (``scipy.stats.bootstrap``, seeded: reproducible).

    Identical values give a zero-width interval (BCa is undefined there); one value an unbounded one.
    """
    _check_confidence(confidence)
    xs = _finite_values(values)
    n = len(xs)
    mean = math.fsum(xs) / n
    if n == 1:
        return Interval(mean, -math.inf, math.inf, 1, confidence, "bootstrap")
    if max(xs) == min(xs):
        return Interval(mean, mean, mean, n, confidence, "bootstrap")
    require("bench", "freeride.measure's bootstrap intervals", ["numpy", "scipy"])
    import numpy as np
    from scipy import stats

    result = stats.bootstrap((np.asarray(xs),), np.mean, confidence_level=confidence, n_resamples=resamples,
                             method="BCa", rng=np.random.default_rng(seed))
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):  # BCa degenerates on some tiny samples
        result = stats.bootstrap((np.asarray(xs),), np.mean, confidence_level=confidence,
                                 n_resamples=resamples, method="percentile", rng=np.random.default_rng(seed))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return Interval(mean, low, high, n, confidence, "bootstrap")


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95,
                 method: str = "t") -> Interval:
    """The mean of the per-pair ratios ``numerators[i] / denominators[i]`` with its interval.

    Pair ``i`` is one trial: both figures were measured in it, next to each other. ``method`` is
    ``"t"`` (:func:`t_interval`) or ``"bootstrap"`` (:func:`bootstrap_interval`).
    """
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators: pairs are one each")
    ratios = []
    for a, b in zip(numerators, denominators, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)) or b <= 0 or a < 0:
            raise ValueError(f"a ratio needs a finite numerator >= 0 and denominator > 0, got {a!r} / {b!r}")
        ratios.append(a / b)
    if method == "t":
        return t_interval(ratios, confidence)
    if method == "bootstrap":
        return bootstrap_interval(ratios, confidence)
    raise ValueError(f"unknown interval method {method!r}: expected t or bootstrap")


def paired_overhead(t_mode: Sequence[float], t_base: Sequence[float], confidence: float = 0.95,
                    method: str = "t") -> Interval:
    """The overhead ``mean_i(T_mode[i] / T_base[i]) - 1`` over paired trials, with its interval."""
    return paired_ratio(t_mode, t_base, confidence, method).shifted(-1.0)


# ------------------------------------------------------------------ the stopping rule


def trials_needed(interval: Interval, target_half_width: float, limit: int = 10_000) -> int | None:
    """How many trials a t interval with this one's spread needs for a half-width <= the target.

    The spread is the sample standard deviation behind ``interval`` (``half_width * sqrt(n) /
    t_{n-1}``), taken as the truth: an estimate for planning, not a promise. None when the interval
    has fewer than two samples or more than ``limit`` trials would be needed.
    """
    if target_half_width <= 0:
        raise ValueError(f"the target half-width must be > 0, got {target_half_width!r}")
    if interval.n < 2 or not math.isfinite(interval.half_width):
        return None
    spread = interval.half_width * math.sqrt(interval.n) / t_quantile(interval.confidence, interval.n - 1)
    if spread == 0:
        return 2
    m = 2
    while m <= limit:
        if t_quantile(interval.confidence, m - 1) * spread / math.sqrt(m) <= target_half_width:
            return m
        # Far from the target the t quantile is ~2: jump close to the answer instead of stepping by one.
        m = max(m + 1, math.ceil((2.0 * spread / target_half_width) ** 2 * 0.9))
    return None


@dataclass(frozen=True)
class StopRule:
    """When the bench stops adding trials.

    Attributes:
        target_half_width: the 95% half-width every watched interval must reach (0.01: +-1 pp).
        min_trials: trials always run (a t interval over fewer than 3 is too fragile to stop on).
        max_trials: trials never exceeded.
        budget_s: wall time the trials may take; another trial starts only if, at the mean
            duration of the trials so far, it ends within the budget.
    """

    target_half_width: float = 0.01
    min_trials: int = 3
    max_trials: int = 40
    budget_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.target_half_width > 0:
            raise ValueError(f"target_half_width must be > 0, got {self.target_half_width!r}")
        if self.min_trials < 2:
            raise ValueError(f"min_trials must be >= 2 (an interval needs two trials), got {self.min_trials}")
        if self.max_trials < self.min_trials:
            raise ValueError(f"max_trials ({self.max_trials}) must be >= min_trials ({self.min_trials})")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s!r}")


@dataclass(frozen=True)
class StopDecision:
    """What :func:`stop_decision` concluded, in data and in words.

    ``converged``: every watched interval is within the target. ``widest``: the label of the widest
    interval (None when there is none). ``trials_needed``: for the intervals still too wide, the
    trials their observed spread would need (None where it cannot be estimated).
    """

    stop: bool
    converged: bool
    reason: str
    widest: str | None = None
    trials_needed: Mapping[str, int | None] | None = None


def stop_decision(rule: StopRule, intervals: Mapping[str, Interval], trials: int, elapsed_s: float) -> StopDecision:
    """Whether to run another trial, after ``trials`` trials that took ``elapsed_s`` in all.

    ``intervals`` are the watched figures (label -> interval over the ``trials`` trials). Stops
    when every one is within ``rule.target_half_width`` (from ``min_trials`` on), or when
    ``max_trials`` are done, or when another trial at the mean duration so far would end past
    ``budget_s``; the reason says which, and which intervals did not get there.
    """
    if trials < 0 or elapsed_s < 0:
        raise ValueError("trials and elapsed_s must be >= 0")
    target = rule.target_half_width
    wide = {k: v for k, v in intervals.items() if not v.half_width <= target}
    widest = max(intervals, key=lambda k: intervals[k].half_width) if intervals else None
    pp = f"+-{100 * target:g} pp"
    if trials >= rule.min_trials and widest is not None and not wide:
        return StopDecision(True, True, f"converged: every watched 95% interval is within {pp} after {trials} "
                            f"trials (widest: {widest}, +-{100 * intervals[widest].half_width:.2f} pp)", widest, {})
    needed = {k: trials_needed(v, target) for k, v in wide.items()}
    short = "; ".join(f"{k} +-{100 * v.half_width:.2f} pp" + (f" (~{needed[k]} trials at this spread)"
                                                             if needed[k] else "")
                      for k, v in sorted(wide.items(), key=lambda kv: -kv[1].half_width))
    if trials >= rule.max_trials:
        return StopDecision(True, False, f"not resolved: stopped at the trial limit ({rule.max_trials}) with "
                            f"intervals wider than {pp}: {short}", widest, needed)
    mean_trial_s = elapsed_s / trials if trials else 0.0
    if trials >= rule.min_trials and elapsed_s + mean_trial_s > rule.budget_s:
        return StopDecision(True, False, f"not resolved: the time budget ({rule.budget_s:.0f} s) leaves no room "
                            f"for another trial after {trials} ({elapsed_s:.0f} s); intervals wider than {pp}: "
                            f"{short}", widest, needed)
    if trials < rule.min_trials:
        return StopDecision(False, False, f"{trials} of at least {rule.min_trials} trials", widest, needed)
    return StopDecision(False, False, f"after {trials} trials, wider than {pp}: {short}", widest, needed)
