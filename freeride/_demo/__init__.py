"""``freeride demo``: the whole system on one machine, end to end, with a summary and pictures.

The demo is a script with a pure core. The orchestration (:mod:`freeride._demo.run`) starts real
processes in order -- a baseline training run, a standalone measurement of each side task, one
manager per device, the side tasks, the reported training run -- and stops every one of them on
any exit path. Everything it reports is computed afterwards, from files those processes wrote,
by pure functions that the unit tests drive with fixed data:

* :mod:`freeride._demo.plan`: what runs where (devices, side tasks and their arguments, sizes);
* :mod:`freeride._demo.summary`: the trainer's iteration logs, the managers' statistics and the
  standalone throughputs in, the figures (:mod:`freeride.measure` does the arithmetic) and their
  consistency checks out;
* :mod:`freeride._demo.timeline`: the timeline picture (matplotlib, Agg);
* :mod:`freeride._demo.perfetto`: the Chrome trace-event file that Perfetto opens.
"""

from freeride._demo.plan import DemoConfig, TaskPlan, demo_devices, plan_tasks

__all__ = ["DemoConfig", "TaskPlan", "demo_devices", "plan_tasks"]
