"""InstrumentedSchedule on fake stages: slot mapping, sink calls, restore, and changed internals."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from freeride.training.instrument import InstrumentedSchedule, PipeliningInternalsChanged
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


class Schedule1F1B:  # named like torch's: the instrumentation models it as 1f1b
    def __init__(self, stage: FakeStage, n_microbatches: int, order: list[str] | None = None) -> None:
        self._stage = stage
        self._n_microbatches = n_microbatches
        model = build_schedule("1f1b", stage.num_stages, n_microbatches)
        self.order = order or [a.label() for a in model.orders[stage.stage_index]]

    def step(self, *args: Any, **kwargs: Any) -> None:
        for label in self.order:
            mb = int(label[1:])
            if label[0] == "F":
                self._stage.forward_one_chunk(mb, (), {})
            else:
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
def test_every_modelled_slot_is_reported_once_per_iteration(p: int, m: int) -> None:
    model = build_schedule("1f1b", p, m)
    for rank in range(p):
        stage = FakeStage(rank, p)
        sink = RecordingSink()
        inst = InstrumentedSchedule(Schedule1F1B(stage, m), sink=sink, device="cpu:0")
        for _ in range(3):
            inst.step()
        want = [(s.index, s.kind) for s in model.cyclic_slots(rank)]
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
    assert inst.predictor.measurements(0, 0) == 12


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
    assert sink.events == [] and seen == [] and len(clock.pending) == 2 + 2 * 4  # begin, finish, 4 actions
    # The device ran each action for 10 ms and idled between them as the receives dictated.
    ms, t0 = 1_000_000, 10**9
    order = [a.label() for a in build_schedule("1f1b", 2, 2).orders[0]]
    idle_before = {"F0": 4 * ms, "F1": 0, "B0": 7 * ms, "B1": 2 * ms}
    times, marks, t = {}, [t0], t0
    for label in order:
        t += idle_before[label]
        times[label] = (t, t + 10 * ms)
        marks += [t, t + 10 * ms]
        t += 10 * ms
    clock.resolve([*marks, t])
    slots = build_schedule("1f1b", 2, 2).cyclic_slots(0)
    reported = {e[2]: [e[6]] for e in sink.events if e[0] == "start"}
    for e in sink.events:
        if e[0] == "end":
            reported[e[2]].append(e[3])
    for slot in slots:  # each bubble at the device's times: one action's end to the next one's start
        start = t0 if slot.after is None or slot.kind == "boundary" else times[slot.after.label()][1]
        assert reported[slot.index] == [start, times[slot.before.label()][0]], slot
    # Learned on the training thread, at the next step: the predictor and the profile see device time.
    assert seen == []
    inst.step()
    assert [it for it, _ in seen] == [0]
    assert sorted(seen[0][1]) == sorted(reported[s.index][1] - reported[s.index][0] for s in slots)
    assert all(inst.predictor.measurements(0, s.index) == 1 for s in slots)
    assert [a.length_ns for a in inst.last_actions] == [10 * ms] * 4
    inst.close()
    assert clock.closed and "forward_one_chunk" not in vars(stage)
