"""The scheduler core's language: its config, the events it takes and the actions it returns.

Everything here is plain frozen data. The loop builds events (from the trainer's stream, the workers'
messages and exits, user requests, memory samples) and carries out actions; the core's parts
(:mod:`.scheduler` and the modules it composes) decide. This module imports only the standard library
and the shared leaf modules (messages, states), so that every side of the manager can use its types.

Besides the actions the loop carries out, the core returns :class:`Note` actions: what it would have
logged (a task evicted, a worker killed for ignoring its stop), as data with a level and a task. The
core does no I/O of its own, logging included.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from freeride.messages import (
    BubbleEnd,
    BubbleStart,
    FailureRecord,
    TaskSpec,
    TrainerLayout,
)
from freeride.states import TaskState

MS = 1_000_000

#: ``freeride``: the manager's own policy. ``paper``: an emulation of the reference system's policy
#: (REFERENCE.md), so that the bench compares both inside one manager on one machine. Each is a class
#: of :class:`~freeride._manager.core.policy.SchedulingPolicy`, chosen from the config at construction.
POLICIES = ("freeride", "paper")


# ====================================================================== config


@dataclass(frozen=True)
class CoreConfig:
    """Scheduling knobs; units are in the names."""

    headroom_bytes: int = 256 * 2**20
    grace_ns: int = MS // 2
    margin_ns: int = MS // 5
    max_margin_ns: int = 20 * MS
    step_timeout_ns: int = 60_000 * MS
    stop_timeout_ns: int = 10_000 * MS
    memory_window_iterations: int = 8
    default_checkpoint_interval_s: float = 30.0
    #: A task whose step fitted no bubble for this many bubbles gets one probe grant: its estimate
    #: may be stale (learned under contention), and without a probe it could never recover.
    reprobe_after_bubbles: int = 200
    policy: str = "freeride"
    #: ``paper`` only: the scheduler polls on this period (the reference's 10 ms) ...
    poll_interval_ns: int = 10 * MS
    #: ... and predicts a bubble's end as start + the minimum profiled length of its (stage, slot);
    #: a slot missing here falls back to the trainer's prediction.
    paper_profile_ns: dict[tuple[int, int], int] = field(default_factory=dict)
    #: Bubble statistics are kept for at most this many (stage, rank, slot) keys. A trainer that
    #: reports ever new keys (a bug, or a hostile stream) must not grow the manager's memory and the
    #: Bubbles reply without bound; bubbles of further keys are still scheduled, only not tracked.
    max_slots: int = 4096

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.poll_interval_ns <= 0:
            raise ValueError("poll_interval_ns must be > 0")
        for name in ("headroom_bytes", "grace_ns", "margin_ns", "max_margin_ns"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("step_timeout_ns", "stop_timeout_ns", "memory_window_iterations", "reprobe_after_bubbles",
                     "max_slots"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_margin_ns < self.margin_ns:
            raise ValueError("max_margin_ns must be >= margin_ns")


# ====================================================================== events


@dataclass(frozen=True)
class BubbleStarted:
    bubble: BubbleStart
    received_ns: int
    #: The bubble's end, where it came in the same read as its start (a manager that fell behind): the
    #: bubble is recorded, and nothing is granted in it. 0: not known.
    end_ns: int = 0
    #: The trainer run that sent it, as its reporter's layout named it on the connection it came by ("": unknown):
    #: two jobs' ranks of the same number are told apart by it (``SchedulerCore._follows``).
    job: str = ""


@dataclass(frozen=True)
class BubbleEnded:
    bubble: BubbleEnd
    received_ns: int
    #: As :attr:`BubbleStarted.job`.
    job: str = ""


@dataclass(frozen=True)
class TrainerEndSeen:
    """The manager read the trainer's end of the bubble ``grant_id`` holds, straight from the trainer (a local
    trainer's event, :mod:`freeride._local_events`): the end the worker sees on the end board. The freeze is
    armed at ``end_ns`` + grace, not grace after the end reached the loop, or at the end itself for a step that
    will not end within the grace (``step_began_ns``: when the worker's step now running began, from its
    board; 0: none runs, or unknown); the end event is fed right after it and measured as usual.

    ``stopped_ns``: the trainer itself stopped the worker at this end, then (``cpu:N``, the end board's stop
    record, :mod:`freeride._boards`): it is frozen at once, booked at that time; with ``step_began_ns`` 0 it was
    between steps (about to park), which says nothing against its step estimate."""

    task_id: str
    grant_id: int
    end_ns: int
    step_began_ns: int = 0
    stopped_ns: int = 0


@dataclass(frozen=True)
class TaskAdded:
    """A new submission, or a task recovered from the store after a restart."""

    task_id: str
    spec: TaskSpec
    seq: int
    checkpoint_path: str = ""
    checkpoint_step: int = -1
    steps: int = 0
    progress: float = 0.0
    #: The unit of ``progress``: its worker's, once one has said (a restored figure read "95916 steps" for
    #: 95916 matmuls until the new worker was ready).
    progress_unit: str = "steps"
    restarts: int = 0
    #: What the task harvested and overran before a manager restart (from the store).
    harvested_ns: int = 0
    overruns: int = 0
    #: Claimed from the cluster queue: when it must leave this device (eviction, drain, a layout
    #: without a stage here) it goes back to the queue (:class:`Released`) instead of waiting here.
    from_queue: bool = False
    #: A step time learned on another device (the cluster record); 0: the spec's hint.
    step_hint_ns: int = 0


@dataclass(frozen=True)
class ReleaseRequested:
    """Give a cluster task up. With ``checkpoint`` it is stopped after a checkpoint and handed back to
    the queue; without, another manager owns it now and this copy is killed without writing."""

    task_id: str
    reason: str
    checkpoint: bool = True


@dataclass(frozen=True)
class LayoutChanged:
    """The trainer's pipeline layout changed (elastic training): what was learned of the old bubbles
    no longer holds. ``hosts_stage``: this device runs a stage under the new layout."""

    layout: TrainerLayout
    received_ns: int
    hosts_stage: bool = True


@dataclass(frozen=True)
class CancelRequested:
    task_id: str


@dataclass(frozen=True)
class DrainRequested:
    pass


@dataclass(frozen=True)
class WorkerReady:
    task_id: str
    pid: int
    progress_unit: str = "steps"
    #: What the device's runtime took before the task allocated anything (a CUDA context); 0 on CPU.
    context_bytes: int = 0
    #: The worker's footprint outside its cap (see :meth:`WorkerDevice.baseline_bytes`).
    baseline_bytes: int = 0
    #: Where device memory is not host memory (a GPU): the worker's host footprint outside its cap
    #: (see :meth:`WorkerDevice.host_baseline_bytes`); 0: no separate host cap.
    host_baseline_bytes: int = 0


def grant_harvest_ns(worked_ns: int, durations_ns: tuple[int, ...]) -> int:
    """What a grant's steps harvested: their costs summed by the worker (``worked_ns``), else (0: a worker of an
    earlier version) the listed durations summed."""
    return worked_ns if worked_ns > 0 else sum(durations_ns)


@dataclass(frozen=True)
class WorkerParked:
    task_id: str
    grant_id: int
    steps: int
    durations_ns: tuple[int, ...]
    first_step_ns: int  # 0: no step ran in this grant
    last_end_ns: int
    parked_ns: int
    reason: str  # "deadline", "park", "stop"
    progress: float
    total_steps: int
    #: Leading ``durations_ns`` that are a process's warm-up step: harvested work, no estimate sample.
    warmup_steps: int = 0
    #: The bubble's real end as the worker saw it on a board (the trainer's end board, or its ended word
    #: set on a servicer thread), maybe before the loop handed that end to this core; 0: none seen.
    seen_end_ns: int = 0
    #: ``durations_ns`` less what each step waited for the device (``Parked.costs_ns``); empty: the same.
    costs_ns: tuple[int, ...] = ()
    #: Every step's cost in the grant, summed (``Parked.worked_ns``): its harvested time; 0: unknown (a worker
    #: of an earlier version), the listed durations summed instead.
    worked_ns: int = 0

    @property
    def harvested_ns(self) -> int:
        """What the grant's steps harvested (:func:`grant_harvest_ns`)."""
        return grant_harvest_ns(self.worked_ns, self.durations_ns)


