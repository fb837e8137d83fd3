"""A scheduler core driven with plain events and an explicit fake clock (integer ns): the core's tests' helper.

Every core test builds a :class:`Sim` (a core plus a clock and a bubble counter), feeds it events and
checks the actions it returns and the task states it keeps. No I/O, no sleeps, no real time.
"""

from __future__ import annotations

from collections.abc import Iterable

from freeride._manager.core import (
    Action,
    BubbleEnded,
    BubbleStarted,
    CoreConfig,
    DeviceMemorySampled,
    Event,
    Freeze,
    Grant,
    SchedulerCore,
    StateChanged,
    TaskAdded,
    Tick,
    WorkerExited,
    WorkerParked,
    WorkerReady,
    WorkerStepsSeen,
)
from freeride._manager.core.machines import StopPhase
from freeride.messages import UNKNOWN_MEMORY, BubbleEnd, BubbleStart, TaskSpec
from freeride.states import TaskState

MS = 1_000_000
MiB = 2**20
T0 = 1_000_000 * MS  # an arbitrary monotonic "now" at which every test starts

S = TaskState


class Sim:
    """A scheduler core with a fake clock and helpers that build well-formed events."""

    def __init__(self, **config: int) -> None:
        config.setdefault("headroom_bytes", 0)
        self.core = SchedulerCore(CoreConfig(**config))
        self.now = T0
        self.seq = 0
        self.iteration = 0
        self.open: BubbleStart | None = None
        self.open_job = ""  # the job of the last bubble started
        self.actions: list[Action] = []
        #: What each worker's board shows when it is frozen (steps done, in setup, in a checkpoint): the
        #: loop answers every Freeze with its board read (``WorkerStepsSeen``); a worker not named here has
        #: no board (nothing read).
        self.boards: dict[str, tuple[int, bool, bool]] = {}
        #: Each worker's main thread's run delay (ns) as read at a freeze; a worker not named here: not read.
        self.run_delays: dict[str, int] = {}
        #: Workers whose freezes say they had no core in the grant frozen (``WorkerStepsSeen.starved``).
        self.starved: set[str] = set()
        #: Workers whose freezes say they slept through the grant frozen (``WorkerStepsSeen.asleep``).
        self.asleep: set[str] = set()

    # -- clock and raw events

    def at(self, now_ns: int) -> Sim:
        assert now_ns >= self.now, "the fake clock never goes back"
        self.now = now_ns
        return self

    def advance_ms(self, ms: float) -> Sim:
        return self.at(self.now + int(ms * MS))

    def send(self, event: Event) -> list[Action]:
        """Feed ``event``; the actions it gives, then those of the board reads that answer its freezes."""
        actions = self.core.on_event(event, self.now)
        self.actions.extend(actions)
        for action in [a for a in actions if isinstance(a, Freeze)]:
            done, in_setup, in_checkpoint = self.boards.get(action.task_id, (-1, False, False))
            actions = actions + self.send(WorkerStepsSeen(action.task_id, done, in_setup, in_checkpoint,
                                                          self.run_delays.get(action.task_id, -1),
                                                          starved=action.task_id in self.starved,
                                                          asleep=action.task_id in self.asleep))
        return actions

    def tick(self) -> list[Action]:
        return self.send(Tick())

    # -- tasks

    def add(self, task_id: str, mem_mib: int = 100, priority: int = 0, hint_ms: float = 0.0) -> list[Action]:
        self.seq += 1
        spec = TaskSpec(
            target="m:C", name=task_id, memory_bytes=mem_mib * MiB, priority=priority, step_time_hint_ms=hint_ms
        )
        return self.send(TaskAdded(task_id=task_id, spec=spec, seq=self.seq))

    def free(self, free_mib: int) -> list[Action]:
        return self.send(DeviceMemorySampled(free_bytes=free_mib * MiB))

    def ready(self, task_id: str) -> list[Action]:
        return self.send(WorkerReady(task_id=task_id, pid=1000 + len(self.core.tasks)))

    def resident(self, *task_ids: str, mem_mib: int = 100, priority: int = 0) -> None:
        """Add tasks, give the device room for all of them, and bring each one to PARKED."""
        for task_id in task_ids:
            self.add(task_id, mem_mib=mem_mib, priority=priority)
        if self.core.budget_bytes() is None:
            self.free(100_000)
        for task_id in task_ids:
            assert self.state(task_id) == S.STARTING
            self.ready(task_id)
            assert self.state(task_id) == S.PARKED

    def parked(
        self,
        task_id: str,
        durations_ms: Iterable[float] = (),
        reason: str = "deadline",
        grant_id: int | None = None,
        last_end_ns: int | None = None,
        seen_end_ns: int = 0,
    ) -> list[Action]:
        task = self.core.tasks[task_id]
        durations = tuple(int(d * MS) for d in durations_ms)
        return self.send(
            WorkerParked(
                task_id=task_id,
                grant_id=task.grant_id if grant_id is None else grant_id,
                steps=len(durations),
                durations_ns=durations,
                first_step_ns=task.granted_at_ns + 1000 if durations else 0,
                last_end_ns=self.now if last_end_ns is None else last_end_ns,
                parked_ns=self.now,
                reason=reason,
                progress=0.0,
                total_steps=task.steps + len(durations),
                seen_end_ns=seen_end_ns,
            )
        )

    def exited(self, task_id: str, exit_code: int | None = 0, sig: int = 0, log_tail: str = "") -> list[Action]:
        return self.send(WorkerExited(task_id=task_id, exit_code=exit_code, signal=sig, log_tail=log_tail))

    def state(self, task_id: str) -> TaskState:
        return self.core.tasks[task_id].state

    # -- bubbles

    def start(
        self,
        predicted_ms: float,
        free_mib: int | None = None,
        iteration: int | None = None,
        slot: int = 0,
        rank: int = 0,
        job: str = "",
    ) -> list[Action]:
        if iteration is None:
            self.iteration += 1
            iteration = self.iteration
        self.open = BubbleStart(
            stage=0,
            rank=rank,
            iteration=iteration,
            slot=slot,
            kind="fwd",
            start_ns=self.now,
            predicted_ns=int(predicted_ms * MS),
            free_memory_bytes=UNKNOWN_MEMORY if free_mib is None else free_mib * MiB,
        )
        self.open_job = job
        return self.send(BubbleStarted(bubble=self.open, received_ns=self.now, job=job))

    def end(self, bubble: BubbleStart | None = None, end_ns: int | None = None, job: str | None = None) -> list[Action]:
        """The end of ``bubble`` (the last started), of ``job`` (the last started's)."""
        b = bubble or self.open
        assert b is not None
        end = BubbleEnd(
            stage=b.stage,
            rank=b.rank,
            iteration=b.iteration,
            slot=b.slot,
            end_ns=self.now if end_ns is None else end_ns,
        )
        return self.send(BubbleEnded(bubble=end, received_ns=self.now, job=self.open_job if job is None else job))

    def learn(self, task_id: str, step_ms: float, samples: int = 3) -> None:
        """Give a parked task a known step time by granting it a probe bubble that it fills."""
        for other in self.core.tasks.values():
            assert other.state != S.RUNNING
        self.start(predicted_ms=step_ms * samples * 4 + 10)
        assert self.state(task_id) == S.RUNNING, "learn() needs the task to be the only grantable one"
        self.advance_ms(step_ms * samples)
        self.end()  # end first, so that the rest of the bubble goes to nobody else
        self.parked(task_id, [step_ms] * samples, reason="park")
        assert self.state(task_id) == S.PARKED


