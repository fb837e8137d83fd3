"""``bench.gpu.bubble_timing``'s cost figures on CPU: the GPU run's cost is taken as a trainer runs the
instrumentation (profiling iterations apart, then attached and detached alternating), on a CPU stand-in,
as a share of the bare iteration; a device-clock mark is taken apart call by call on the simulated GPU."""

from __future__ import annotations

import math
from typing import Any

from gpu_fakes import FakeTorchCuda

from bench.gpu.bubble_timing import cost_share, host_cost, mark_costs
from freeride.training.schedules import build_schedule


class _Stage:
    def __init__(self) -> None:
        self.stage_index, self.num_stages = 1, 4
        self.calls = 0

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        self.calls += 1

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        self.calls += 1

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        self.calls += 1


class Schedule1F1B:  # the name InstrumentedSchedule models a single-stage schedule by
    def __init__(self, stage: _Stage, n_microbatches: int) -> None:
        self._stage, self._n_microbatches = stage, n_microbatches
        self.order = build_schedule("1f1b", stage.num_stages, n_microbatches).orders[stage.stage_index]

    def step(self, *args: Any, **kwargs: Any) -> None:
        for action in self.order:
            if action.kind == "F":
                self._stage.forward_one_chunk(action.microbatch)
            else:
                self._stage.backward_one_chunk(action.microbatch)


def test_host_cost_keeps_the_profiling_iterations_apart_and_alternates_attached_with_bare() -> None:
    stage = _Stage()
    schedule = Schedule1F1B(stage, 4)
    syncs: list[int] = []
    host = host_cost(schedule, 6, lambda: syncs.append(1), device="cpu:0", remodel_iterations=2)
    assert [len(host[k]) for k in ("profiling", "attached", "detached", "iteration")] == [3, 3, 3, 3]
    assert host["marks"] == []  # the host clock keeps no count of marks
    assert len(syncs) == 9  # one wait for the device after every iteration
    assert stage.calls == 9 * len(schedule.order)
    assert all(ms > 0 for key, series in host.items() for ms in series)
    # a bare iteration's time runs from its launch to the device's end: the step and the wait after it
    assert all(it >= step for it, step in zip(host["iteration"], host["detached"], strict=True))
    # closed: the stage's own methods are back, so the schedule runs bare afterwards
    assert "forward_one_chunk" not in vars(stage)


def test_the_cost_is_a_share_of_the_bare_iteration_and_nan_without_samples() -> None:
    assert cost_share([0.5, 0.6, 0.7], [100.0, 120.0, 140.0]) == 0.6 / 120.0
    assert math.isnan(cost_share([], [100.0])) and math.isnan(cost_share([0.5], []))


def test_a_mark_is_taken_apart_call_by_call_and_every_mark_it_makes_is_delivered() -> None:
    gpu = FakeTorchCuda()
    seen: list[int] = []
    parts = mark_costs(gpu, calls=50, blocks=3, also={"an extra call": lambda: seen.append(1)})
    assert list(parts) == ["capture check", "current stream", "event record", "whole mark, resolver running",
                           "an extra call"]
    assert all(us > 0 for us in parts.values())
    assert len(seen) == 150  # each named call ran calls x blocks times