@dataclass(frozen=True)
class WorkerUsage:
    """Device memory the worker holds by its own measure, sent after each park (``Usage`` on the channel): the
    figure where the device's own (NVML's process list) cannot see the worker's process."""

    task_id: str
    device_bytes: int


@dataclass(frozen=True)
class WorkerCheckpointed:
    task_id: str
    step: int
    path: str
    progress: float


@dataclass(frozen=True)
class WorkerFinished:
    task_id: str
    total_steps: int
    progress: float


@dataclass(frozen=True)
class WorkerFailed:
    task_id: str
    failure: FailureRecord
    #: The steps of the grant it failed in (no park follows a failure): harvested time all the same.
    durations_ns: tuple[int, ...] = ()
    progress: float = -1.0  # -1: not reported
    total_steps: int = -1
    #: As ``WorkerParked.worked_ns``.
    worked_ns: int = 0

    @property
    def harvested_ns(self) -> int:
        """What the steps of the grant it failed in harvested (:func:`grant_harvest_ns`)."""
        return grant_harvest_ns(self.worked_ns, self.durations_ns)


@dataclass(frozen=True)
class WorkerStepsSeen:
    """Steps the worker's current process has finished, read from its board when it was frozen.

    The loop answers every :class:`Freeze` of a worker with one, before anything else reaches the core: a
    step that used up the step timeout at that freeze is judged on it (``StepHealth.verdict_due``).
    ``steps_done`` -1: the worker has no board (its state directory refused one), nothing was read.
    """

    task_id: str
    steps_done: int
    in_setup: bool = False  # it has begun no step yet: it is inside setup()
    in_checkpoint: bool = False  # it is writing a checkpoint: inside the task's state_dict()
    #: The worker's main thread's time so far runnable but waiting for a core inside its grants (the growth of
    #: ``/proc/<pid>/schedstat``'s run delay from each grant to its freeze, summed); -1: not read. Its growth since
    #: the last freeze is granted time the step could not run (``StepHealth.waited``).
    run_delay_ns: int = -1
    #: The task's steps finished before the one it is frozen in (its board's step word: restored ones included);
    #: -1: not read, or inside setup().
    step: int = -1
    #: The worker had not run since its last freeze and was waiting for its core at this one: it had no core in
    #: the grant it is frozen in (a wait the run delay shows only once it ends).
    starved: bool = False
    #: The worker had not run since its last freeze and was asleep at this one: it slept through the grant it is
    #: frozen in (a step hung in a sleep, or blocked), which no wait for the core will explain.
    asleep: bool = False


