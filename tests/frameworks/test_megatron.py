"""``freeride.training.megatron`` against Megatron Core's real schedules, one rank at a time, in process.

Megatron's schedule functions run here as they do in training, with a communicator whose exchange is
stubbed (``megatron_sim``): their order, their timers and their handles are Megatron's own; waits take
virtual time, so the bubbles' lengths are exact. The two-rank runs under torchrun are in
``test_megatron_e2e.py``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from framework_support import misplaced_bubbles, one_process_group, require_framework

from freeride.errors import ConfigError
from freeride.training.learned_slots import LEARNED_SLOT_BASE, WAITS_PER_GAP
from freeride.training.megatron import (
    P2P_TIMERS,
    ChainedTimers,
    instrument,
    megatron_orders,
    uninstrument,
)
from freeride.training.schedules import build_schedule

MS = 1_000_000


# ------------------------------------------------------------------ the order, without Megatron


@pytest.mark.parametrize(("ranks", "microbatches", "virtual"), [(2, 4, 2), (2, 8, 3), (3, 6, 2), (4, 8, 2)])
def test_interleaved_order_with_the_default_group_is_the_bubble_models(ranks: int, microbatches: int,
                                                                      virtual: int) -> None:
    model = build_schedule("interleaved-1f1b", ranks, microbatches, virtual=virtual)
    assert {r: tuple(o) for r, o in megatron_orders(ranks, microbatches, virtual).items()} == dict(model.orders)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 4), (4, 9)])
def test_one_f_one_b_order_is_the_bubble_models(ranks: int, microbatches: int) -> None:
    model = build_schedule("1f1b", ranks, microbatches)
    assert {r: tuple(o) for r, o in megatron_orders(ranks, microbatches).items()} == dict(model.orders)


@pytest.mark.parametrize(("ranks", "microbatches", "group", "why"), [
    (2, 4, 1, "<= micro-batches per group"),
    (2, 4, 5, "<= micro-batches per group"),
    (3, 7, 3, "the last group"),
])
def test_megatron_orders_refuses_the_groups_megatron_refuses(ranks: int, microbatches: int, group: int,
                                                             why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        megatron_orders(ranks, microbatches, 2, group)


# ------------------------------------------------------------------ the chained timers, without Megatron


class _Inner:
    """A trainer's timers that log every call and every start/stop, in order, into ``events``."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.events.append(("call", name, args, kwargs))
        events = self.events

        class Timer:
            def start(self, *a: Any, **kw: Any) -> str:
                events.append(("start", name, a, kw))
                return "started"

            def stop(self, *a: Any, **kw: Any) -> str:
                events.append(("stop", name, a, kw))
                return "stopped"

            def elapsed(self) -> float:
                return 1.5

        return Timer()

    def log(self, names: list[str]) -> str:
        return "logged " + ",".join(names)


def test_chained_timers_call_the_trainers_as_before_with_our_marks_innermost() -> None:
    events: list[tuple[Any, ...]] = []
    timers = ChainedTimers(_Inner(events), {"forward-compute": (lambda: events.append(("begin",)),
                                                               lambda: events.append(("end",)))})
    timer = timers("forward-compute", log_level=2)
    assert timer.start(barrier=True) == "started"
    assert timer.stop() == "stopped"
    assert timer.elapsed() == 1.5  # anything else is the trainer's timer
    assert events == [("call", "forward-compute", (), {"log_level": 2}),
                      ("start", "forward-compute", (), {"barrier": True}),
                      ("begin",), ("end",), ("stop", "forward-compute", (), {})]
    other = timers("optimizer", 1)
    assert other.start() == "started"  # an unhooked name is the trainer's own timer
    assert timers.log(["a"]) == "logged a"


def test_chained_timers_without_trainer_timers_time_nothing_else() -> None:
    marks: list[str] = []
    timers = ChainedTimers(None, {name: (lambda: marks.append("b"), lambda: marks.append("e")) for name in P2P_TIMERS})
    timers("forward-recv", log_level=2).start()
    timers("forward-recv").stop()
    timers("interval-time").start(barrier=True)
    timers("interval-time").stop()
    assert marks == ["b", "e"]
    with pytest.raises(AttributeError):
        timers.log(["x"])


# ------------------------------------------------------------------ import and errors


