"""InstrumentedSchedule on fake stages: where torch waits, slot mapping, sink calls, restore, changed internals."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from freeride.training.instrument import InstrumentedSchedule, PipeliningInternalsChanged
from freeride.training.rank_slots import RankPlan
from freeride.training.schedules import build_schedule


class FakeStage:
    def __init__(self, stage_index: int, num_stages: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.calls: list[str] = []

    def forward_one_chunk(self, fwd_chunk_id: int, args: Any = None, kwargs: Any = None) -> None:
        self.calls.append(f"F{fwd_chunk_id}")

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self.calls.append(f"B{bwd_chunk_id}")

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self.calls.append(f"W{bwd_chunk_id}")

    # Like torch's: a receive's ops, empty where there is no neighbour to receive from.
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[str]:
        return [f"recv F{fwd_chunk_id}"] if self.stage_index > 0 else []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[str]:
        return [f"recv B{bwd_chunk_id}"] if self.stage_index < self.num_stages - 1 else []


class Schedule1F1B:  # named like torch's: the instrumentation models it as 1f1b
    def __init__(self, stage: FakeStage, n_microbatches: int, order: list[str] | None = None) -> None:
        self._stage = stage
        self._n_microbatches = n_microbatches
        model = build_schedule("1f1b", stage.num_stages, n_microbatches)
        self.order = order or [a.label() for a in model.orders[stage.stage_index]]

    def step(self, *args: Any, **kwargs: Any) -> None:
        for label in self.order:  # each receive's ops are made, then waited for, then the compute runs
            mb = int(label[1:])
            if label[0] == "F":
                self._stage.get_fwd_recv_ops(mb)
                self._stage.forward_one_chunk(mb, (), {})
            else:
                self._stage.get_bwd_recv_ops(mb)
                self._stage.backward_one_chunk(mb, loss=None, full_backward=True)


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int,
                     free_memory_bytes: int = -1, start_ns: int | None = None, learned: bool = False) -> None:
        self.events.append(("start", iteration, slot, kind, predicted_ns, free_memory_bytes, start_ns))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.events.append(("end", iteration, slot, end_ns))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_every_wait_position_is_reported_once_per_iteration(p: int, m: int) -> None:
    model = build_schedule("1f1b", p, m)
    for rank in range(p):
        stage = FakeStage(rank, p)
        sink = RecordingSink()
        inst = InstrumentedSchedule(Schedule1F1B(stage, m), sink=sink, device="cpu:0")
        for _ in range(3):
            inst.step()
        plan = RankPlan.from_orders(model.orders, rank)
        # Every receive's wait, and the tail where the last backward sends to the previous rank.
        assert plan.positions[-1] == (len(plan.order) if rank > 0 else len(plan.order) - 1)
        want = [(k, plan.kind(k)) for k in plan.positions]
        assert {s.index for s in model.cyclic_slots(rank)} <= set(plan.positions)
        for it in range(3):
            starts = [(e[2], e[3]) for e in sink.events if e[0] == "start" and e[1] == it]
            ends = [e[2] for e in sink.events if e[0] == "end" and e[1] == it]
            assert starts == want and ends == [i for i, _ in want]
        for e in sink.events:
            if e[0] == "start":
                assert e[4] > 0 and e[5] > 0  # a positive prediction and a free-memory sample
        # Starts and ends alternate: a bubble is closed before the next one opens.
        kinds = [e[0] for e in sink.events]
        assert kinds == ["start", "end"] * (len(kinds) // 2)
        assert inst.iteration == 3
        inst.close()
        assert "forward_one_chunk" not in vars(stage)


def test_order_mismatch_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    stage = FakeStage(0, 2)
    inst = InstrumentedSchedule(Schedule1F1B(stage, 2, order=["F1", "F0", "B0", "B1"]), sink=RecordingSink())
    with caplog.at_level(logging.WARNING, logger="freeride.training.instrument"):
        inst.step()
        inst.step()
    assert sum("misattributed" in r.message for r in caplog.records) == 1


def test_unknown_schedule_or_changed_internals_fail_clearly() -> None:
    class ScheduleSomethingNew:
        def __init__(self) -> None:
            self._stage = FakeStage(0, 2)
            self._n_microbatches = 2

    with pytest.raises(PipeliningInternalsChanged, match="no model"):
        InstrumentedSchedule(ScheduleSomethingNew())

    class NoStage:
        pass

    with pytest.raises(PipeliningInternalsChanged, match="_stage"):
        InstrumentedSchedule(NoStage())


def test_predictions_learn_the_measured_lengths() -> None:
    stage = FakeStage(0, 2)
    inst = InstrumentedSchedule(Schedule1F1B(stage, 4), sink=None)
    for _ in range(12):
        inst.step()
    err = inst.predictor.prediction_error()
    assert err.count > 0
    first_backward = [a.kind for a in inst.tracker.plan.order].index("B")
    assert inst.predictor.measurements(0, first_backward) == 12


class DeferredDeviceClock:
    """Stands in for the CUDA event clock: marks wait until the test says when the device reached them."""

    synchronous = False

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.pending: list[Any] = []
        self.closed = False

    def mark(self, payload: Any) -> None:
        self.pending.append(payload)

    def resolve(self, times_ns: list[int]) -> None:
        """Deliver the pending marks at these device times (in host clock), in order."""
        for payload, at in zip(self.pending, times_ns, strict=True):
            self.consumer(payload, at)
        self.pending.clear()

    def flush(self, timeout_s: float = 30.0) -> bool:
        return not self.pending

    def close(self) -> None:
        self.closed = True


def test_on_a_gpu_bubbles_are_reported_at_the_device_times_and_training_never_waits_for_them() -> None:
    stage = FakeStage(0, 2)
    sink = RecordingSink()
    clocks: list[DeferredDeviceClock] = []
    seen: list[tuple[int, list[int]]] = []

    def make_clock(consumer: Any) -> DeferredDeviceClock:
        clocks.append(DeferredDeviceClock(consumer))
        return clocks[-1]

    inst = InstrumentedSchedule(Schedule1F1B(stage, 2), sink=sink, clock=make_clock,
                                on_iteration=lambda it, bubbles: seen.append((it, [b.length_ns for b in bubbles])))
    clock = clocks[0]
    inst.step()  # returns with nothing resolved: the training thread never waited for the device
    # begin, finish, 4 actions, and the waits for the two gradients
    assert sink.events == [] and seen == [] and len(clock.pending) == 2 + 2 * 4 + 2
    # The device ran each action for 10 ms and idled before each backward as the receives dictated.
    ms, t0 = 1_000_000, 10**9
    order = [a.label() for a in build_schedule("1f1b", 2, 2).orders[0]]
    idle_before = {"F0": 0, "F1": 0, "B0": 7 * ms, "B1": 2 * ms}
    times, marks, t = {}, [t0], t0
    for label in order:
        if label[0] == "B":
            marks.append(t)  # the wait's start: where the previous action's work ended
        t += idle_before[label]
        times[label] = (t, t + 10 * ms)
        marks += [t, t + 10 * ms]
        t += 10 * ms
    clock.resolve([*marks, t])
    reported = {e[2]: [e[6]] for e in sink.events if e[0] == "start"}
    for e in sink.events:
        if e[0] == "end":
            reported[e[2]].append(e[3])
    plan = inst.tracker.plan
    assert sorted(reported) == list(plan.positions) == [2, 3]
    for k in plan.positions:  # each bubble at the device's times: one action's end to the next one's start
        assert reported[k] == [times[order[k - 1]][1], times[order[k]][0]]
    # Learned on the training thread, at the next step: the predictor and the profile see device time.
    assert seen == []
    inst.step()
    assert [it for it, _ in seen] == [0]
    assert sorted(seen[0][1]) == [2 * ms, 7 * ms]
    assert all(inst.predictor.measurements(0, k) == 1 for k in plan.positions)
    assert [a.length_ns for a in inst.last_actions] == [10 * ms] * 4
    inst.close()
    assert clock.closed and "forward_one_chunk" not in vars(stage)
