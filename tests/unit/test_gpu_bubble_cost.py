"""``bench.gpu.bubble_timing.host_cost`` on CPU: the GPU run's cost figure is taken as a trainer runs the
instrumentation (profiling iterations apart, then attached and detached alternating), on a CPU stand-in."""

from __future__ import annotations

from typing import Any

from bench.gpu.bubble_timing import host_cost
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
    assert [len(host[k]) for k in ("profiling", "attached", "detached")] == [3, 3, 3]
    assert len(syncs) == 9  # one wait for the device after every iteration
    assert stage.calls == 9 * len(schedule.order)
    assert all(ms > 0 for series in host.values() for ms in series)
    # closed: the stage's own methods are back, so the schedule runs bare afterwards
    assert "forward_one_chunk" not in vars(stage)
