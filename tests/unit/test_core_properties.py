"""The core under random well-formed event sequences (hypothesis stateful testing), under both policies.

Each rule sends one kind of event, with fields drawn freely within their form: ids of tasks that exist,
existed or never did, stale grant ids, bubble ends for other bubbles, starts older than the open one,
exits of tasks that have no process. Whatever the order, the core must not raise, and after every event:

* every task is in exactly one state, its state index agrees, and no terminal state is ever left;
* the StateChanged actions alone reconstruct every task's state;
* at most one task holds a bubble; a holder is RUNNING, and a RUNNING task not being stopped holds one;
* no task gets two grants in one bubble, and nothing is granted in a bubble whose end is known (the
  trainer's end, a start that closed it, a layout change) or whose deadline has passed;
* memory is never over budget at admission: an event that spawns leaves the budget at zero or more, and
  after a memory figure the budget is back at zero or more, or every parked task is on its way out;
* nothing is spawned or granted once a drain was asked for;
* a task with no process is not being stopped; the next timer is never in the past;
* under the reference policy, nothing is ever frozen and grants carry no margin and no trainer's end.
"""

from __future__ import annotations

from core_sim import assert_consistent
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from freeride._manager.core import (
    Action,
    BubbleEnded,
    BubbleStarted,
    CancelRequested,
    CoreConfig,
    DeviceMemorySampled,
    DeviceStatusChanged,
    DrainRequested,
    Event,
    Freeze,
    Grant,
    LayoutChanged,
    Released,
    ReleaseRequested,
    SchedulerCore,
    Spawn,
    StateChanged,
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
from freeride._manager.core.bubbles import OpenBubble
from freeride.messages import BubbleEnd, BubbleStart, FailureRecord, TaskSpec, TrainerLayout
from freeride.states import TaskState

MS = 1_000_000
MiB = 2**20
T0 = 1_000_000 * MS
IDS = st.sampled_from([f"t{k}" for k in range(6)])  # the tasks added: a small pool, so duplicates come naturally
#: For events that end or disturb a task: half of these ids were never added (so that tasks live long enough to
#: reach grants, and events for unknown tasks come naturally).
ANY_IDS = st.sampled_from([f"t{k}" for k in range(12)])
LAYOUT_DEVICES = ("n1/cpu:0", "n1/cpu:1")


class CoreMachine(RuleBasedStateMachine):
    policy = "freeride"

    def __init__(self) -> None:
        super().__init__()
        self.core = SchedulerCore(CoreConfig(
            headroom_bytes=0, grace_ns=MS, margin_ns=MS // 5, max_margin_ns=5 * MS, stop_timeout_ns=40 * MS,
            step_timeout_ns=300 * MS, reprobe_after_bubbles=4, memory_window_iterations=3, policy=self.policy,
            poll_interval_ns=2 * MS,
        ))
        self.now = T0
        self.seq = 0
        self.iteration = 0
        self.replayed: dict[str, TaskState] = {}
        self.ended: set[tuple[tuple[int, int, int, int], int]] = set()  # (key, start_ns) of bubbles known over
        self.granted_in: dict[int, tuple[OpenBubble, set[str]]] = {}  # id(bubble) -> (bubble, tasks granted)
        self.drain_asked = False
        self.events = 0

    @initialize(tasks=st.lists(st.tuples(st.sampled_from([100, 300]), st.integers(0, 1),
                                         st.sampled_from([0.0, 1.0, 50.0])), min_size=1, max_size=3),
                ready=st.booleans())
    def a_device_with_tasks(self, tasks: list[tuple[int, int, float]], ready: bool) -> None:
        """Most sequences start from resident tasks, so that they reach grants early."""
        self.free(2000)
        for k, (mib, priority, hint_ms) in enumerate(tasks):
            self.add(f"t{k}", mib, priority, hint_ms, False)
            if ready:
                self.ready(f"t{k}")

    # ------------------------------------------------------------------ sending

    def send(self, event: Event) -> list[Action]:
        self.events += 1
        before_open = self.core.bubbles.open
        actions = self.core.on_event(event, self.now)
        # A bubble that was open and is no longer (its end, a later start, a layout change) is over; unless
        # the start was sent again, which opens it anew (see bubble_start).
        now_open = self.core.bubbles.open
        if before_open is not None and now_open is not before_open:
            identity = (before_open.event.key, before_open.event.start_ns)
            if now_open is None or (now_open.event.key, now_open.event.start_ns) != identity:
                self.ended.add(identity)
        self.check_actions(event, actions)
        return actions

    def check_actions(self, event: Event, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, StateChanged):
                assert self.replayed.get(action.task_id) == action.old, action
                assert action.old is None or not action.old.is_terminal, f"left a terminal state: {action}"
                self.replayed[action.task_id] = action.new
            elif isinstance(action, Grant):
                assert not self.drain_asked, "granted while draining"
                assert not self.core.sharing_ranks, f"granted on a device that ranks share: {action}"
                assert (action.bubble_key, action.bubble_start_ns) not in self.ended, f"granted after the end: {action}"
                assert action.deadline_ns > self.now, f"granted with no time left: {action}"
                bubble = self.core.bubbles.open
                assert bubble is not None and bubble.event.start_ns == action.bubble_start_ns
                _, tasks = self.granted_in.setdefault(id(bubble), (bubble, set()))
                assert action.task_id not in tasks, f"{action.task_id} granted twice in one bubble"
                tasks.add(action.task_id)
                if self.policy == "paper":
                    assert action.margin_ns == 0 and not action.trainer_ends
            elif isinstance(action, Spawn):
                assert not self.drain_asked, "spawned while draining"
            elif isinstance(action, Released):
                self.replayed.pop(action.task_id)  # the core forgets it: the id may come back
            elif isinstance(action, Freeze):
                assert self.policy != "paper", "the reference policy never freezes"
        if any(isinstance(a, Spawn) for a in actions):
            budget = self.core.budget_bytes()
            assert budget is not None and budget >= 0, f"admitted over budget: {budget}"
        if isinstance(event, DeviceMemorySampled):
            budget = self.core.budget_bytes()
            assert budget is not None
            leaving = sum(t.memory_bytes for t in self.core._tasks.resident() if t.stopping)
            parked = [t for t in self.core._tasks.in_states(TaskState.PARKED) if not t.stopping]
            assert budget + leaving >= 0 or not parked, "over budget with a parked task left to evict"

    def task_of(self, task_id: str) -> tuple[int, int]:
        task = self.core.tasks.get(task_id)
        return (task.grant_id, task.steps) if task is not None else (0, 0)

    # ------------------------------------------------------------------ the clock, the user, the device

    @rule(ms=st.sampled_from([0.1, 0.5, 1, 2, 5, 20, 100]))
    def tick(self, ms: float) -> None:
        self.now += int(ms * MS)
        self.send(Tick())

    @rule(task_id=IDS, mib=st.sampled_from([50, 100, 300, 900]), priority=st.integers(0, 2),
          hint_ms=st.sampled_from([0.0, 0.0, 1.0, 50.0]), from_queue=st.booleans())
    def add(self, task_id: str, mib: int, priority: int, hint_ms: float, from_queue: bool) -> None:
        self.seq += 1
        spec = TaskSpec(target="m:C", name=task_id, memory_bytes=mib * MiB, priority=priority,
                        step_time_hint_ms=hint_ms)
        self.send(TaskAdded(task_id, spec, self.seq, from_queue=from_queue))

    @rule(task_id=ANY_IDS)
    def cancel(self, task_id: str) -> None:
        self.send(CancelRequested(task_id))

    @rule(task_id=ANY_IDS, checkpoint=st.booleans())
    def release(self, task_id: str, checkpoint: bool) -> None:
        self.send(ReleaseRequested(task_id, "test", checkpoint))

    @precondition(lambda self: not self.drain_asked and self.events > 30)  # a drain ends the sequence's interest
    @rule()
    def drain(self) -> None:
        self.drain_asked = True
        self.send(DrainRequested())

    @rule(mib=st.sampled_from([0, 200, 500, 1000, 2000]))
    def free(self, mib: int) -> None:
        self.send(DeviceMemorySampled(mib * MiB))

    @rule(task_id=ANY_IDS, mib=st.sampled_from([10, 200, 1000]))
    def task_memory(self, task_id: str, mib: int) -> None:
        self.send(TaskMemorySampled(task_id, mib * MiB))

    @rule(problem=st.sampled_from(["", "", "NVML: GPU is lost"]))
    def device_status(self, problem: str) -> None:
        self.send(DeviceStatusChanged(problem))

    @rule(microbatches=st.sampled_from([2, 4]), free_mib=st.sampled_from([-1, 300, 2000]), hosts=st.booleans())
    def layout(self, microbatches: int, free_mib: int, hosts: bool) -> None:
        free = -1 if free_mib < 0 else free_mib * MiB
        layout = TrainerLayout("1f1b", 2, microbatches, LAYOUT_DEVICES, self.now, free)
        self.send(LayoutChanged(layout, self.now, hosts))

    # ------------------------------------------------------------------ the trainer

    @rule(predicted_ms=st.sampled_from([0.5, 3, 10, 40]), lag_ms=st.sampled_from([0, 0, 0.2, 3]),
          free_mib=st.sampled_from([-1, -1, 300, 1000, 2000]), slot=st.integers(0, 2), again=st.booleans())
    def bubble_start(self, predicted_ms: float, lag_ms: float, free_mib: int, slot: int, again: bool) -> None:
        if not again:
            self.iteration += 1
        start = BubbleStart(0, 0, self.iteration, slot, "fwd", self.now - int(lag_ms * MS), int(predicted_ms * MS),
                            -1 if free_mib < 0 else free_mib * MiB)
        # A start sent again is a new bubble to the core, even after that bubble's end: it keeps no record of
        # ended bubbles (the trainer's stream is ordered; only a faulty trainer repeats a start).
        self.ended.discard((start.key, start.start_ns))
        self.send(BubbleStarted(start, self.now))

    @rule(predicted_ms=st.sampled_from([3, 10, 40]), free_mib=st.sampled_from([-1, 1000, 2000]),
          park_after_ms=st.sampled_from([None, 0.5, 2, 8]), steps=st.integers(0, 2), saw_end=st.booleans(),
          end_after_ms=st.sampled_from([None, 1, 5, 12, 50]))
    def a_bubble_walk(self, predicted_ms: float, free_mib: int, park_after_ms: float | None, steps: int,
                      saw_end: bool, end_after_ms: float | None) -> None:
        """A bubble as a trainer and a worker make it: a start, its holder maybe parking early, maybe an end."""
        self.bubble_start(predicted_ms, 0, free_mib, 0, False)
        if park_after_ms is not None and self.holder():
            self.now += int(park_after_ms * MS)
            self.parked(self.holder(), steps, 0.3, False, "deadline", saw_end, 0)
        if end_after_ms is not None:
            self.now += int(end_after_ms * MS)
            self.bubble_end(True, 0)

    @rule(rank=st.sampled_from([1, 2]), predicted_ms=st.sampled_from([1, 10]), ends=st.booleans())
    def another_rank_waits(self, rank: int, predicted_ms: float, ends: bool) -> None:
        """A second trainer rank reports to the device (ranks that share it): the core follows one of them."""
        start = BubbleStart(0, rank, self.iteration, 0, "fwd", self.now, int(predicted_ms * MS), -1)
        self.ended.discard((start.key, start.start_ns))  # a start sent again is a new bubble (bubble_start)
        self.send(BubbleStarted(start, self.now))
        if ends:
            self.send(BubbleEnded(BubbleEnd(0, rank, start.iteration, 0, self.now), self.now))

    @rule(own=st.booleans(), lag_ms=st.sampled_from([0, 0, 0.5, 5]))
    def bubble_end(self, own: bool, lag_ms: float) -> None:
        bubble = self.core.bubbles.open
        if own and bubble is not None:
            start = bubble.event
            end = BubbleEnd(start.stage, start.rank, start.iteration, start.slot, self.now - int(lag_ms * MS))
        else:
            end = BubbleEnd(0, 0, self.iteration + 7, 0, self.now)
        self.send(BubbleEnded(end, self.now))

    # ------------------------------------------------------------------ the workers

    @rule(task_id=IDS)
    def ready(self, task_id: str) -> None:
        self.send(WorkerReady(task_id, 4242, context_bytes=MiB))

    @rule(task_id=ANY_IDS, steps=st.integers(0, 3), step_ms=st.sampled_from([0.3, 2, 30]), stale=st.booleans(),
          reason=st.sampled_from(["deadline", "park", "ended", "stop"]), saw_end=st.booleans(),
          device_mib=st.sampled_from([0, 0, 80, 5000]))
    def parked(self, task_id: str, steps: int, step_ms: float, stale: bool, reason: str, saw_end: bool,
               device_mib: int) -> None:
        grant_id, done = self.task_of(task_id)
        durations = tuple(int(step_ms * MS) for _ in range(steps))
        seen = self.now - MS // 10 if saw_end else 0
        bubble = self.core.bubbles.open
        task = self.core.tasks.get(task_id)
        if (self.policy == "freeride" and bubble is not None and bubble.running == task_id and task is not None
                and task.state == TaskState.RUNNING and not stale and not device_mib and seen
                and bubble.event.start_ns <= seen and not bubble.end_ns):
            # Its holder parks having seen the end on the trainer's board: the bubble is known to be over.
            self.ended.add((bubble.event.key, bubble.event.start_ns))
        self.send(WorkerParked(task_id, grant_id - 1 if stale else grant_id, steps, durations,
                               self.now - sum(durations) if steps else 0, self.now, self.now, reason, 0.5,
                               done + steps, seen_end_ns=seen))
        if device_mib:
            self.send(WorkerUsage(task_id, device_mib * MiB))

    # The rules above send events for any id, mostly stale or out of place; these follow a worker's own
    # protocol, so that the sequences reach deep states (grants, backfills, freezes, thaws) often.

    def holder(self) -> str:
        bubble = self.core.bubbles.closing or self.core.bubbles.open
        return bubble.running if bubble is not None else ""

    @precondition(lambda self: self.core.count_in(TaskState.STARTING) > 0)
    @rule(data=st.data())
    def a_starting_worker_is_ready(self, data: st.DataObject) -> None:
        starting = sorted(t.task_id for t in self.core._tasks.in_states(TaskState.STARTING))
        self.ready(data.draw(st.sampled_from(starting)))

    @precondition(lambda self: bool(self.holder()))
    @rule(steps=st.integers(0, 3), step_ms=st.sampled_from([0.3, 2, 30]), saw_end=st.booleans(),
          after_ms=st.sampled_from([0, 0.5, 2, 8]))
    def the_holder_parks(self, steps: int, step_ms: float, saw_end: bool, after_ms: float) -> None:
        self.now += int(after_ms * MS)
        self.parked(self.holder(), steps, step_ms, False, "deadline", saw_end, 0)

    @precondition(lambda self: bool(self.holder()))
    @rule(lag_ms=st.sampled_from([0, 0.05, 1]), stale=st.booleans())
    def the_trainer_ends_the_holders_bubble_by_its_wake(self, lag_ms: float, stale: bool) -> None:
        task = self.core.tasks[self.holder()]
        end_ns = self.now
        self.now += int(lag_ms * MS)
        self.send(TrainerEndSeen(task.task_id, task.grant_id - int(stale), end_ns))

    @precondition(lambda self: self.core.count_in(TaskState.FROZEN) > 0)
    @rule(data=st.data(), steps_done=st.integers(0, 2))
    def a_frozen_worker_shows_its_board(self, data: st.DataObject, steps_done: int) -> None:
        frozen = sorted(t.task_id for t in self.core._tasks.in_states(TaskState.FROZEN))
        self.steps_seen(data.draw(st.sampled_from(frozen)), steps_done, steps_done == 0)

    @precondition(lambda self: any(t.stopping for t in self.core._tasks.resident()))
    @rule(data=st.data())
    def a_stopped_worker_exits(self, data: st.DataObject) -> None:
        stopping = sorted(t.task_id for t in self.core._tasks.resident() if t.stopping)
        self.exited(data.draw(st.sampled_from(stopping)), 0, 0)

    @rule(task_id=ANY_IDS, steps_done=st.integers(0, 3), in_setup=st.booleans())
    def steps_seen(self, task_id: str, steps_done: int, in_setup: bool) -> None:
        self.send(WorkerStepsSeen(task_id, steps_done, in_setup))

    @rule(task_id=IDS)
    def checkpointed(self, task_id: str) -> None:
        self.send(WorkerCheckpointed(task_id, 3, f"/ck/{task_id}", 0.5))

    @rule(task_id=ANY_IDS)
    def finished(self, task_id: str) -> None:
        self.send(WorkerFinished(task_id, 10, 1.0))

    @rule(task_id=ANY_IDS, kind=st.sampled_from(["EXCEPTION", "MEMORY_LIMIT"]))
    def failed(self, task_id: str, kind: str) -> None:
        self.send(WorkerFailed(task_id, FailureRecord(kind=kind, message="boom"), (MS,), 0.5, 3))

    @rule(task_id=ANY_IDS, code=st.sampled_from([0, 1, None]), sig=st.sampled_from([0, 0, 9]))
    def exited(self, task_id: str, code: int | None, sig: int) -> None:
        self.send(WorkerExited(task_id, code, sig, "tail", -1))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def the_core_is_consistent(self) -> None:
        assert_consistent(self.core, self.now)
        replayed = {task_id: state for task_id, state in self.replayed.items() if task_id in self.core.tasks}
        assert replayed == {task_id: task.state for task_id, task in self.core.tasks.items()}


class ReferenceCoreMachine(CoreMachine):
    policy = "paper"


_SETTINGS = settings(max_examples=100, stateful_step_count=50)
TestCoreUnderRandomEvents = CoreMachine.TestCase
TestCoreUnderRandomEvents.settings = _SETTINGS
TestReferenceCoreUnderRandomEvents = ReferenceCoreMachine.TestCase
TestReferenceCoreUnderRandomEvents.settings = _SETTINGS
