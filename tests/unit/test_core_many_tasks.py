"""The core with hundreds of queued tasks: same decisions, and its state index stays true.

The core keeps its tasks indexed by state and skips an admission pass that cannot admit anything
(``core/tasks.py``, ``core/memory.py``), so that bubble events stay cheap with a long queue. These tests
check that neither shortcut changes a decision: admission still happens the moment memory or a new
task allows it, and the index agrees with every task's state through a random lifecycle.
"""

from __future__ import annotations

import random

from freeride._manager.core import (
    Action,
    BubbleEnded,
    BubbleStarted,
    CancelRequested,
    CoreConfig,
    DeviceMemorySampled,
    DrainRequested,
    Event,
    Grant,
    SchedulerCore,
    Spawn,
    TaskAdded,
    Tick,
    WorkerExited,
    WorkerFinished,
    WorkerParked,
    WorkerReady,
)
from freeride.messages import BubbleEnd, BubbleStart, TaskSpec
from freeride.states import TaskState

MS = 1_000_000
MiB = 2**20
T0 = 1_000_000 * MS


class Driver:
    """A core, a fake clock and a task counter: just enough to script scenarios."""

    def __init__(self) -> None:
        self.core = SchedulerCore(CoreConfig(headroom_bytes=0))
        self.now = T0
        self.seq = 0
        self.iteration = 0

    def send(self, event: Event) -> list[Action]:
        return self.core.on_event(event, self.now)

    def add(self, task_id: str, mem_mib: int, priority: int = 0) -> list[Action]:
        self.seq += 1
        spec = TaskSpec(target="m:C", name=task_id, memory_bytes=mem_mib * MiB, priority=priority)
        return self.send(TaskAdded(task_id, spec, self.seq))

    def free(self, mib: int, samples: int = 1) -> list[Action]:
        out: list[Action] = []
        for _ in range(samples):
            out += self.send(DeviceMemorySampled(mib * MiB))
        return out

    def bubble(self, length_ms: float = 10.0) -> list[Action]:
        it = self.iteration
        self.iteration += 1
        start = self.now
        out = self.send(BubbleStarted(BubbleStart(0, 0, it, 0, "test", start, int(length_ms * MS)), start))
        self.now += int(length_ms * MS)
        out += self.send(BubbleEnded(BubbleEnd(0, 0, it, 0, self.now), self.now))
        return out


def spawned(actions: list[Action]) -> list[str]:
    return [a.task_id for a in actions if isinstance(a, Spawn)]


def test_a_queue_that_fitted_nowhere_is_admitted_as_soon_as_the_budget_grows() -> None:
    d = Driver()
    d.free(500)
    d.add("big", 600)
    d.add("bigger", 700)
    assert spawned(d.bubble()) == []  # passes that admit nothing are skipped from now on
    assert spawned(d.free(500)) == []
    # The budget is the minimum of the recent samples: it grows once the window holds only 650s.
    actions = d.free(650, samples=8)
    assert spawned(actions) == ["big"]


def test_a_small_task_joining_a_blocked_queue_is_admitted_at_the_same_budget() -> None:
    d = Driver()
    d.free(500)
    d.add("big", 600)
    d.bubble()
    assert spawned(d.add("small", 100)) == ["small"]
    assert d.core.tasks["big"].state == TaskState.SUBMITTED


def test_an_evicted_task_back_in_the_queue_is_admitted_when_memory_returns() -> None:
    d = Driver()
    d.free(1000)
    d.add("a", 600)
    d.send(WorkerReady("a", 1))
    d.free(300, samples=1)  # the budget shrinks below a's cap: a is stopped for eviction
    d.send(WorkerExited("a", 0, 0))
    assert d.core.tasks["a"].state == TaskState.SUBMITTED
    assert spawned(d.free(300)) == []
    assert spawned(d.free(1000, samples=8)) == ["a"]


def test_three_hundred_queued_tasks_change_no_grant_of_the_resident_one() -> None:
    def grants(queued: int) -> list[tuple[str, int]]:
        d = Driver()
        d.free(1000)
        d.add("runner", 100)
        d.send(WorkerReady("runner", 1))
        for k in range(queued):
            d.add(f"q{k}", 10_000, priority=k % 3)
        out = []
        for _ in range(50):
            for action in d.bubble():
                if isinstance(action, Grant):
                    out.append((action.task_id, action.deadline_ns - T0))
                    d.send(WorkerParked(action.task_id, action.grant_id, 1, (MS,), d.now, d.now, d.now, "park",
                                        0.0, 1))
        return out

    assert grants(300) == grants(0)
    assert len(grants(0)) == 50


def test_state_index_agrees_with_every_task_state_through_random_lifecycles() -> None:
    rng = random.Random(7)
    d = Driver()
    d.free(2000)

    def check() -> None:
        for state, tasks in d.core._tasks.by_state.items():
            assert {t.task_id for t in tasks.values()} == {
                t.task_id for t in d.core.tasks.values() if t.state == state
            }
        # What skipping admission passes must not break: no waiting task fits the budget left.
        budget = d.core.budget_bytes()
        if budget is not None and not d.core.draining:
            waiting = [t for t in d.core.tasks.values() if t.state == TaskState.SUBMITTED]
            assert all(t.memory_bytes > budget for t in waiting)

    def pick(*states: TaskState) -> str:
        ids = [t.task_id for t in d.core.tasks.values() if t.state in states]
        return rng.choice(ids) if ids else ""

    for step in range(3000):
        roll = rng.random()
        if roll < 0.15 or not d.core.tasks:
            d.add(f"t{step}", rng.choice([100, 300, 900, 5000]), priority=rng.randint(0, 2))
        elif roll < 0.3 and (tid := pick(TaskState.STARTING)):
            d.send(WorkerReady(tid, 1000 + step))
        elif roll < 0.5:
            for action in d.bubble(rng.choice([1, 5, 20])):
                if isinstance(action, Grant) and rng.random() < 0.8:
                    d.send(WorkerParked(action.task_id, action.grant_id, 1, (MS,), d.now, d.now, d.now, "park",
                                        0.0, 1))
        elif roll < 0.55 and (tid := rng.choice([t.task_id for t in d.core.tasks.values() if t.stopping] or [""])):
            d.send(WorkerExited(tid, 0, 0))  # a stop obeyed: evicted or drained tasks go back to the queue
        elif roll < 0.6 and (tid := pick(TaskState.STARTING, TaskState.PARKED, TaskState.RUNNING,
                                          TaskState.FROZEN, TaskState.CANCELLED, TaskState.FAILED)):
            d.send(WorkerExited(tid, rng.choice([0, 1, None]), rng.choice([0, 9])))
        elif roll < 0.65 and (tid := pick(TaskState.PARKED, TaskState.RUNNING)):
            d.send(WorkerFinished(tid, 1, 1.0))
        elif roll < 0.7 and (tid := pick(*TaskState)):
            d.send(CancelRequested(tid))
        elif roll < 0.85:
            d.free(rng.choice([200, 1000, 2000, 4000]))
        elif roll < 0.86 and step > 2500 and not d.core.draining:
            d.send(DrainRequested())
        else:
            d.now += rng.choice([1, 10, 20_000]) * MS
            d.send(Tick())
        check()