def paper_sim(profile_ms: float | None = None) -> Sim:
    config: dict = {"policy": "paper"}
    if profile_ms is not None:
        config["paper_profile_ns"] = {(0, 0): int(profile_ms * MS)}
    sim = Sim(**config)
    sim.resident("a")
    return sim


def assert_consistent(core: SchedulerCore, now_ns: int) -> None:
    """What holds of the core after any event, whatever came before (see ``test_core_properties.py``)."""
    indexed: dict[str, TaskState] = {}
    for state, tasks in core._tasks.by_state.items():
        for task_id, task in tasks.items():
            assert task_id not in indexed, f"{task_id} indexed under {indexed[task_id]} and {state}"
            assert task.state == state, f"{task_id} indexed under {state} is {task.state}"
            indexed[task_id] = state
    assert indexed == {task_id: task.state for task_id, task in core.tasks.items()}, "the state index is off"
    bubbles = [b for b in (core.bubbles.open, core.bubbles.closing) if b is not None]
    holders = [b.running for b in bubbles if b.running]
    assert len(holders) <= 1, f"several tasks hold bubbles: {holders}"
    for task_id in holders:
        assert core.tasks[task_id].state == TaskState.RUNNING, f"{task_id} holds a bubble but is not running"
    for task in core.tasks.values():
        if task.state == TaskState.RUNNING:
            assert task.stopping or task.task_id in holders, f"{task.task_id} runs without a bubble"
        if not task.state.is_resident and not task.state.is_terminal:
            assert task.stop is StopPhase.NONE and not task.stopping, f"{task.task_id} has no process to stop"
    timer = core.next_timer_ns()
    assert timer is None or timer > now_ns, f"a timer in the past: {timer} <= {now_ns}"


def of(actions: Iterable[Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def grants(actions: Iterable[Action]) -> list[str]:
    return [a.task_id for a in actions if isinstance(a, Grant)]


def non_state(actions: Iterable[Action]) -> list[Action]:
    return [a for a in actions if not isinstance(a, StateChanged)]