@dataclass(frozen=True)
class WorkerExited:
    task_id: str
    exit_code: int | None
    signal: int
    log_tail: str = ""
    step: int = -1  # the step the worker was in, when it published one


@dataclass(frozen=True)
class TaskMemorySampled:
    task_id: str
    used_bytes: int
    #: The task's resident set on the host where ``used_bytes`` is device memory (a GPU); -1: not read.
    host_bytes: int = -1


@dataclass(frozen=True)
class DeviceMemorySampled:
    free_bytes: int


@dataclass(frozen=True)
class DeviceStatusChanged:
    """The device became unreadable (``problem`` says why) or readable again (``problem`` empty)."""

    problem: str


@dataclass(frozen=True)
class Tick:
    """Nothing happened; lets due timers fire."""


Event = (
    BubbleStarted
    | BubbleEnded
    | TrainerEndSeen
    | TaskAdded
    | CancelRequested
    | DrainRequested
    | WorkerReady
    | WorkerStepsSeen
    | WorkerParked
    | WorkerUsage
    | WorkerCheckpointed
    | WorkerFinished
    | WorkerFailed
    | WorkerExited
    | TaskMemorySampled
    | DeviceMemorySampled
    | DeviceStatusChanged
    | ReleaseRequested
    | LayoutChanged
    | Tick
)


# ====================================================================== actions


@dataclass(frozen=True)
class Spawn:
    task_id: str
    spec: TaskSpec
    memory_bytes: int
    resume_path: str


@dataclass(frozen=True)
class Grant:
    task_id: str
    grant_id: int
    deadline_ns: int
    margin_ns: int
    thaw: bool
    probe: bool = False  # run one step whatever the estimate, and learn the step time afresh
    #: The bubble's trainer rank and start time (its identity on the trainer's end board) and key.
    rank: int = -1
    bubble_start_ns: int = 0
    bubble_key: tuple[int, int, int, int] = (-1, -1, -1, -1)
    #: The worker may stop on the trainer's own end of this bubble (never under the reference policy).
    trainer_ends: bool = False
    #: The recent lengths of the bubble's slot, sorted: while the bubble outlives ``deadline_ns`` (no end
    #: known), the worker sizes its steps to ``surviving_end_ns`` of them (empty: the deadline stands).
    survival_ns: tuple[int, ...] = ()
    #: The overrun past the real end tolerated before a freeze: a step whose high-percentile time is within it is
    #: sized to the longest of ``survival_ns`` (``surviving_end_ns``).
    grace_ns: int = 0
    #: The bubble's first grant, made only once it outlived its prediction (none fitted what that left):
    #: the core offered it again (``OpenBubble.next_chance_ns``). For the trace; the worker ignores it.
    late: bool = False


@dataclass(frozen=True)
class Park:
    task_id: str
    grant_id: int
    #: When the manager received the end that causes this park, and that end (0: a park of the
    #: reference policy's poll, or of a bubble whose end was lost).
    end_received_ns: int = 0
    end_ns: int = 0


