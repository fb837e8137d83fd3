"""Plain, frozen dataclasses for everything that crosses the wire.

The generated protobuf classes never leave the two edge modules (``freeride._wire.client`` on the
client side, ``freeride._manager.servicers`` on the manager side); both translate to and from these
types. Times are nanoseconds on the host's ``CLOCK_MONOTONIC`` (``time.monotonic_ns()``), which all
processes on one machine share, unless a name says ``unix_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from freeride.errors import ConfigError

UNKNOWN_MEMORY = -1


@dataclass(frozen=True)
class BubbleStart:
    """A stage starts waiting: ``predicted_ns`` is how long it expects to wait."""

    stage: int
    rank: int
    iteration: int
    slot: int
    kind: str
    start_ns: int
    predicted_ns: int
    free_memory_bytes: int = UNKNOWN_MEMORY
    #: A slot the trainer learned from recurring waits, not one its schedule model lists.
    learned: bool = False

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.stage, self.rank, self.iteration, self.slot)

    @property
    def predicted_end_ns(self) -> int:
        return self.start_ns + self.predicted_ns


@dataclass(frozen=True)
class BubbleEnd:
    """The wait is over (the real end, measured by the trainer)."""

    stage: int
    rank: int
    iteration: int
    slot: int
    end_ns: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.stage, self.rank, self.iteration, self.slot)


BubbleEvent = BubbleStart | BubbleEnd

#: Largest accepted predicted bubble length; anything longer is a unit mistake.
MAX_PREDICTED_NS = 3600 * 10**9
MAX_KIND_CHARS = 64
#: How far ahead of the manager's clock a bubble time may be. Trainer and manager share the host's
#: CLOCK_MONOTONIC, so a time is never really ahead; the slack only absorbs how long a clock read
#: takes. A time further ahead (another host's clock, a unit mistake) would otherwise hold a side
#: task's grant or delay its freeze until that time.
MAX_CLOCK_AHEAD_NS = 10**9


#: The widths of a bubble's numbered fields on the wire (``proto/``: uint32, and uint64 for the iteration).
_FIELD_MAX = {"stage": 2**32 - 1, "rank": 2**32 - 1, "slot": 2**32 - 1, "iteration": 2**64 - 1}
_INT64_MAX = 2**63 - 1


def validate_bubble_event(event: BubbleEvent, latest_ns: int | None = None) -> None:
    """Raise :class:`ConfigError` with a precise message if a bubble event is malformed.

    ``latest_ns`` (the receiver's clock plus a small slack) bounds the event's time from above:
    trainer and manager share one CLOCK_MONOTONIC, so a time ahead of it is a foreign clock or a
    unit mistake, and accepting it would hold a grant open or delay a freeze until then. The kind
    is shown by ``freeride bubbles``, so it must be printable (no terminal escape sequences).
    Only form is checked here; order (an end without a start, a duplicate) is the core's business.
    """
    for name in ("stage", "rank", "iteration", "slot"):
        value = getattr(event, name)
        if value < 0:
            raise ConfigError(f"bubble {name} must be >= 0, got {value}")
        if value > _FIELD_MAX[name]:  # past its field on the wire: the stream's serializer would fail on it
            raise ConfigError(f"bubble {name} must be at most {_FIELD_MAX[name]}, got {value}")
    if isinstance(event, BubbleStart):
        if event.start_ns <= 0:
            raise ConfigError(f"bubble start_ns must be a positive monotonic time, got {event.start_ns}")
        if not 0 < event.predicted_ns <= MAX_PREDICTED_NS:
            raise ConfigError(
                f"bubble predicted_ns must be in (0, {MAX_PREDICTED_NS}], got {event.predicted_ns}"
            )
        if not UNKNOWN_MEMORY <= event.free_memory_bytes <= _INT64_MAX:
            raise ConfigError(f"free_memory_bytes must be >= 0 or -1, got {event.free_memory_bytes}")
        if len(event.kind) > MAX_KIND_CHARS or not event.kind.isprintable():
            raise ConfigError(f"bubble kind must be at most {MAX_KIND_CHARS} printable characters")
        time_name, time_ns = "start_ns", event.start_ns
    else:
        if event.end_ns <= 0:
            raise ConfigError(f"bubble end_ns must be a positive monotonic time, got {event.end_ns}")
        time_name, time_ns = "end_ns", event.end_ns
    if time_ns > _INT64_MAX:
        raise ConfigError(f"bubble {time_name} {time_ns} is past any monotonic time (at most {_INT64_MAX})")
    if latest_ns is not None and time_ns > latest_ns:
        raise ConfigError(
            f"bubble {time_name} {time_ns} is ahead of this host's CLOCK_MONOTONIC (at most {latest_ns} now): "
            "report times from time.monotonic_ns() on the manager's host"
        )


#: Bounds of a reported layout: more stages than this is a unit mistake or a hostile stream.
MAX_LAYOUT_STAGES = 4096
MAX_LAYOUT_MICROBATCHES = 65536
MAX_LAYOUT_TEXT_CHARS = 128


@dataclass(frozen=True)
class TrainerLayout:
    """The job's pipeline layout from ``at_ns`` on (``TrainerLayout`` in the protocol).

    Elastic training changes it at run time. ``stage_devices[i]`` is where stage ``i`` runs, as
    ``cuda:0`` (this node) or ``node/cuda:0``; empty when the reporting rank does not know the
    whole map. ``free_memory_bytes`` is this device's free memory under the new layout, when the
    trainer knows it (it seeds the manager's memory budget at once instead of at the next bubble).
    ``job`` says which run of the trainer reports it: the same shape from another job is a new layout
    (its bubbles are not the last job's); empty where unknown.
    """

    schedule: str
    stages: int
    microbatches: int
    stage_devices: tuple[str, ...] = ()
    at_ns: int = 0
    free_memory_bytes: int = UNKNOWN_MEMORY
    job: str = ""

    @property
    def shape(self) -> tuple[str, int, int, tuple[str, ...]]:
        """What makes two layouts the same layout: all but the time, the memory figure and the job."""
        return (self.schedule, self.stages, self.microbatches, tuple(self.stage_devices))

    def same_shape(self, other: TrainerLayout | None) -> bool:
        """True if ``other`` describes the same layout (the time and memory figure aside)."""
        return other is not None and self.shape == other.shape

    def same_job(self, other: TrainerLayout | None) -> bool:
        """True if ``other`` came from the same job as far as both know (either's job unknown: assumed)."""
        return other is not None and (not self.job or not other.job or self.job == other.job)

    def describe(self) -> str:
        """Short text form, e.g. ``1f1b stages=4 microbatches=8 [cuda:0 cuda:1 cuda:2 cuda:3]``."""
        text = f"{self.schedule} stages={self.stages} microbatches={self.microbatches}"
        if self.stage_devices:
            shown = " ".join(self.stage_devices[:8]) + (" ..." if len(self.stage_devices) > 8 else "")
            text += f" [{shown}]"
        return text

    def hosts_stage(self, device: str, node: str) -> bool:
        """Whether ``device`` on ``node`` runs a stage under this layout (True when no map is given).

        An entry ``node/device`` names a device on a node; a bare ``device`` matches any node, so a
        single-node job may leave nodes out.
        """
        return not self.stage_devices or device in self.devices_on(node)

    def devices_on(self, node: str) -> list[str]:
        """The devices of ``node`` that run a stage: entries ``node/device``, and bare ``device`` ones."""
        out = []
        for entry in self.stage_devices:
            where, sep, dev = entry.rpartition("/")
            if not sep or where == node:
                out.append(dev)
        return out


TrainerEvent = BubbleStart | BubbleEnd | TrainerLayout


def validate_layout(layout: TrainerLayout, latest_ns: int | None = None) -> None:
    """Raise :class:`ConfigError` with a precise message if a reported layout is malformed."""
    if not layout.schedule or len(layout.schedule) > MAX_KIND_CHARS or not layout.schedule.isprintable():
        raise ConfigError(f"layout schedule must be 1 to {MAX_KIND_CHARS} printable characters")
    for name, bound in (("stages", MAX_LAYOUT_STAGES), ("microbatches", MAX_LAYOUT_MICROBATCHES)):
        value = getattr(layout, name)
        if not 0 < value <= bound:
            raise ConfigError(f"layout {name} must be in [1, {bound}], got {value}")
    if layout.stage_devices and len(layout.stage_devices) != layout.stages:
        raise ConfigError(
            f"layout stage_devices names {len(layout.stage_devices)} devices for {layout.stages} stages"
        )
    for entry in layout.stage_devices:
        if not entry or len(entry) > MAX_LAYOUT_TEXT_CHARS or not entry.isprintable():
            raise ConfigError(f"a layout stage device must be 1 to {MAX_LAYOUT_TEXT_CHARS} printable characters")
    if len(layout.job) > MAX_LAYOUT_TEXT_CHARS or not layout.job.isprintable():
        raise ConfigError(f"a layout's job must be up to {MAX_LAYOUT_TEXT_CHARS} printable characters")
    if layout.free_memory_bytes < UNKNOWN_MEMORY:
        raise ConfigError(f"layout free_memory_bytes must be >= 0 or -1, got {layout.free_memory_bytes}")
    if layout.at_ns <= 0:
        raise ConfigError(f"layout at_ns must be a positive monotonic time, got {layout.at_ns}")
    if latest_ns is not None and layout.at_ns > latest_ns:
        raise ConfigError(
            f"layout at_ns {layout.at_ns} is ahead of this host's CLOCK_MONOTONIC (at most {latest_ns} now)"
        )


@dataclass(frozen=True)
class TaskSpec:
    """What a user submits. Exactly one of ``target`` and ``command`` is set."""

    target: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    memory_bytes: int = 0
    priority: int = 0
    name: str = ""
    command: tuple[str, ...] = ()
    working_dir: str = ""
    checkpoint_interval_s: float = 0.0
    step_time_hint_ms: float = 0.0

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.target:
            return self.target.rsplit(":", 1)[-1]
        return self.command[0].rsplit("/", 1)[-1] if self.command else "task"


@dataclass(frozen=True)
class FailureRecord:
    """Why a task failed, as data: the CLI renders it once, plainly."""

    kind: str  # EXCEPTION, MEMORY_LIMIT, SIGNAL, EXIT, STEP_TIMEOUT, IMPORT, PROTOCOL, ...
    message: str
    exit_code: int | None = None
    signal: int = 0
    step: int = -1
    traceback: str = ""
    log_tail: str = ""
    at_unix_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "step": self.step,
            "traceback": self.traceback,
            "log_tail": self.log_tail,
            "at_unix_s": self.at_unix_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailureRecord:
        return cls(
            kind=str(data["kind"]),
            message=str(data["message"]),
            exit_code=data.get("exit_code"),
            signal=int(data.get("signal", 0)),
            step=int(data.get("step", -1)),
            traceback=str(data.get("traceback", "")),
            log_tail=str(data.get("log_tail", "")),
            at_unix_s=float(data.get("at_unix_s", 0.0)),
        )


@dataclass(frozen=True)
class TaskProgress:
    """A task's figures: the one record embedded wherever they travel.

    The manager reports them (:class:`TaskInfo`), its store keeps them (:class:`TaskRecord`), and a
    cluster task carries them from one holder to the next (its queue record). ``progress`` is the
    task's own measure of its work, in ``progress_unit``; ``steps`` counts steps over every run;
    ``harvested_s`` is the time its steps ran inside grants; ``step_p95_ms`` is its step-time
    estimate (0: none yet; the local store does not keep it: a restarted manager learns it again).
    """

    steps: int = 0
    progress: float = 0.0
    progress_unit: str = "steps"
    harvested_s: float = 0.0
    overruns: int = 0
    restarts: int = 0
    checkpoint_step: int = -1  # -1: none
    step_p95_ms: float = 0.0


class ShowsProgress:
    """Reads a record's embedded :class:`TaskProgress` (``figures``) as if its figures were its own."""

    figures: TaskProgress

    @property
    def steps(self) -> int:
        return self.figures.steps

    @property
    def progress(self) -> float:
        return self.figures.progress

    @property
    def progress_unit(self) -> str:
        return self.figures.progress_unit

    @property
    def harvested_s(self) -> float:
        return self.figures.harvested_s

    @property
    def overruns(self) -> int:
        return self.figures.overruns

    @property
    def restarts(self) -> int:
        return self.figures.restarts

    @property
    def checkpoint_step(self) -> int:
        return self.figures.checkpoint_step

    @property
    def step_p95_ms(self) -> float:
        return self.figures.step_p95_ms


@dataclass(frozen=True)
class TaskRecord(ShowsProgress):
    """One task as it is kept and handed on: the manager's store, and a cluster task between the
    queue agent and the loop (claimed, held, left, ended).

    ``state`` is a :class:`~freeride.states.TaskState` value, or a cluster record's own (``CLAIMED``
    when claimed, ``EVICTED`` when it left a device); ``checkpoint_path`` is the checkpoint of
    ``figures.checkpoint_step`` ("" for none).
    """

    task_id: str
    spec: TaskSpec
    state: str
    figures: TaskProgress = field(default_factory=TaskProgress)
    checkpoint_path: str = ""
    failure: FailureRecord | None = None
    seq: int = 0
    submitted_unix_s: float = 0.0
    updated_unix_s: float = 0.0


@dataclass(frozen=True)
class TaskInfo(ShowsProgress):
    """A task as the manager reports it: its figures, and what only a live manager knows."""

    task_id: str
    spec: TaskSpec
    state: str
    figures: TaskProgress = field(default_factory=TaskProgress)
    step_p50_ms: float = 0.0
    waiting_reason: str = ""
    submitted_unix_s: float = 0.0
    updated_unix_s: float = 0.0
    failure: FailureRecord | None = None
    pid: int = 0
    #: Its directory on the manager's host: ``work/`` (what it writes), ``worker.log``, its checkpoints ("" unknown).
    task_dir: str = ""


@dataclass(frozen=True)
class Percentiles:
    """A distribution in brief. ``p999`` is 0 where not computed: only whole-run histograms have it
    (the recent-sample windows behind the other figures are too short for a 99.9th percentile)."""

    count: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    p999: float = 0.0


@dataclass(frozen=True)
class QueueStats:
    """A manager's part in the cluster queue (``--queue``), as its queue agent saw it at its last poll.

    ``depth`` (tasks waiting) and ``set_aside`` (records the queue set aside, see ``freeride ls --queue
    --all``) are the whole queue's; the counts are this manager's since it started.
    """

    connected: bool
    lease_ms: int
    depth: int = 0
    set_aside: int = 0
    #: Cluster tasks this manager holds now.
    held: int = 0
    #: Tasks this manager claimed.
    claims: int = 0
    #: Tasks whose holder stopped renewing its lease, returned to the queue by this manager's sweeps.
    reclaims: int = 0
    #: Lease renewals (one per held task per renewal round).
    renewals: int = 0
    #: Tasks this manager lost to another manager (its lease expired first); their copies here were stopped.
    lost: int = 0
    handed_back: int = 0
    #: Records this manager set aside (they could not be read or used), and its failed polls (outages).
    set_aside_here: int = 0
    errors: int = 0
    #: This manager's sweeps held back because managers had not yet been in contact with the queue's server
    #: for a whole lease (after a restart of the server, or an outage every manager saw).
    graces: int = 0
    last_error: str = ""


#: A trainer rank silent this long has left its device (the core stops counting it as one sharing the device; the
#: waiting reasons and the CLI say how long nothing is granted). Whole seconds.
RANK_LEFT_NS = 5_000_000_000
#: :data:`RANK_LEFT_NS` in seconds, as the messages that name it print it.
RANK_LEFT_S = RANK_LEFT_NS // 10**9
#: Quiet this long, trainer ranks that share a device are said to have shared it (their job ended or paused), by
#: the waiting reasons and the CLI alike, until the core stops counting them as sharing (:data:`RANK_LEFT_NS`).
SHARED_QUIET_NS = 1_000_000_000


@dataclass(frozen=True)
class ManagerStats:
    device: str
    uptime_s: float
    bubbles: int
    bubble_time_s: float
    granted_s: float
    harvested_s: float
    #: Grants whose step still ran at the bubble's real end: a step longer than the bubbles it is given is
    #: frozen and thawed, and overruns each of them (there can be more overruns than finished steps).
    overruns: int
    overrun_ms: Percentiles
    grant_latency_ms: Percentiles
    park_latency_ms: Percentiles
    memory_budget_bytes: int
    tasks_by_state: dict[str, int]
    events_received: int
    #: Bubble events refused as malformed (the manager's log says why).
    events_rejected: int
    draining: bool
    #: Grants and parks dropped because a worker's channel was full. Not on the wire yet: a
    #: ``ControlClient`` reports 0; the in-process metrics endpoint reports the real count.
    messages_dropped: int = 0
    #: Trainer timestamp of a bubble event -> the manager's loop handing it to the scheduler.
    event_delay_ms: Percentiles = field(default_factory=Percentiles)
    #: Valid events never handed to the scheduler: the manager stopped while they waited for room.
    events_dropped: int = 0
    #: The device as the manager resolved it (for a GPU: model, UUID, MPS mode).
    device_info: str = ""
    #: Why the device cannot be read now ("" when it can); the manager is NOT_SERVING meanwhile.
    device_problem: str = ""
    #: Trainer layouts adopted, and the current one in short form ("" before any was reported).
    layout_changes: int = 0
    layout: str = ""
    #: A bubble end received -> the running worker's ended-grant word set (it reads it before each step).
    end_to_worker_ms: Percentiles = field(default_factory=Percentiles)
    #: The manager's part in the cluster queue; None without ``--queue``.
    queue: QueueStats | None = None
    #: Trainer ranks that share the device now, the one whose waits it follows first (empty: one rank, or
    #: none yet); while several do, nothing is granted (a device is idle only while all of them wait).
    shared_by_ranks: tuple[int, ...] = ()
    #: Bubble events of ranks other than the followed one: counted, not otherwise used.
    events_other_ranks: int = 0
    #: Of ``bubbles``, those that ended while other ranks shared the device: their time is not in
    #: ``bubble_time_s`` (a device is idle only while all its ranks wait, which freeride does not follow).
    bubbles_while_shared: int = 0
    #: While ``shared_by_ranks`` is not empty, how long since any of those ranks sent an event (s): a job that
    #: ended leaves its device shared for 5 s more, which the CLI then says in the past tense
    #: (from :data:`SHARED_QUIET_NS`).
    shared_quiet_s: float = 0.0
    #: Of the freezes behind ``overruns``, the workers a trainer on this host stopped at the bubble's end itself
    #: (``cpu:N``: the end board's stop records), a wake-up and a core before the manager could.
    trainer_stops: int = 0
    #: Of ``overruns``, those of a step that looked hung (thawed at its turns to see whether it finishes, it runs past
    #: the end of each), not in ``overrun_ms``, which holds the steps that were not taken for hung.
    hung_overruns: int = 0
    #: Well-formed bubble events the scheduler ignored as out of order: an end without its open start (its
    #: start went to a manager that died, after a restart under a running trainer, or was lost), an end before
    #: its start, a start older than the open one. (Until this count, they were added to ``events_rejected``,
    #: which then rose by one after a restart with no reason anywhere.)
    events_ignored: int = 0
    #: Of ``events_received``, those read late on purpose: held back by a local trainer for its quiet slots (no
    #: resident task could use them), or read every ``--idle-read-ms`` while no task could use any bubble. Not
    #: timed in ``event_delay_ms``.
    events_late: int = 0
    #: The current run's figures (since its layout was taken on: :attr:`layout`), beside the totals since the
    #: manager started; 0 before any layout. ``run_s``: how long ago that was.
    run_s: float = 0.0
    run_bubbles: int = 0
    run_bubble_time_s: float = 0.0
    run_granted_s: float = 0.0
    run_harvested_s: float = 0.0


class Drained(NamedTuple):
    """What a drain stopped: tasks parked, of them checkpointed at their last step, of them killed because
    they ignored their stop past the manager's stop timeout (they lost the work since their checkpoint)."""

    parked: int
    checkpointed: int
    killed: int = 0


@dataclass(frozen=True)
class StreamSummary:
    """The manager's answer when a trainer closes its bubble stream; counts are events."""

    accepted: int = 0
    rejected: int = 0
    dropped: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class BubbleSlotStats:
    stage: int
    rank: int
    slot: int
    kind: str
    count: int
    length_ms: Percentiles
    predicted_ms: Percentiles
    abs_error_pct: Percentiles
    min_free_memory_bytes: int
    #: Its bubbles were reported as a learned slot (a recurring wait the schedule model does not list).
    learned: bool = False
    #: The mean of the same lengths as ``length_ms`` (ms; 0 with none): a slot whose lengths vary sums to
    #: its share of the bubble time by its mean, not its median.
    length_mean_ms: float = 0.0
    #: Of ``count``, the bubbles that ended while other trainer ranks shared the device: one rank's waits there,
    #: not the device's idle time (``ManagerStats.bubbles_while_shared``), though measured in this slot.
    shared: int = 0


@dataclass(frozen=True)
class TaskEvent:
    """A live-view event: a task changed, or a bubble started or ended."""

    at_unix_s: float
    task: TaskInfo | None = None
    bubble: BubbleEvent | None = None
