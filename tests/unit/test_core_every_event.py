"""Every event type in every state the core can be in: it never raises, and stays consistent.

A well-formed event may come at any time: a worker's message after the manager stopped it, a second
drain, an end for a bubble long gone. Each scenario below brings a task "a" (and the device) to one state,
every lifecycle of ``core/machines.py`` included; then each event, sent on a fresh copy, must leave the
core consistent (``core_sim.assert_consistent``) and a task in a terminal state where it was.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import pytest
from core_sim import MS, MiB, S, Sim, assert_consistent

from freeride._manager.core import (
    BubbleEnded,
    BubbleStarted,
    CancelRequested,
    DeviceMemorySampled,
    DeviceStatusChanged,
    DrainRequested,
    Event,
    LayoutChanged,
    ReleaseRequested,
    TaskAdded,
    TaskMemorySampled,
    Tick,
    TrainerEndSeen,
    WorkerCheckpointed,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerParked,
    WorkerReady,
    WorkerStepsSeen,
    WorkerUsage,
)
from freeride._manager.core.machines import BubblePhase, DrainPhase, StepPhase, StopPhase
from freeride.messages import BubbleEnd, BubbleStart, FailureRecord, TaskSpec, TrainerLayout


def _resident(policy: str = "freeride", from_queue: bool = False) -> Sim:
    sim = Sim(grace_ns=MS, step_timeout_ns=10_000 * MS, stop_timeout_ns=100 * MS, policy=policy)
    sim.seq += 1
    spec = TaskSpec(target="m:C", name="a", memory_bytes=100 * MiB)
    sim.send(TaskAdded("a", spec, sim.seq, from_queue=from_queue))
    sim.add("b")
    sim.free(1000)
    sim.ready("a")
    sim.ready("b")
    return sim


def _running(policy: str = "freeride") -> Sim:
    sim = _resident(policy)
    sim.start(predicted_ms=30 if policy == "paper" else 10)
    if policy == "paper":
        sim.tick()
        sim.advance_ms(10)
        sim.tick()
    assert sim.state("a") == S.RUNNING
    return sim


def _closing() -> Sim:
    sim = _running()
    sim.advance_ms(10)
    sim.end()
    assert sim.core.bubbles.closing is not None
    return sim


def _frozen(in_setup: bool = False) -> Sim:
    sim = _running()
    sim.advance_ms(60)
    sim.tick()
    if in_setup:
        sim.send(WorkerStepsSeen("a", 0, in_setup=True))
    assert sim.state("a") == S.FROZEN
    return sim


def _hung() -> Sim:
    sim = _running()
    sim.advance_ms(2)
    sim.parked("a", [1.0], reason="deadline")  # a finished step: from now on its steps may look hung
    sim.advance_ms(1)
    sim.end()
    sim.parked("b", [1.0], reason="park")  # b had the rest of that bubble
    sim.advance_ms(1)
    sim.start(predicted_ms=10)
    sim.advance_ms(60)
    sim.tick()
    sim.advance_ms(1)
    sim.end()
    sim.start(predicted_ms=10)  # its first grant notes that a's step looks hung, and gives b the bubble
    assert sim.state("a") == S.FROZEN and sim.core.tasks["a"].health.phase is StepPhase.HUNG
    return sim


def _seen_ended() -> Sim:
    sim = _running()
    sim.advance_ms(2)
    task = sim.core.tasks["a"]
    sim.send(WorkerParked("a", task.grant_id, 1, (MS,), sim.now - MS, sim.now, sim.now, "ended", 0.1, 1,
                          seen_end_ns=sim.now - 1000))
    assert sim.core.bubbles.open is not None and sim.core.bubbles.open.phase is BubblePhase.SEEN_ENDED
    return sim


def _stopping(why: str) -> Sim:
    sim = _resident(from_queue=why == "release")
    if why == "evict":
        sim.free(0)  # nothing left: both parked tasks are evicted
    elif why == "drain":
        sim.send(DrainRequested())
    elif why == "release":
        sim.send(ReleaseRequested("a", "lost", checkpoint=True))
    assert sim.core.tasks["a"].stop is StopPhase(why), sim.core.tasks["a"].stop
    return sim


def _submitted() -> Sim:
    sim = Sim()
    sim.add("a")
    return sim


def _starting() -> Sim:
    sim = _submitted()
    sim.free(1000)
    assert sim.state("a") == S.STARTING
    return sim


def _terminal(how: str) -> Sim:
    sim = _running()
    if how == "finished":
        sim.send(WorkerFinished("a", 3, 1.0))
    elif how == "failed":
        sim.send(TaskMemorySampled("a", 10_000 * MiB))
    else:
        sim.send(CancelRequested("a"))
    return sim


def _drained() -> Sim:
    sim = _resident()
    sim.send(DrainRequested())
    sim.exited("a")
    sim.exited("b")
    assert sim.core.drain is DrainPhase.DRAINED
    return sim


def _unreadable() -> Sim:
    sim = _submitted()
    sim.send(DeviceStatusChanged("NVML: GPU is lost"))
    sim.free(1000)
    return sim


SCENARIOS: dict[str, Callable[[], Sim]] = {
    "no task": Sim,
    "submitted, no memory figure": _submitted,
    "submitted, device unreadable": _unreadable,
    "starting": _starting,
    "parked": _resident,
    "parked, from the queue": lambda: _resident(from_queue=True),
    "running in the open bubble": _running,
    "running in a closing bubble": _closing,
    "parked in a bubble a worker saw end": _seen_ended,
    "frozen": _frozen,
    "frozen in setup": lambda: _frozen(in_setup=True),
    "frozen in a step that looks hung": _hung,
    "stopping to evict": lambda: _stopping("evict"),
    "stopping to drain": lambda: _stopping("drain"),
    "stopping to release": lambda: _stopping("release"),
    "finished": lambda: _terminal("finished"),
    "failed, its process not gone yet": lambda: _terminal("failed"),
    "cancelled, its process not gone yet": lambda: _terminal("cancelled"),
    "drained": _drained,
    "reference policy, parked": lambda: _resident("paper"),
    "reference policy, running": lambda: _running("paper"),
}


def _open_or_new(sim: Sim) -> BubbleStart:
    bubble = sim.core.bubbles.open
    return bubble.event if bubble is not None else BubbleStart(0, 0, 999, 0, "fwd", sim.now, 5 * MS, -1)


def _grant_of(sim: Sim) -> int:
    task = sim.core.tasks.get("a")
    return task.grant_id if task is not None else 0


LAYOUT = TrainerLayout("1f1b", 2, 4, ("n/cpu:0", "n/cpu:1"), 0, 500 * MiB)
EVENTS: dict[str, Callable[[Sim], Event]] = {
    "a bubble starts": lambda sim: BubbleStarted(BubbleStart(0, 0, 500, 0, "fwd", sim.now, 20 * MS, 800 * MiB),
                                                 sim.now),
    "the same bubble starts again": lambda sim: BubbleStarted(_open_or_new(sim), sim.now),
    "an older bubble starts": lambda sim: BubbleStarted(BubbleStart(0, 0, 1, 0, "fwd", 0, MS, -1), sim.now),
    "the open bubble ends": lambda sim: BubbleEnded(BubbleEnd(*_open_or_new(sim).key, sim.now), sim.now),
    "an unknown bubble ends": lambda sim: BubbleEnded(BubbleEnd(9, 9, 9, 9, sim.now), sim.now),
    "the trainer's end of its grant": lambda sim: TrainerEndSeen("a", sim.core.tasks["a"].grant_id
                                                                 if "a" in sim.core.tasks else 1, sim.now),
    "a submission with its id": lambda sim: TaskAdded("a", TaskSpec(target="m:C", memory_bytes=MiB), 99),
    "a new submission": lambda sim: TaskAdded("new", TaskSpec(target="m:C", memory_bytes=MiB), 99),
    "cancel": lambda sim: CancelRequested("a"),
    "drain": lambda sim: DrainRequested(),
    "release with a checkpoint": lambda sim: ReleaseRequested("a", "lost", True),
    "release without": lambda sim: ReleaseRequested("a", "lost", False),
    "a layout with no stage here": lambda sim: LayoutChanged(LAYOUT, sim.now, hosts_stage=False),
    "ready": lambda sim: WorkerReady("a", 77),
    "its board": lambda sim: WorkerStepsSeen("a", 2),
    "its board, in setup": lambda sim: WorkerStepsSeen("a", 0, in_setup=True),
    "parked": lambda sim: WorkerParked("a", _grant_of(sim), 1, (MS,), sim.now - MS, sim.now, sim.now, "park", 0.5, 9),
    "parked, stale": lambda sim: WorkerParked("a", _grant_of(sim) + 5, 0, (), 0, sim.now, sim.now, "park", 0.5, 9),
    "its own usage": lambda sim: WorkerUsage("a", 100 * MiB),
    "its own usage, over its cap": lambda sim: WorkerUsage("a", 10_000 * MiB),
    "checkpointed": lambda sim: WorkerCheckpointed("a", 4, "/ck", 0.5),
    "finished": lambda sim: WorkerFinished("a", 9, 1.0),
    "failed": lambda sim: WorkerFailed("a", FailureRecord(kind="EXCEPTION", message="x"), (MS,)),
    "exited cleanly": lambda sim: WorkerExited("a", 0, 0),
    "killed": lambda sim: WorkerExited("a", None, 9, "tail", 3),
    "its memory, over its cap": lambda sim: TaskMemorySampled("a", 10_000 * MiB),
    "no free memory": lambda sim: DeviceMemorySampled(0),
    "the device is lost": lambda sim: DeviceStatusChanged("lost"),
    "the device is back": lambda sim: DeviceStatusChanged(""),
    "a tick, much later": lambda sim: Tick(),
}


def test_the_events_sent_cover_every_event_type() -> None:
    sim = Sim()
    assert {type(make(sim)) for make in EVENTS.values()} == set(typing.get_args(Event))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_event_in_this_state_is_handled_without_raising(scenario: str) -> None:
    build = SCENARIOS[scenario]
    assert_consistent(build().core, build().now)
    for name, make in EVENTS.items():
        sim = build()
        if name == "a tick, much later":
            sim.advance_ms(100_000)
        else:
            sim.advance_ms(0.5)
        before = sim.core.tasks.get("a")
        terminal = before.state if before is not None and before.state.is_terminal else None
        try:
            sim.send(make(sim))
        except Exception as exc:  # the message says which event, in which state
            raise AssertionError(f"{name!r} in state {scenario!r} raised {exc!r}") from exc
        assert_consistent(sim.core, sim.now)
        if terminal is not None:
            assert sim.core.tasks["a"].state == terminal, f"{name!r} took a {terminal.value} task out of it"
