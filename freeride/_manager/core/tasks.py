"""The core's tasks: what it knows of each (:class:`TaskRuntime`) and the table that indexes them by state.

A task's state changes only through :meth:`Tasks.move`, which checks the transition
(:func:`freeride.states.check_transition`), keeps the index true and emits the :class:`StateChanged` the
loop persists. Its stop phase changes only through :meth:`TaskRuntime.stop_for`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from freeride._estimator import StepEstimator
from freeride._manager.core.api import Action, StateChanged, TaskAdded
from freeride._manager.core.machines import STOP, StopPhase
from freeride._manager.core.steps import StepHealth
from freeride.messages import FailureRecord, TaskSpec
from freeride.states import TaskState, check_transition

MS = 1_000_000
RESIDENT_STATES = tuple(state for state in TaskState if state.is_resident)


@dataclass(eq=False)
class TaskRuntime:
    """What the core knows about one task (compared by identity)."""

    task_id: str
    spec: TaskSpec
    seq: int
    state: TaskState = TaskState.SUBMITTED
    memory_bytes: int = 0
    pid: int = 0
    progress_unit: str = "steps"
    estimator: StepEstimator = field(default_factory=StepEstimator)
    margin_ns: int = 0
    #: Its margin before its last freeze widened it, until the freeze's reading says whether the step or its core
    #: overran (``SchedulerCore._on_worker_steps_seen``); None: no widening pending.
    margin_before_freeze_ns: int | None = None
    grant_id: int = 0
    granted_at_ns: int = 0
    grant_bubble: tuple[int, int, int, int] | None = None
    health: StepHealth = field(default_factory=StepHealth)
    #: Its share clock: step time harvested here, raised on joining to the least among the resident
    #: tasks, so that a newcomer does not take every bubble until it has caught up (see ``grants.py``).
    share_ns: int = 0
    probing: bool = False  # the current grant learns the step time (setup, first step, re-probe)
    #: Thawed, it has not reported since: it is still finishing the step a freeze stopped (the worker
    #: reports the frozen grant's steps when that step is done), not one its current grant admitted.
    finishing_frozen_step: bool = False
    #: (grant id, its bubble's start received) of a bubble's first grant that a freeze closed: the worker reports
    #: that grant's steps later (once thawed), and its first step still measures the grant latency.
    frozen_first_grant: tuple[int, int] | None = None
    used_bytes: int = 0
    reported_bytes: int = 0  # the worker's own measure of its device memory
    baseline_bytes: int = 0  # of used_bytes, what the cap does not cover (the worker's libraries on CPU)
    host_bytes: int = 0  # on a GPU: the resident set of its processes on the host
    host_baseline_bytes: int = 0  # of host_bytes, what the cap does not cover (0: no host cap)
    steps: int = 0
    progress: float = 0.0
    harvested_ns: int = 0
    overruns: int = 0
    checkpoint_path: str = ""
    checkpoint_step: int = -1
    restarts: int = 0
    stop: StopPhase = StopPhase.NONE
    #: ``stop`` is not NONE (kept by :meth:`stop_for`; read on every grant, so a field, not a property).
    stopping: bool = False
    stop_deadline_ns: int = 0
    #: Its current process outlived its stop's deadline and was killed (a drain says how many were).
    killed_at_stop: bool = False
    failure: FailureRecord | None = None
    pending_failure: FailureRecord | None = None
    finished_seen: bool = False
    from_queue: bool = False
    release_checkpoint: bool = True  # a release without it: the copy here is killed, not checkpointed

    @classmethod
    def added(cls, event: TaskAdded) -> TaskRuntime:
        hint_ns = event.step_hint_ns or int(event.spec.step_time_hint_ms * MS)
        return cls(
            task_id=event.task_id,
            spec=event.spec,
            seq=event.seq,
            memory_bytes=event.spec.memory_bytes,
            estimator=StepEstimator(hint_ns=hint_ns),
            checkpoint_path=event.checkpoint_path,
            checkpoint_step=event.checkpoint_step,
            steps=event.steps,
            progress=event.progress,
            progress_unit=event.progress_unit,
            restarts=event.restarts,
            harvested_ns=event.harvested_ns,
            overruns=event.overruns,
            from_queue=event.from_queue,
        )

    @property
    def known_step_ns(self) -> int | None:
        return self.estimator.estimate_ns()

    def stop_for(self, phase: StopPhase) -> None:
        """The one place its stop phase changes."""
        STOP.check(self.stop, phase, self.task_id)
        self.stop = phase
        self.stopping = phase is not StopPhase.NONE

    def usage_bytes(self) -> int:
        """Its memory by the larger of the device's figure and its worker's own report."""
        return max(self.used_bytes, self.reported_bytes)


class Tasks:
    """Every task, by id and by state. The paths that run on every bubble event (grants, budgets,
    admission, timers) read only the states they need, so that a few hundred queued tasks do not cost
    each event a scan of all of them."""

    def __init__(self) -> None:
        self.by_id: dict[str, TaskRuntime] = {}
        self.by_state: dict[TaskState, dict[str, TaskRuntime]] = {state: {} for state in TaskState}
        # The buckets every bubble event reads, held directly (a lookup by state hashes an enum in Python).
        self.submitted = self.by_state[TaskState.SUBMITTED]
        self.parked = self.by_state[TaskState.PARKED]
        self.frozen = self.by_state[TaskState.FROZEN]
        self._resident_buckets = tuple(self.by_state[state] for state in RESIDENT_STATES)
        #: Bumped whenever a task joins the waiting set (SUBMITTED): admission skips passes that cannot
        #: succeed until then (see ``memory.py``).
        self.waiting_epoch = 0

    def add(self, task: TaskRuntime, out: list[Action]) -> None:
        self.by_id[task.task_id] = task
        self.by_state[task.state][task.task_id] = task
        self.waiting_epoch += 1
        out.append(StateChanged(task.task_id, None, task.state, "submitted"))

    def forget(self, task: TaskRuntime) -> None:
        del self.by_id[task.task_id]
        del self.by_state[task.state][task.task_id]

    def move(
        self,
        task: TaskRuntime,
        new: TaskState,
        reason: str,
        out: list[Action],
        failure: FailureRecord | None = None,
    ) -> None:
        """The one place a task changes state; terminal states cannot be left."""
        old = task.state
        if old == new:
            return
        check_transition(task.task_id, old, new)
        task.state = new
        del self.by_state[old][task.task_id]
        self.by_state[new][task.task_id] = task
        if new == TaskState.SUBMITTED:
            self.waiting_epoch += 1
        if failure is not None:
            task.failure = failure
        out.append(StateChanged(task.task_id, old, new, reason, failure))

    def in_states(self, *states: TaskState) -> Iterator[TaskRuntime]:
        """The tasks now in any of ``states`` (from the index: no scan of every task)."""
        for state in states:
            yield from self.by_state[state].values()

    def resident(self) -> Iterator[TaskRuntime]:
        for bucket in self._resident_buckets:
            yield from bucket.values()

    def grantable(self) -> Iterator[TaskRuntime]:
        """The parked and the frozen tasks: who may be granted a bubble (not a frozen step whose verdict on
        the step timeout awaits its board read: ``StepHealth.verdict_due``)."""
        yield from self.parked.values()
        for task in self.frozen.values():
            if not task.health.verdict_due:
                yield task

    def count_in(self, state: TaskState) -> int:
        return len(self.by_state[state])
