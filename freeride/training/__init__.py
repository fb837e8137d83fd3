"""The trainer side of freeride: what a training job imports to report its bubbles.

* :mod:`~freeride.training.reporter`: :class:`BubbleReporter`, whose calls only enqueue and return in
  microseconds, and stream bubble events to the device's manager in the background.
* :mod:`~freeride.training.instrument`: :class:`InstrumentedSchedule` wraps a
  ``torch.distributed.pipelining`` schedule and reports every real wait as a bubble, timed by the
  device on a GPU (:mod:`~freeride.training.device_clock`).
* :mod:`~freeride.training.schedules`: schedules as data (actions and idle slots per stage), the
  simulator that lists each stage's idle slots; :mod:`~freeride.training.predictor` learns each slot's
  length from it and from measurements.
* :mod:`~freeride.training.memory` and :mod:`~freeride.training.planner`: what each stage holds and
  leaves free in each slot, and ``freeride plan --sweep``.

The reference workload that uses all of this is :mod:`freeride.workload`.
"""

from freeride.training.instrument import InstrumentedSchedule
from freeride.training.predictor import BubblePredictor
from freeride.training.reporter import BubbleReporter
from freeride.training.schedules import build_schedule

__all__ = ["BubblePredictor", "BubbleReporter", "InstrumentedSchedule", "build_schedule"]