@dataclass(frozen=True)
class Freeze:
    task_id: str
    #: When the worker was stopped, where something before this freeze stopped it (the trainer, at the end:
    #: :attr:`TrainerEndSeen.stopped_ns`); 0: the freeze stops it now.
    at_ns: int = 0


@dataclass(frozen=True)
class Thaw:
    """Let a frozen worker run on to its exit: it finished (its last message crossed the freeze that stopped it)."""

    task_id: str


@dataclass(frozen=True)
class Stop:
    """Ask the worker to (optionally) checkpoint and exit; a Kill follows if it does not."""

    task_id: str
    checkpoint: bool


@dataclass(frozen=True)
class Kill:
    task_id: str


@dataclass(frozen=True)
class StateChanged:
    task_id: str
    old: TaskState | None
    new: TaskState
    reason: str
    failure: FailureRecord | None = None


@dataclass(frozen=True)
class CheckpointRecorded:
    task_id: str
    step: int
    path: str
    progress: float


@dataclass(frozen=True)
class DrainComplete:
    pass


class NoteLevel(enum.IntEnum):
    """How much a :class:`Note` matters; the values are the standard library's logging levels."""

    DEBUG = 10
    INFO = 20
    WARNING = 30


@dataclass(frozen=True)
class Note:
    """Something the loop should log for the core (the core does no I/O): a level, a line, and the
    task it concerns ("" for the device as a whole)."""

    level: NoteLevel
    message: str
    task_id: str = ""


@dataclass(frozen=True)
class Released:
    """A cluster task left this device, its process gone: the queue places it again (unless it was
    lost to another manager). Its figures are the last this device knew."""

    task_id: str
    reason: str
    checkpoint: bool
    steps: int
    progress: float
    checkpoint_path: str
    checkpoint_step: int
    restarts: int
    step_p95_ns: int | None
    #: Its progress's unit as its worker last said it ("" unknown: the record's own stands). The record's, from
    #: before any worker had said it, turned "90 iters" into "90 steps" at a hand-back.
    progress_unit: str = ""


Action = (
    Spawn
    | Grant
    | Park
    | Freeze
    | Thaw
    | Stop
    | Kill
    | StateChanged
    | CheckpointRecorded
    | DrainComplete
    | Released
    | Note
)




# ====================================================================== what the core counts


@dataclass
class CoreStats:
    """The core's running totals and recent samples, read by the loop for ``freeride stats``."""

    bubbles: int = 0
    bubble_ns: int = 0
    granted_ns: int = 0
    harvested_ns: int = 0
    overruns: int = 0
    #: Of ``overruns``, a step's that looked hung (its step phase ``HUNG``), not in ``overrun_ms``: thawed at its turns
    #: to see whether it finishes, such a step runs past the end of each (thousands, in a stranger's minute of a
    #: hang), and they hid the tail of the steps that do finish.
    hung_overruns: int = 0
    anomalies: int = 0
    layout_changes: int = 0
    #: Out-of-order events dropped: an end without its open start, an end before its start, a start
    #: older than the open bubble's. Counted with the rejected events in the manager's stats.
    ignored_events: int = 0
    #: Bubble events of a trainer rank other than the one the device follows (``SchedulerCore._follows``).
    other_rank_events: int = 0
    #: The followed rank's bubbles that ended while other ranks shared the device: counted in ``bubbles``, not
    #: in ``bubble_ns`` (one rank's wait there is another's compute), so ``stats`` can say why the time is less.
    shared_bubbles: int = 0
    #: The totals (bubbles, bubble_ns, granted_ns, harvested_ns) when the current run's layout was taken on, and
    #: when (the manager's clock): the run's own figures are the totals less these (:meth:`run`). A manager kept
    #: up across jobs showed only totals since it started, and a task's harvested time never reset.
    run_base: tuple[int, int, int, int] = (0, 0, 0, 0)
    run_since_ns: int = 0
    overrun_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    grant_latency_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    park_latency_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def new_run(self, now_ns: int) -> None:
        """A layout was taken on: the figures of the run it begins start from here."""
        self.run_base = (self.bubbles, self.bubble_ns, self.granted_ns, self.harvested_ns)
        self.run_since_ns = now_ns

    def run(self) -> tuple[int, int, int, int]:
        """The current run's bubbles, bubble time, granted and harvested time (ns) since its layout."""
        base = self.run_base
        return (self.bubbles - base[0], self.bubble_ns - base[1], self.granted_ns - base[2],
                self.harvested_ns - base[3])
