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

Nothing here measures anything; every function is plain arithmetic on its arguments and raises
``ValueError`` on inputs that would make a figure meaningless (a zero baseline, negative times).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "PRICE_RATIOS",
    "CostInputs",
    "bubble_fraction",
    "cost_saving",
    "harvest_efficiency",
    "mean_ci95",
    "overhead",
    "percentile",
    "work_seconds",
]

#: Price ratios the bench reports: the same device; the reference's server vs a dedicated RTX 3080
#: per GPU (a $3.96/h 4-GPU server is $0.99/h a GPU: 5.5x); the reference's own 22x.
PRICE_RATIOS: tuple[float, ...] = (1.0, 5.5, 22.0)


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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean_ci95(values: Iterable[float]) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95% interval (0 for one value)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values")
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, 1.96 * math.sqrt(var / len(xs))
