"""The trainer side of freeride: what a training job imports to report its bubbles.

* :mod:`~freeride.training.reporter`: :class:`BubbleReporter`, whose calls only enqueue and return in
  microseconds, and stream bubble events to the device's manager in the background.
* :mod:`~freeride.training.tracker`: :class:`RankTracker`, the framework-agnostic core every
  adapter drives: marks of one rank's compute and waits in, bubbles mapped to the schedule's slots,
  predicted and reported out, timed by the device on a GPU (:mod:`~freeride.training.device_clock`).
* :mod:`~freeride.training.instrument`: :class:`InstrumentedSchedule`, the adapter for a
  ``torch.distributed.pipelining`` schedule (every schedule torch offers);
  :mod:`~freeride.training.megatron`, the one for Megatron Core's schedules (imports Megatron only
  when called).
* :mod:`~freeride.training.schedules`: schedules as data (actions and idle slots per stage), the
  simulator that lists each stage's idle slots; :mod:`~freeride.training.rank_slots`: where one rank
  of any order waits and for how long in steady state; :mod:`~freeride.training.predictor` learns
  each slot's length from it and from measurements.
* :mod:`~freeride.training.memory` and :mod:`~freeride.training.planner`: what each stage holds and
  leaves free in each slot, and ``freeride plan --sweep``.

The reference workload that uses all of this is :mod:`freeride.workload`.
"""

from freeride.training.instrument import InstrumentedSchedule
from freeride.training.predictor import BubblePredictor
from freeride.training.reporter import BubbleReporter
from freeride.training.schedules import build_schedule
from freeride.training.tracker import RankTracker

__all__ = ["BubblePredictor", "BubbleReporter", "InstrumentedSchedule", "RankTracker", "build_schedule"]