def _instrument_in_a_fresh_process(before: str) -> str:
    """What ``instrument`` raises, as ``type message``, in a fresh interpreter that ran ``before`` first."""
    script = (
        "import sys\n"
        "import freeride.training.megatron as m\n"
        f"{before}\n"
        "try:\n"
        "    m.instrument(lambda **kw: None)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_the_adapter_does_not_import_megatron_and_a_missing_megatron_is_named_in_one_line() -> None:
    said = _instrument_in_a_fresh_process(
        "assert 'megatron' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "sys.modules['megatron'] = None  # as if not installed")
    assert said == ("FrameworkNotInstalled freeride.training.megatron needs Megatron Core: "
                          "pip install 'freeride[megatron]' (on Python 3.11: pip install 'freeride[tasks]' first, "
                          "then add --ignore-requires-python: the release declares 3.12 and runs on 3.11)\n")


def test_a_megatron_without_triton_is_named_with_what_to_do_in_one_line() -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is None:  # CI installs it
        pytest.skip("Megatron Core is not installed")
    said = _instrument_in_a_fresh_process(
        "sys.modules['triton'] = None  # as on a machine without it and without the tests' stand-in")
    assert said.startswith("ConfigError Megatron Core is installed but cannot be imported:")
    assert "pip install triton" in said and said.count("\n") == 1


# ------------------------------------------------------------------ Megatron's real schedules


@pytest.fixture(scope="module")
def sim() -> Iterator[Any]:
    require_framework("megatron")
    import megatron_sim

    with one_process_group():
        yield megatron_sim


SHAPES = [  # ranks, micro-batches, virtual, micro-batches per group
    (2, 1, 1, None), (2, 4, 1, None), (4, 3, 1, None), (4, 6, 1, None),
    (2, 4, 2, None), (2, 5, 2, 3), (2, 6, 3, 4), (3, 6, 2, None), (3, 8, 2, 4), (4, 8, 2, None),
]


@pytest.mark.parametrize(("ranks", "microbatches", "virtual", "group"), SHAPES)
def test_megatron_orders_are_what_megatrons_schedules_run(sim: Any, ranks: int, microbatches: int, virtual: int,
                                                          group: int | None) -> None:
    want = megatron_orders(ranks, microbatches, virtual, group)
    for rank in range(ranks):
        simulated = sim.Rank(ranks, rank, microbatches, virtual, group)
        simulated.step(sim.schedule_function(virtual))
        assert simulated.state.order == [(a.kind, a.stage, a.microbatch) for a in want[rank]], f"rank {rank}"


def test_instrument_refuses_a_function_that_is_not_megatrons(sim: Any) -> None:
    def forward_backward(**kwargs: Any) -> None: ...

    with pytest.raises(ConfigError, match="forward-backward functions"):
        instrument(forward_backward)


class _Recorder:
    """A bubble sink that keeps what it was told."""

    def __init__(self) -> None:
        self.starts: list[tuple[int, int, str, int, int | None]] = []
        self.ends: list[tuple[int, int, int | None]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.starts.append((iteration, slot, kind, predicted_ns, start_ns))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.ends.append((iteration, slot, end_ns))

    def lengths(self, iteration: int) -> dict[int, int]:
        started = {slot: at for it, slot, _, _, at in self.starts if it == iteration}
        return {slot: at - started[slot] for it, slot, at in self.ends if it == iteration}  # type: ignore[operator]


def _trainer_calls(sim: Any, instrumented: bool, virtual: int) -> list[tuple[Any, ...]]:
    events: list[tuple[Any, ...]] = []
    rank = sim.Rank(2, 0, 4, virtual, timers=_Inner(events))
    function = sim.schedule_function(virtual)
    runner = instrument(function, _Recorder(), clock=sim.virtual_clock(rank.state.time)) if instrumented else function
    rank.step(runner)
    assert rank.config.timers.events is events  # the trainer's own object, not a wrapper, after the call
    return events


@pytest.mark.parametrize("virtual", [1, 2])
def test_the_trainers_timers_see_the_same_calls_with_freeride(sim: Any, virtual: int) -> None:
    bare = _trainer_calls(sim, False, virtual)
    assert any(e[1] == "forward-compute" for e in bare)
    assert _trainer_calls(sim, True, virtual) == bare


@pytest.mark.parametrize(("ranks", "rank", "virtual"), [(2, 0, 1), (2, 1, 1), (3, 1, 1), (2, 0, 2), (2, 1, 2)])
def test_waits_are_reported_at_their_positions_with_their_lengths(sim: Any, ranks: int, rank: int,
                                                                  virtual: int) -> None:
    # (3, 1, 1): a middle rank of 1F1B sends, then receives, in one gap of its warm-up and cool-down.
    simulated = sim.Rank(ranks, rank, 4, virtual)
    sink = _Recorder()
    function = instrument(sim.schedule_function(virtual), sink, clock=sim.virtual_clock(simulated.state.time),
                          report_min_ns=0)
    simulated.step(function)  # where this rank receives, in Megatron's schedule
    receives = sorted(set(simulated.state.received_at))
    assert receives
    for iteration in range(1, 4):
        waits = {position: (position + 1) * MS for position in receives}
        simulated.step(function, waits)
        # A send-only gap is a wait too (gloo's sends wait for the receiver): here it takes no time.
        assert {slot: ns for slot, ns in sink.lengths(iteration).items() if ns} == waits
    assert function.tracker.unplanned_wait_ns == 0  # sends at positions with nothing to receive, if any
    assert simulated.config.timers is None  # as the trainer left it


class _VirtualTimers:
    """A trainer's timers in virtual time, recording each interval Megatron times as ``(name, start, stop)``;
    each start and each stop costs the trainer ``cost_ns`` of its own work, outside our marks (innermost)."""

    def __init__(self, time: Any, cost_ns: int = 10_000) -> None:
        self.time, self.cost_ns = time, cost_ns
        self.intervals: list[tuple[str, int, int]] = []
        self._started: dict[str, int] = {}

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        owner = self

        class Timer:
            def start(self, *a: Any, **kw: Any) -> None:
                owner.time.advance(owner.cost_ns)
                owner._started[name] = owner.time.now_ns

            def stop(self, *a: Any, **kw: Any) -> None:
                owner.intervals.append((name, owner._started.pop(name), owner.time.now_ns))
                owner.time.advance(owner.cost_ns)

        return Timer()


def test_a_send_with_no_receive_after_it_in_its_gap_is_a_wait_that_ends_with_the_send(sim: Any) -> None:
    # 1F1B, rank 0 of 2: after its warm-up forward it sends the activation, and its next forward needs nothing
    # from another rank. In a CI run that send took over 0.5 ms three iterations running and became a learned
    # slot, whose bubble went on past the send, through the trainer's own work, to the next forward: inside
    # none of Megatron's waits (test_megatron_e2e). A send's wait goes on only into a receive of its gap.
    state = sim.RankState()
    timers = _VirtualTimers(state.time)
    rank = sim.Rank(2, 0, 4, timers=timers, state=state)
    sink = _Recorder()
    function = instrument(sim.schedule_function(1), sink, clock=sim.virtual_clock(state.time), report_min_ns=0)
    rank.step(function)
    receives = sorted(set(state.received_at))
    assert 1 not in receives  # the warm-up forward's send is alone in its gap
    learned = LEARNED_SLOT_BASE + 1 * WAITS_PER_GAP  # the first wait before the second action
    for iteration in range(1, 8):
        timers.intervals = []
        rank.step(function, {k: 2 * MS for k in receives}, send_waits={1: MS})
        starts = {slot: at for it, slot, _, _, at in sink.starts if it == iteration}
        bubbles = [{"slot": slot, "start_ns": starts[slot], "end_ns": at} for it, slot, at in sink.ends
                   if it == iteration]
        assert not misplaced_bubbles(bubbles, timers.intervals), iteration
        assert {b["slot"] for b in bubbles} >= set(receives)
    assert sink.lengths(7).get(learned) == MS  # learned, and reported as the send's wait: nothing after it


def test_config_timers_are_restored_when_the_schedule_raises(sim: Any) -> None:
    events: list[tuple[Any, ...]] = []
    inner = _Inner(events)
    rank = sim.Rank(2, 0, 4, timers=inner)
    function = instrument(sim.schedule_function(1), _Recorder(), clock=sim.virtual_clock(rank.state.time))

    def failing_step(iterator: Any, model: Any) -> Any:
        if model.forwards == 2:
            raise RuntimeError("data loader broke")
        return model(sim.torch.ones(2, 1, sim.HIDDEN)), lambda out: (out.sum(), {})

    with pytest.raises(RuntimeError, match="data loader broke"):
        rank.step(function, forward_step=failing_step)
    assert rank.config.timers is inner
    assert function.tracker.iteration == 1  # the broken iteration was closed
    rank.step(function)  # and the next one runs, instrumented
    assert function.tracker.iteration == 2


def test_overlapped_transfers_warn_once_and_their_gaps_are_the_waits(sim: Any, caplog: pytest.LogCaptureFixture
                                                                     ) -> None:
    rank = sim.Rank(2, 0, 4, 2, overlap=True)
    sink = _Recorder()
    function = instrument(sim.schedule_function(2), sink, clock=sim.virtual_clock(rank.state.time), report_min_ns=0)
    with caplog.at_level(logging.WARNING, logger="freeride.training.megatron"):
        rank.step(function)
        receives = sorted(set(rank.state.received_at))
        waits = {position: (position + 1) * MS for position in receives}
        rank.step(function, waits)
    assert [r.getMessage() for r in caplog.records if "overlap_p2p_comm" in r.getMessage()] != []
    assert len([r for r in caplog.records if "overlap_p2p_comm" in r.getMessage()]) == 1
    # Megatron waits on a handle in the gap before the action that needs it: that gap is the bubble.
    lengths = sink.lengths(1)
    for position, wait in waits.items():
        assert lengths.get(position) == wait, (position, lengths)


def test_forward_only_calls_run_bare_with_one_warning(sim: Any, caplog: pytest.LogCaptureFixture) -> None:
    rank = sim.Rank(2, 0, 4)
    sink = _Recorder()
    function = instrument(sim.schedule_function(1), sink, clock=sim.virtual_clock(rank.state.time))
    with caplog.at_level(logging.WARNING, logger="freeride.training.megatron"):
        rank.step(function, forward_only=True)
        rank.step(function, forward_only=True)
    assert function.tracker is None and not sink.starts
    assert len([r for r in caplog.records if "forward-only" in r.getMessage()]) == 1


def test_instrumenting_a_wrapper_again_says_so_and_uninstrumenting_a_bare_function_gives_it_back(
        sim: Any) -> None:
    """As the DeepSpeed and torchtitan adapters do (a user's trial got Megatron's list of schedule functions for
    the first, and an AttributeError for the second)."""
    function = instrument(sim.schedule_function(1), _Recorder())
    with pytest.raises(ConfigError, match="instrumented already"):
        instrument(function, _Recorder())
    bare = sim.schedule_function(1)
    assert uninstrument(bare) is bare


def test_uninstrument_delivers_and_later_calls_run_bare(sim: Any) -> None:
    rank = sim.Rank(2, 1, 4)
    sink = _Recorder()
    function = instrument(sim.schedule_function(1), sink, clock=sim.virtual_clock(rank.state.time), report_min_ns=0)
    rank.step(function)
    rank.step(function, {0: 2 * MS})
    assert sink.lengths(1)[0] == 2 * MS
    assert uninstrument(function) is sim.schedule_function(1)
    reported = len(sink.starts)
    rank.step(function, {0: 2 * MS})
    assert len(sink.starts) == reported and function.tracker.iteration == 2
    assert rank.config.timers is None


def test_the_sink_and_device_are_checked_at_instrument_and_a_wrong_object_is_named_in_one_line(sim: Any) -> None:
    # Stranger trial: instrument(fn, "cpu:0") returned a wrapper and the first training call raised; a model passed
    # for the function printed its whole repr (a GPTModel's runs to hundreds of lines).
    with pytest.raises(ConfigError, match="the argument after the schedule is the sink"):
        instrument(sim.schedule_function(1), "cpu:0")
    with pytest.raises(ConfigError, match="unknown device 'gpu:0'"):
        instrument(sim.schedule_function(1), None, device="gpu:0")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"got a Sequential$") as info:
        instrument(model)
    assert "\n" not in str(info.value)


def test_a_job_that_alternates_its_micro_batch_count_keeps_what_each_shape_learned(sim: Any) -> None:
    # Stranger trial: num_microbatches 8, 6, 8, 6, ... made a new tracker every call, and the slots' predictions
    # stayed the model's defaults (1-2 ms) against real waits of 0.5-17 ms.
    class Sink(_Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.layouts: list[int] = []

        def report_layout(self, schedule: str, stages: int, microbatches: int, **kwargs: Any) -> None:
            self.layouts.append(microbatches)

    rank = sim.Rank(2, 1, 4)
    sink = Sink()
    function = instrument(sim.schedule_function(1), sink, clock=sim.virtual_clock(rank.state.time), report_min_ns=0)
    for call in range(12):
        rank.microbatches = 4 if call % 2 == 0 else 6
        rank.step(function, {0: 3 * MS})
    assert function.tracker.iteration == 6  # the 6-micro-batch shape's tracker ran its 6 calls, not 1
    last = {slot: predicted for it, slot, _, predicted, _ in sink.starts if it == function.tracker.iteration - 1}
    assert last[0] == 3 * MS  # learned from the shape's own waits
    assert sink.layouts == [4, 6] * 6  # each switch says the layout the next bubbles belong to
    trackers = {id(function.tracker)}
    rank.microbatches = 4
    rank.step(function, {0: 3 * MS})
    trackers.add(id(function.tracker))
    assert len(trackers) == 2
