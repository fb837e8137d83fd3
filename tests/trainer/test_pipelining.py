"""InstrumentedSchedule on fake stages: where torch waits, slot mapping, sink calls, restore, changed internals."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from freeride.errors import ConfigError
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



class Schedule1F1B:  # named like torch's: the instrumentation models it as 1f1b
    def __init__(self, stage: FakeStage, n_microbatches: int, order: list[str] | None = None) -> None:
        self._stage = stage
        self._n_microbatches = n_microbatches
        model = build_schedule("1f1b", stage.num_stages, n_microbatches)
        self.order = order or [a.label() for a in model.orders[stage.stage_index]]

    def _maybe_compute_loss(self, stage: FakeStage, output: Any, target_mbs: Any, mb_index: int) -> None:
        self._stage.calls.append(f"loss{mb_index}")

    def eval(self, *args: Any, **kwargs: Any) -> None:  # as torch's: step, forward only
        self.evaluating = True
        try:
            self.step(*args, **kwargs)
        finally:
            self.evaluating = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        for label in self.order:  # as torch's: each forward is followed by its loss (a no-op but last)
            mb = int(label[1:])
            if label[0] == "F":
                self._stage.forward_one_chunk(mb, (), {})
                self._maybe_compute_loss(self._stage, None, None, mb)
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

    # Not a schedule at all (a model or a stage passed by mistake): said so, not blamed on torch's internals.
    with pytest.raises(ConfigError, match="InstrumentedSchedule takes a torch.distributed.pipelining schedule "
                                          r"\(ScheduleGPipe, .*\), got NoStage"):
        InstrumentedSchedule(NoStage())
    with pytest.raises(ConfigError, match="got Linear"):
        InstrumentedSchedule(torch.nn.Linear(2, 2))
    # Stranger trial: a string or None (an optimizer's step() return, a name) raised "TypeError: vars() argument
    # must have __dict__ attribute"; an InstrumentedSchedule wrapped again blamed torch's internals.
    for wrong, named in (("1f1b", "str"), (None, "NoneType")):
        with pytest.raises(ConfigError, match=f"takes a torch.distributed.pipelining schedule .*, got {named}$"):
            InstrumentedSchedule(wrong)
    inst = InstrumentedSchedule(Schedule1F1B(FakeStage(0, 2), 2))
    with pytest.raises(ConfigError, match="this Schedule1F1B is instrumented already \\(it is an InstrumentedSchedule"):
        InstrumentedSchedule(inst)
    inst.close()


def test_a_wrong_sink_or_device_is_refused_at_construction_not_at_the_first_bubble() -> None:
    # Stranger trial: InstrumentedSchedule(schedule, "cpu:0") was accepted; the first bubble raised
    # AttributeError ('str' object has no attribute 'bubble_start') and the peer rank died in gloo.
    def wrap(*args: Any, **kwargs: Any) -> InstrumentedSchedule:
        return InstrumentedSchedule(Schedule1F1B(FakeStage(1, 2), 2), *args, **kwargs)

    with pytest.raises(ConfigError, match=r"sink must be a BubbleReporter.*got str 'cpu:0' \(the argument after the "
                                          r"schedule is the sink: pass the device as device=\.\.\.\)"):
        wrap("cpu:0")
    with pytest.raises(ConfigError, match="device must be a device name such as 'cpu:0'"):
        wrap(None, device=0)
    with pytest.raises(ConfigError, match="unknown device 'gpu:0'"):
        wrap(None, device="gpu:0")
    if not torch.cuda.is_available():  # timed on the host clock, a GPU rank's marks would read launches
        with pytest.raises(ConfigError, match="device cuda:0: torch sees no CUDA device here"):
            wrap(None, device="cuda:0")

    class Reporter:
        device = "cpu:0"

        def bubble_start(self, *args: Any, **kwargs: Any) -> None: ...

        def bubble_end(self, *args: Any, **kwargs: Any) -> None: ...

    with pytest.raises(ConfigError, match="the reporter reports bubbles of cpu:0, and this rank's device is cpu:1"):
        wrap(Reporter(), device="cpu:1")
    # A torch.device is taken by its name (it raised AttributeError: no 'startswith').
    assert wrap(Reporter(), device=torch.device("cpu", 0)).tracker.plan.rank == 1
    assert wrap(None, device=torch.device("cpu")).tracker.plan.rank == 1


def test_a_schedule_wrapped_twice_is_refused_until_the_first_wrapper_is_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Stranger trial: a second InstrumentedSchedule on the same schedule trained on, and each manager rejected
    # every other event ("12 rejected") with no word in the trainer.
    schedule = Schedule1F1B(FakeStage(1, 2), 2)
    first = InstrumentedSchedule(schedule)
    with pytest.raises(ConfigError, match="model stage 1 is instrumented already, by another InstrumentedSchedule: "
                                          r"close\(\) that one first"):
        InstrumentedSchedule(schedule)
    first.close()
    with caplog.at_level(logging.WARNING, logger="freeride.training.instrument"):
        first.step()
        first.step()
    said = [r.getMessage() for r in caplog.records if "after close()" in r.getMessage()]
    assert len(said) == 1 and "no longer measured or reported" in said[0]  # once, not per step
    second = InstrumentedSchedule(schedule)  # once closed, the stages are free again
    second.step()
    assert second.tracker.iteration == 1
    second.close()


def test_the_schedules_own_step_is_measured_while_the_wrapper_is_attached() -> None:
    # Stranger trial: a trainer calling schedule.step() with the wrapper attached had 15 of 30 iterations
    # unreported (the stages' marks fell outside any iteration).
    schedule = Schedule1F1B(FakeStage(1, 2), 4)
    sink = RecordingSink()
    inst = InstrumentedSchedule(schedule, sink=sink, report_min_ns=0)  # the stand-in's waits are all short
    for _ in range(3):
        schedule.step()
    inst.step()
    inst.flush()
    assert inst.tracker.iteration == 4
    assert {e[1] for e in sink.events if e[0] == "start"} == {0, 1, 2, 3}  # every iteration's bubbles
    schedule.eval()  # validation: through step, and not measured
    assert inst.tracker.iteration == 4 and inst.attached and "eval" in vars(schedule)
    # Stranger trial: a trainer holding the wrapper in the schedule's place failed at eval (AttributeError).
    inst.eval()
    assert inst.tracker.iteration == 4 and inst.attached and schedule.evaluating is False
    assert inst._n_microbatches == 4 and inst._stage is schedule._stage  # the schedule's attributes, read through
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        _ = inst.nonesuch
    inst.close()
    assert "step" not in vars(schedule) and "eval" not in vars(schedule)  # the class's own again
    schedule.step()
    assert inst.tracker.iteration == 4


def test_predictions_learn_the_measured_lengths() -> None:
    stage = FakeStage(0, 2)
    inst = InstrumentedSchedule(Schedule1F1B(stage, 4), sink=None)
    for _ in range(12):
        inst.step()
    first_backward = [a.kind for a in inst.tracker.plan.order].index("B")
    assert inst.predictor.measurements(0, first_backward) >= 12 - (inst.tracker.learn_every - 1)
    inst.flush()
    err = inst.predictor.prediction_error()
    assert err.count > 0
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


# ---------------------------------------------------------------- torch's runtime schedules


class TimedStage:
    """A stand-in PipelineStage on the test's clock: every compute action takes 1 ms."""

    def __init__(self, index: int, stages: int, ranks: int, rank: int, clock: list[int]) -> None:
        import torch

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.clock = clock

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.clock[0] += 1_000_000

    def backward_one_chunk(self, mb: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self.clock[0] += 1_000_000

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self.clock[0] += 1_000_000


class RuntimeStep:
    """Torch's real runtime schedule object, its ``step`` replaced by ``_step_microbatches``'s walk over
    ``pipeline_order_with_comms`` (from torch 2.13's source): RECV_* posts (0.1 ms), a forward or backward
    pops its receive and waits (``waits_ms`` of (kind, stage, mb)), the last stage's loss follows its
    forward (0.2 ms)."""

    def __init__(self, real: Any, clock: list[int], waits_ms: dict[tuple[str, int, int], float],
                 sends_ms: float = 0.0) -> None:
        self.real, self.clock, self.waits_ms, self.sends_ms = real, clock, waits_ms, sends_ms
        self.stages = {s.stage_index: s for s in real._stages}

    def step(self) -> None:
        real = self.real
        posted = False
        for action in real.pipeline_order_with_comms[real.rank]:
            for a in action.sub_actions or (action,):
                kind, key = a.computation_type.value, (a.stage_index, a.microbatch_index)
                stage = self.stages.get(a.stage_index)
                if kind in ("RECV_F", "RECV_B", "SEND_F", "SEND_B"):
                    self.clock[0] += 100_000
                    posted = posted or kind.startswith("SEND")
                    if kind == "RECV_F":
                        real.fwd_recv_ops[key] = ["work"]
                    elif kind == "RECV_B":
                        real.bwd_recv_ops[key] = ["work"]
                elif kind in ("F", "B", "I"):
                    ops = real.fwd_recv_ops if kind == "F" else real.bwd_recv_ops
                    if key in ops:
                        ops.pop(key)
                        self.clock[0] += int(self.waits_ms.get((kind, *key), 0.0) * 1e6)
                    if kind == "F":
                        stage.forward_one_chunk(a.microbatch_index)
                        real._maybe_compute_loss(stage, None, None, a.microbatch_index)
                    else:
                        stage.backward_one_chunk(a.microbatch_index, None, kind == "B")
                elif kind == "W":
                    stage.backward_weight_one_chunk(a.microbatch_index)
        if posted:  # ``while send_ops: _wait_batch_p2p(send_ops.pop())``: the peer takes the last sends late
            self.clock[0] += int(self.sends_ms * 1e6)


class StepClock:
    """The host clock's shape on the test's time."""

    synchronous = True

    def __init__(self, consumer: Any, clock: list[int]) -> None:
        self.consumer, self.clock = consumer, clock

    def mark(self, payload: Any) -> None:
        self.consumer(payload, self.clock[0])

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.mark.parametrize("name", ["ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_a_runtime_schedules_waits_are_reported_from_the_end_of_the_action_before_them(name: str) -> None:
    from torch.distributed.pipelining import schedules as torch_schedules

    clock = [10**12]
    rank, ranks = 0, 2
    held = [0, 2] if name == "ScheduleInterleaved1F1B" else [0, 3]
    real = getattr(torch_schedules, name)([TimedStage(s, 4, ranks, rank, clock) for s in held], 4)
    real._maybe_compute_loss = lambda *args: clock.__setitem__(0, clock[0] + 200_000)
    waits = {("F", held[1], mb): 3.0 for mb in range(4)}  # the peer's activations arrive 3 ms late
    runner = RuntimeStep(real, clock, waits)
    real.step = runner.step
    sink = RecordingSink()
    inst = InstrumentedSchedule(real, sink=sink, clock=lambda consumer: StepClock(consumer, clock))
    plan = inst.tracker.plan
    inst.step()
    starts = {e[2]: e[6] for e in sink.events if e[0] == "start"}
    ends = {e[2]: e[3] for e in sink.events if e[0] == "end"}
    actions = inst.last_actions
    assert set(starts) <= set(plan.positions) and set(starts) == set(ends)
    for k, start in starts.items():
        # From the end of the action before the wait (or its loss, on the last stage) to the next start.
        before = actions[k - 1]
        loss_ns = 200_000 if before.kind == "F" and before.stage == 3 else 0
        assert start == before.end_ns + loss_ns
        assert ends[k] == (actions[k].start_ns if k < len(actions) else ends[k])
    waited = {k for k, a in enumerate(plan.order) if (a.kind, a.stage, a.microbatch) in waits}
    lengths = {b.slot: b.length_ns for b in inst.last_bubbles}
    assert waited <= set(lengths)  # the late activations' waits (plus the posting before them)
    assert all(3_000_000 <= lengths[k] < 4_000_000 for k in waited)
    assert all(lengths[k] < 1_000_000 for k in set(lengths) - waited)
    inst.close()  # torch's own dicts and methods are back
    assert type(real.fwd_recv_ops) is dict and type(real.bwd_recv_ops) is dict
    assert "forward_one_chunk" not in vars(real._stages[0]) and "step" in vars(real)


def test_a_runtime_ranks_wait_for_its_sends_after_a_last_action_that_sends_nothing_is_reported() -> None:
    # Stranger trial: interleaved zero-bubble's rank 1 ends I3, SEND_B3, W2, W3; torch then waits for its posted
    # sends, up to 11 ms a step, and no bubble covered that wait (88% of the rank's waits were reported).
    from torch.distributed.pipelining import schedules as torch_schedules

    clock = [10**12]
    rank, ranks = 1, 2
    real = torch_schedules.ScheduleInterleavedZeroBubble([TimedStage(s, 4, ranks, rank, clock) for s in (1, 3)], 4)
    real._maybe_compute_loss = lambda *args: None
    real.step = RuntimeStep(real, clock, {}, sends_ms=5.0).step
    sink = RecordingSink()
    inst = InstrumentedSchedule(real, sink=sink, clock=lambda consumer: StepClock(consumer, clock))
    tail = len(inst.tracker.plan.order)
    assert inst.tracker.plan.order[-1].kind == "W" and tail in inst.tracker.plan.positions
    for _ in range(5):
        inst.step()
    lengths = {b.slot: b.length_ns for b in inst.last_bubbles}
    assert lengths[tail] == 5_000_000  # from the last W's end to the step's return
    assert any(e[0] == "start" and e[2] == tail for e in sink.events)
    inst.close()


def test_on_the_host_clock_a_runtime_position_that_only_posts_goes_quiet_and_the_waited_ones_stay() -> None:
    from torch.distributed.pipelining import schedules as torch_schedules

    clock = [10**12]
    held = [0, 2]
    real = torch_schedules.ScheduleInterleaved1F1B([TimedStage(s, 4, 2, 0, clock) for s in held], 4)
    real._maybe_compute_loss = lambda *args: None
    waits = {("F", 2, mb): 3.0 for mb in range(4)}  # the peer's activations arrive 3 ms late; the rest is there
    runner = RuntimeStep(real, clock, waits)
    real.step = runner.step
    sink = RecordingSink()
    inst = InstrumentedSchedule(real, sink=sink, clock=lambda consumer: StepClock(consumer, clock))
    inst.tracker.learn_every = 1  # each iteration learned as it ends: quiet after exactly 16
    assert inst.watches_receives and type(real.fwd_recv_ops) is not dict
    order = inst.tracker.plan.order
    waited = {k for k, a in enumerate(order) if (a.kind, a.stage, a.microbatch) in waits}
    inst.step()
    first = {b.slot: b for b in inst.last_bubbles}
    posting_only = {k for k, b in first.items() if b.waited_ns == 0 and b.length_ns >= inst.tracker.report_min_ns}
    assert posting_only  # gaps of >= 0.2 ms of posting in which the rank never waited: reported at first
    assert all(first[k].waited_ns == 3_000_000 for k in waited)
    for _ in range(16):
        inst.step()
    last = {e[2] for e in sink.events if e[0] == "start" and e[1] == inst.iteration - 1}
    assert waited <= last and not posting_only & last
    real.fwd_recv_ops[(2, 0)] = ["posted before detaching"]
    inst.close()
    assert type(real.fwd_recv_ops) is dict and real.fwd_recv_ops == {(2, 0): ["posted before detaching"]}


class P2PStage(TimedStage):
    """A stand-in stage for torch's own single-stage ``_step_microbatches``: its transfer ops are names that the
    test's ``_batch_p2p`` posts (0.2 ms each batch) and whose works wait ``waits_ms`` (by receive)."""

    def _ops(self, kind: str, mb: int, needed: bool) -> list[tuple[str, int]]:
        return [(kind, mb)] if needed else []

    def get_fwd_recv_ops(self, mb: int) -> list[tuple[str, int]]:
        return self._ops("recv_F", mb, not self.is_first)

    def get_bwd_recv_ops(self, mb: int) -> list[tuple[str, int]]:
        return self._ops("recv_B", mb, not self.is_last)

    def get_fwd_send_ops(self, mb: int) -> list[tuple[str, int]]:
        return self._ops("send_F", mb, not self.is_last)

    def get_bwd_send_ops(self, mb: int) -> list[tuple[str, int]]:
        return self._ops("send_B", mb, not self.is_first)

    def perform_reduce_grad(self, *args: Any) -> None:
        pass


class FakeWork:
    def __init__(self, clock: list[int], wait_ns: int) -> None:
        self.clock, self.wait_ns = clock, wait_ns

    def wait(self) -> None:
        self.clock[0] += self.wait_ns
        self.wait_ns = 0


def single_stage(name: str, rank: int, clock: list[int], m: int = 4) -> Any:
    """Torch's real ``ScheduleGPipe`` / ``Schedule1F1B`` on a :class:`P2PStage` of two: its own
    ``_step_microbatches`` runs, with the input handling and losses stubbed on the instance."""
    from torch.distributed.pipelining import schedules as torch_schedules

    real = getattr(torch_schedules, name)(P2PStage(rank, 2, 2, rank, clock), m)
    real._check_inputs = lambda *args: ([()] * m, [{}] * m)
    real._initialize_stage = lambda *args: None
    real._maybe_compute_loss = lambda *args: None
    real._maybe_get_loss = lambda *args: None
    real._update_losses = lambda *args: None
    real.step = lambda: real._step_microbatches()
    return real


@pytest.fixture
def posted_p2p(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """torch's ``_batch_p2p`` / ``_sorted_batch_p2p`` replaced: posting takes 0.2 ms, a receive named in
    ``waits_ms`` waits that long."""
    from torch.distributed.pipelining import schedules as torch_schedules

    state: dict[str, Any] = {"clock": [10**12], "waits_ms": {}}

    def batch(ops: list[tuple[str, int]], desc: str | None = None) -> list[FakeWork]:
        if not ops:
            return []
        state["clock"][0] += 200_000
        return [FakeWork(state["clock"], int(state["waits_ms"].get(op, 0.0) * 1e6)) for op in ops]

    # Torch's own wait function and no schedule attached (another test's unclosed one keeps the watch installed).
    from freeride.training.instrument import _WaitWatch, _watched_wait_batch_p2p

    if torch_schedules._wait_batch_p2p is _watched_wait_batch_p2p:
        monkeypatch.setattr(torch_schedules, "_wait_batch_p2p", _WaitWatch._own)
    monkeypatch.setattr(_WaitWatch, "_users", 0)
    monkeypatch.setattr(torch_schedules, "_batch_p2p", batch)
    monkeypatch.setattr(torch_schedules, "_sorted_batch_p2p",
                        lambda ops, desc=None: {1: batch(ops, desc)} if ops else {})
    return state


@pytest.mark.parametrize("name", ["ScheduleGPipe", "Schedule1F1B"])
def test_on_the_host_clock_a_single_stage_schedules_bubbles_start_where_torch_waits_after_posting(
        name: str, posted_p2p: dict[str, Any]) -> None:
    # Bench (1F1B, two CPU ranks): the last rank's gaps between a backward and the next forward were 0.2 ms of
    # gloo posting and no wait, reported from the backward's end; the manager each woke took the core from the
    # rank's posting, and the gap so stretched stayed reported. Torch's own loop runs here.
    from torch.distributed.pipelining import schedules as torch_schedules

    own = torch_schedules._wait_batch_p2p
    clock = posted_p2p["clock"]
    posted_p2p["waits_ms"] = {("recv_F", mb): 3.0 for mb in (1, 3)}  # two late activations; the rest are there
    real = single_stage(name, 1, clock)
    sink = RecordingSink()
    inst = InstrumentedSchedule(real, sink=sink, clock=lambda consumer: StepClock(consumer, clock))
    inst.tracker.learn_every = 1
    assert inst.watches_waits and torch_schedules._wait_batch_p2p is not own
    order = inst.tracker.plan.order
    late = {k for k, a in enumerate(order) if a.kind == "F" and a.microbatch in (1, 3)}
    for _ in range(20):
        inst.step()
    starts = {e[2]: e[6] for e in sink.events if e[0] == "start" and e[1] == inst.iteration - 1}
    ends = {e[2]: e[3] for e in sink.events if e[0] == "end" and e[1] == inst.iteration - 1}
    assert set(starts) == late  # the posting-only gaps went quiet
    for k in late:  # each reported from its wait's start (after the 0.2 ms of posting) to the data
        assert ends[k] - starts[k] == 3_000_000
    lengths = {b.slot: b.length_ns for b in inst.last_bubbles}
    assert all(lengths[k] == 3_000_000 for k in late)
    inst.close()
    assert torch_schedules._wait_batch_p2p is own


def test_the_wait_watch_marks_only_the_thread_in_an_instrumented_step_and_leaves_at_the_last_close(
        posted_p2p: dict[str, Any]) -> None:
    from torch.distributed.pipelining import schedules as torch_schedules

    own = torch_schedules._wait_batch_p2p
    clock = posted_p2p["clock"]
    first = InstrumentedSchedule(single_stage("Schedule1F1B", 1, clock), sink=RecordingSink(),
                                 clock=lambda consumer: StepClock(consumer, clock))
    second = InstrumentedSchedule(single_stage("Schedule1F1B", 0, clock), sink=RecordingSink(),
                                  clock=lambda consumer: StepClock(consumer, clock))
    marks: list[str] = []
    first.tracker.wait_blocks = lambda: marks.append("first")  # noqa: B023 - read at the next attach
    first.detach()
    first.attach()
    work = FakeWork(clock, 0)
    torch_schedules._wait_batch_p2p([work])  # outside any step: passes through, marks nothing
    assert marks == []
    first.step()
    assert marks and set(marks) == {"first"}
    first.close()
    assert torch_schedules._wait_batch_p2p is not own  # the second schedule is still attached
    second.close()
    assert torch_schedules._wait_batch_p2p is own
    on_gpu = InstrumentedSchedule(single_stage("Schedule1F1B", 1, clock), sink=RecordingSink(),
                                  clock=DeferredDeviceClock)
    assert not on_gpu.watches_waits and torch_schedules._wait_batch_p2p is own
    on_gpu.close()
