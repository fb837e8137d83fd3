"""The manager loop: one ``select``, timers, and dispatch between its components and the core.

One thread runs :meth:`ManagerLoop.run`. It waits in a single ``select`` on the inbox's eventfd
(posted events and requests from gRPC threads, the device poller, the queue agent and signal
handlers), every worker's channel, output pipe and pidfd, with a timeout equal to the next timer.
Each wake-up feeds events to the pure :class:`~freeride._manager.core.SchedulerCore` and hands the
actions it returns to the component that carries them out. The loop is the only caller of the core,
and no component writes the core's state; a component that answers an action with events (a frozen
worker's steps, a spawn that failed) has them fed after the current actions are all applied, so the
core is never re-entered mid-action.

The components, each a module with a narrow interface:

* :mod:`~freeride._manager.inbox` -- ingress and backpressure (what other threads hand the loop);
* :mod:`~freeride._manager.supervisor` -- workers: spawn, channels, signals, output, exits;
* :mod:`~freeride._manager.durability` -- the task records, the store, deferred writes, recovery;
* :mod:`~freeride._manager.views` -- what requests are answered with;
* :mod:`~freeride._manager.watchers` -- live views (``Watch``);
* :mod:`~freeride._manager.cluster_bridge` -- the cluster tasks held here, and the queue agent;
* :mod:`~freeride._manager.ends` -- the end fast path (a bubble's end to its worker before the core);
* :mod:`~freeride._manager.trace` -- the ``--trace`` timeline.

Bubble events arrive in batches (one per trainer message, :meth:`ManagerLoop.post_bubbles`); the
loop feeds their events to the core one at a time, in order, timing each one's delay from the
trainer's timestamp (``event_delay``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freeride import _channel as W
from freeride._cluster.records import CancelTask as QueueCancel
from freeride._cluster.records import ClaimedTask, GetQueueView, QueueNote, ReleaseTask, is_cluster_id
from freeride._local_events import LocalEvents, decode, sent_late
from freeride._manager import core as C
from freeride._manager.addresses import AddressWatch
from freeride._manager.cluster_bridge import ClusterBridge
from freeride._manager.device_poller import DevicePoller
from freeride._manager.durability import HOME_CHECK_NS, Durability, stamped
from freeride._manager.ends import EndPath
from freeride._manager.figures import figures_of
from freeride._manager.histogram import LatencyHistogram
from freeride._manager.inbox import BUBBLES_PER_TURN, Inbox
from freeride._manager.paths import TaskPaths
from freeride._manager.quiet import QuietSlots
from freeride._manager.requests import Drain, Request, Shutdown
from freeride._manager.state_lock import StateDirLock
from freeride._manager.store import TaskStore
from freeride._manager.supervisor import StepsReported, Supervisor, WorkerSettings
from freeride._manager.timer import make_timer
from freeride._manager.trace import LoopTrace, TraceWriter
from freeride._manager.views import Counters, Failures, Views
from freeride._manager.watchers import Watchers
from freeride._manager.worker_log import check_limits
from freeride.devices import Device, DeviceName, parse_device_name
from freeride.devices.cpu import SCHEDSTAT_PATH, ProcField
from freeride.devices.time_slice import LOOP_TIME_SLICE_NS, set_time_slice
from freeride.errors import ConfigError, ManagerUnavailable
from freeride.messages import (
    MAX_CLOCK_AHEAD_NS,
    BubbleEnd,
    BubbleSlotStats,
    BubbleStart,
    QueueStats,
    TaskEvent,
    TaskRecord,
    TrainerEvent,
    TrainerLayout,
    validate_bubble_event,
    validate_layout,
)
from freeride.states import TaskState

log = logging.getLogger(__name__)

#: How often the loop reads its parked workers' CPU time (:meth:`ManagerLoop._check_parked_cpu`).
PARKED_CPU_CHECK_NS = 500_000_000
#: A parked worker that used this share of the time between two readings, and at least OUTSIDE_GRANTS_MIN_NS (the
#: little a worker does as it parks is far below), runs threads of its own outside its grants.
OUTSIDE_GRANTS_SHARE = 0.2
OUTSIDE_GRANTS_MIN_NS = 50_000_000
#: The loop wakes at least this often with nothing to do (every event, timer and message wakes it
#: anyway): a bound on how long a lost wake-up could go unnoticed, not a poll.
IDLE_WAKE_NS = 1_000_000_000
#: A freeze is due at a bubble's end + grace. Waking a thread whose core sat idle takes ~0.1-0.2 ms on the
#: 2-core test VM (deep C-states take as long on bare metal), which a freeze woken on time would overrun
#: its grace by. So the loop's timer wakes this much before a freeze and the loop turns without sleeping
#: (``select`` with no timeout: worker messages, local events and requests are still handled) until it is
#: due. At most this much of the manager's CPU per armed freeze; a worker that parks meanwhile disarms it.
#: It turns without sleeping: never run the loop at a real-time priority (tried: SCHED_FIFO, and the
#: trainers on the same cores crawled).
FREEZE_LEAD_NS = 200_000
#: While no task could take a grant (none resident: no side task yet, or every one ended), the loop reads a local
#: trainer's events every this often instead of at each one (``ManagerLoop._follow_local``): nothing is decided
#: on them then, and a send that wakes no one costs the training thread ~1 us instead of ~15, the loop one
#: wake-up per read instead of one per event. A stranger's interleaved trainer ran +17% slower (about 115 us a
#: bubble) beside managers that had no side task. Far below what a connection's buffer holds (~550 events at
#: Linux's default cap): ~50 events at 5,000 a second. ``LoopConfig.idle_read_ns`` (``--idle-read-ms``) sets it; 0
#: reads every event at once whatever the tasks (the benches that time a manager's events do).
LAZY_READ_NS = 10_000_000
#: The longest ``LoopConfig.idle_read_ns``: a connection's buffer holds ~550 events at Linux's default cap.
MAX_IDLE_READ_NS = 100_000_000
#: The longest ``LoopConfig.event_spin_ns``: past it the loop would spin through the gaps between iterations too.
MAX_EVENT_SPIN_NS = 100_000_000
#: While it spins, the loop reads its thread's run delay this often (one ``pread``, ~1 us) ...
SPIN_CHECK_NS = 100_000
#: ... and gives way once that grew by more than this since the last reading, beyond what the manager's own other
#: threads ran meanwhile: the loop was runnable without its core, another process had it
#: (``ManagerLoop._still_spinning``) ...
SPIN_GIVE_WAY_NS = 2_000_000
#: ... and then does not spin for this long, twice as long each time it gives way again, up to
#: :data:`MAX_SPIN_BACKOFF_NS`, and back to this once it has not given way for :data:`SPIN_QUIET_NS`.
SPIN_BACKOFF_NS = 10_000_000
MAX_SPIN_BACKOFF_NS = 1_000_000_000
SPIN_QUIET_NS = 10_000_000_000
#: A local trainer's messages that are no event are each counted, and logged once, then at most once this
#: often with how many came since: a trainer sending garbage at its event rate would flood the log.
LOCAL_REJECT_LOG_INTERVAL_NS = 10_000_000_000

_TrainerInput = C.BubbleStarted | C.BubbleEnded | C.LayoutChanged


def with_ends_known(events: Sequence[_TrainerInput]) -> list[_TrainerInput]:
    """``events`` (one read of a trainer's: a local batch, a stream's message), each start whose end is among
    them carrying that end, so that the core records the bubble and grants nothing in it.

    A manager that fell behind (no core free at a bubble's start: on the bench's two busy cores a DeepSpeed
    rank's events came 6 ms late, four bubbles in one read) granted each such bubble in turn, and each
    grant thawed a worker only to have it frozen at once, past an end long gone: overruns of 5-28 ms.
    """
    ends = {e.bubble.key: e.bubble.end_ns for e in events if isinstance(e, C.BubbleEnded)}
    if not ends:
        return list(events)
    return [dataclasses.replace(e, end_ns=ends[e.bubble.key])
            if isinstance(e, C.BubbleStarted) and ends.get(e.bubble.key, -1) >= e.bubble.start_ns else e
            for e in events]


@dataclass(frozen=True)
class LoopConfig:
    state_dir: Path
    core: C.CoreConfig = field(default_factory=C.CoreConfig)
    memory_poll_ms: float = 50.0
    device_poll_ms: float = 1000.0
    eof_grace_ms: float = 500.0
    #: Write a JSON-lines timeline of bubbles, grants, parks and steps here (see trace.py).
    trace_path: Path | None = None
    #: Bubble events that may wait in the inbox: ~50 ms of the loop's work at the ~40,000 events/s
    #: measured in ``bench/bench_load.py``, under 1 MiB. See :mod:`freeride._manager.inbox`.
    max_pending_events: int = 2048
    store_retry_ms: float = 1000.0
    #: This host as the cluster names it: in a layout's stage map (``node/cuda:0``) and in the queue.
    node: str = field(default_factory=socket.gethostname)
    #: Where cluster tasks checkpoint (``--checkpoint-dir``, shared by every node): ``<dir>/<task id>/e<epoch>/``,
    #: so that a task reclaimed elsewhere resumes from the newest checkpoint its last holder wrote.
    checkpoint_root: Path | None = None
    #: A worker's log is rotated when it would grow past this; ``worker_log_backups`` older ones are kept.
    worker_log_max_bytes: int = 8 * 2**20
    worker_log_backups: int = 1
    #: The trainer's end board (:class:`freeride._boards.EndBoard`), made by the daemon next to its unix
    #: socket; workers read it. None: ends reach workers through the manager only.
    end_board_path: Path | None = None
    #: After each trainer event the loop turns without sleeping this long (``--event-spin-us``; 0: off), so that
    #: the trainer's next event finds it awake. Waking a loop asleep on another core costs the trainer's send
    #: ~15 us on the 2-core test VM (an inter-processor interrupt), one awake ~1 us (``bench/results/cpu/
    #: wake.md``); ~48 events an Interleaved1F1B iteration made that the larger part of the instrumentation's
    #: cost (``bench/results/cpu/hot_path_awake.md``). The price is the manager's core, busy while events come:
    #: worth it only where that core is spare, so the loop turns it off where every core it may run on
    #: computes a rank (:func:`cores_shared_with_training`).
    event_spin_ns: int = 0
    #: With no side task resident, a local trainer's events are read this often, not at each (:data:`LAZY_READ_NS`,
    #: ``--idle-read-ms``); 0: at each, always.
    idle_read_ns: int = LAZY_READ_NS
    #: On a ``cpu:N`` device with an end board, the trainer stops a side task's worker still holding its bubble at
    #: the end (``--no-trainer-stops``: the manager freezes it, a wake-up and a core later; :mod:`freeride._boards`).
    trainer_stops: bool = True
    #: With an end board, the followed rank's slots that no resident task could use are published there, and a
    #: local trainer holds their events back (:mod:`freeride._manager.quiet`; ``--no-quiet-slots``: every event
    #: is sent as it happens).
    quiet_slots: bool = True

    def __post_init__(self) -> None:
        for name in ("memory_poll_ms", "device_poll_ms", "eof_grace_ms", "max_pending_events", "store_retry_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.event_spin_ns <= MAX_EVENT_SPIN_NS:
            raise ValueError(f"event_spin_ns must be 0..{MAX_EVENT_SPIN_NS}, got {self.event_spin_ns}")
        if not 0 <= self.idle_read_ns <= MAX_IDLE_READ_NS:
            raise ValueError(f"idle_read_ns must be 0..{MAX_IDLE_READ_NS}, got {self.idle_read_ns}")
        check_limits(self.worker_log_max_bytes, self.worker_log_backups)


#: Actions that only record (a state change, a note): a grant after them in one event's actions goes first.
_RECORDS = (C.StateChanged, C.Note)


def cores_shared_with_training(device: DeviceName, layout: TrainerLayout, node: str, cores: set[int]) -> set[int]:
    """The cores a ``cpu:N`` manager may run on, when every one of them computes a stage of ``layout`` (else the
    empty set: a core is free of ranks, the layout names no devices, or the device is a GPU).

    On a CPU core the manager's own work per bubble (its loop, grants, freezes) runs beside a rank: a manager
    whose cores all hold ranks takes that CPU from training (found: +45% on two 1F1B ranks of 16 ms iterations
    with a side task running). On a GPU host the ranks' cores are the host's, not the devices'."""
    if device.kind != "cpu" or not layout.stage_devices or not cores:
        return set()
    ranks = set()
    for name in layout.devices_on(node):
        try:
            stage = parse_device_name(name)
        except ConfigError:
            continue
        if stage.kind == "cpu":
            ranks.add(stage.index)
    return set(cores) if cores <= ranks else set()


def cores_with_cpu_managers(sockets: Path, cores: set[int]) -> set[int]:
    """``cores`` when each has a ``cpu:K`` manager's default socket in ``sockets`` (else the empty set).

    The adapters report no stage-to-device map (a rank knows its own device only), and one rank per ``cpu:K``
    manager is how a CPU job runs: cores that each have a manager beside this one are taken for ranks' cores.
    No warning reached a user of two ranks and two unpinned managers, whose layouts named no devices."""
    if cores and all((sockets / f"cpu-{core}.sock").exists() for core in cores):
        return set(cores)
    return set()


class ManagerLoop:
    def __init__(self, device: Device, config: LoopConfig, now_ns: Callable[[], int] = time.monotonic_ns,
                 state_lock: StateDirLock | None = None) -> None:
        """``state_lock``: the state directory's lock, held by the caller; given, the loop checks every second
        that the directory is still its own and makes it again if it was removed (:meth:`Durability.check_home`)."""
        self.device = device
        self.config = config
        self._state_lock = state_lock
        self._next_home_check_ns = 0
        self._addresses: AddressWatch | None = None
        self._cores = os.sched_getaffinity(0)  # where this manager's threads may run (workers pin their own)
        self._said_cores_shared = False
        #: Parked workers' CPU time at the last reading: task id -> (CPU ns, when, grant id) (_check_parked_cpu).
        self._parked_cpu: dict[str, tuple[int, int, int]] = {}
        self._next_parked_check_ns = 0
        self.now_ns = now_ns
        self.core = C.SchedulerCore(config.core)
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"state directory {config.state_dir} is not writable: {exc}") from None
        self.started_unix = time.time()
        #: Trainer timestamp -> handed to the core, for every bubble event (loop thread only).
        self.event_delay = LatencyHistogram()
        self.on_draining: Callable[[], None] = lambda: None
        #: Called on the loop's thread when a shutdown begins (True: at once, without a drain).
        self.on_shutdown: Callable[[bool], None] = lambda immediate: None
        #: Called on the loop thread with the device's problem when it stops answering, "" when it answers
        #: again (the daemon turns it into the health status).
        self.on_device_state: Callable[[str], None] = lambda problem: None
        self.inbox: Inbox[_TrainerInput] = Inbox(config.max_pending_events, self._trainer_input)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.inbox.fileno(), selectors.EVENT_READ, self.inbox.clear_wake)
        self.poller = DevicePoller(device, self.post, config.memory_poll_ms, config.device_poll_ms)
        cluster_epochs: dict[str, int] = {}  # cluster task held here -> its claim epoch
        self.paths = TaskPaths(config.state_dir, config.checkpoint_root, cluster_epochs.get)
        settings = WorkerSettings(
            eof_grace_ms=config.eof_grace_ms, worker_log_max_bytes=config.worker_log_max_bytes,
            worker_log_backups=config.worker_log_backups, end_board_path=config.end_board_path,
            admission=config.core.policy, default_checkpoint_interval_s=config.core.default_checkpoint_interval_s,
            # Where a step is stuck is in its log before the step timeout fails it (an eighth of that, at most 2 s).
            stack_report_ms=min(2000.0, config.core.step_timeout_ns / 8e6),
        )
        self.workers = Supervisor(device, settings, self.paths, self._selector, self.poller.watch, self.poller.forget,
                                  now_ns)
        self.durability = Durability(TaskStore(config.state_dir / "tasks.db"), config.store_retry_ms, device, now_ns)
        self.failures = Failures()
        self.cluster = ClusterBridge(self.core, self.durability.records, self.paths, cluster_epochs, str(device),
                                     config.node, self.failures.of)
        self.views = Views(self.core, device, self.durability, self.cluster, self.failures, self.workers.pid,
                           self._counters, config.core.margin_ns, now_ns, self.paths.task_dir)
        self.watchers = Watchers()
        stops = config.trainer_stops and device.name.kind == "cpu"
        self.ends = EndPath(now_ns, config.end_board_path if stops else None, self.workers.stopped_by_trainer)
        self.workers.before_reap = self.ends.forget_pid
        self.workers.on_command_group = self.ends.command_group
        self.quiet = QuietSlots(config.end_board_path if config.quiet_slots else None)
        self.trace = (LoopTrace(TraceWriter(config.trace_path, str(device)), now_ns, self.workers.cpu_ns)
                      if config.trace_path else None)
        self._local: LocalEvents | None = None
        self._local_eager = True  # the local events' descriptor is in the selector (_follow_local)
        self._lazy_read_at_ns = 0  # while it is not: when the loop reads them next
        self._local_rejects_unlogged = 0
        #: Local events read late on purpose (quiet slots' held back by the trainer, or lazy reads): not timed.
        self.events_late = 0
        self._event_spin_ns = config.event_spin_ns  # 0 once the loop finds its cores all computing ranks
        self._spin_until_ns = 0  # the loop turns without sleeping until then (the last trainer event + the spin)
        self._run_delay = ProcField(SCHEDSTAT_PATH, 1)  # the loop thread's (opened by it, at its first spin)
        self._spin_check_ns = 0  # the next reading of it in this spin (0: the spin's first, its baseline)
        self._spin_delay: tuple[int, int, int] | None = None  # the last reading in this spin (:meth:`_spin_reading`)
        #: Spins cut short because the loop's core was wanted (:meth:`_still_spinning`).
        self.spins_given_way = 0
        self._spin_backoff_ns = SPIN_BACKOFF_NS  # how long the next give-way stops spinning for
        self._spin_off_until_ns = 0  # no spin before then (the last give-way + its back-off)
        self._spin_gave_way_ns = 0  # when it last gave way
        self._local_reject_log_ns = 0  # when the next rejected local message may be logged
        #: Wakes the select at the core's next timer to the microsecond (epoll's own timeout is whole ms).
        #: Only on the real clock: a test's fake clock has no kernel timer.
        self._timer = make_timer() if now_ns is time.monotonic_ns else None
        if self._timer is not None:
            self._selector.register(self._timer.fileno(), selectors.EVENT_READ, self._timer.clear)
        self._drain_waiters: list[Future[Any]] = []
        self._said_drained = False  # the log said the drain is over (once: a drain asked again completes again)
        self._stop_after_drain = False
        self._running = True
        self._apply_by_type: dict[type, Callable[[Any], list[Any] | None]] = {
            C.Grant: self._grant, C.Park: self._park, C.Freeze: self._freeze, C.Spawn: self.workers.spawn,
            C.Thaw: self._thaw, C.Stop: self._stop, C.Kill: self._kill, C.StateChanged: self._state_changed,
            C.CheckpointRecorded: self._checkpoint_recorded, C.Released: self.cluster.released,
            C.DrainComplete: self._drain_complete, C.Note: self._note,
        }
        for event in self.durability.recover(self.paths):
            self._feed(event)

    # ------------------------------------------------------------------ thread-safe entry points

    def post(self, event: Any) -> None:
        """Enqueue an event from any thread (or a signal handler); returns at once."""
        self.inbox.post(event)

    def post_bubble(self, event: TrainerEvent, received_ns: int) -> int:
        """Enqueue one valid bubble event; see :meth:`post_bubbles`."""
        return self.post_bubbles((event,), received_ns)

    def post_bubbles(self, events: Sequence[TrainerEvent], received_ns: int, job: str = "") -> int:
        """Enqueue valid bubble events, in order (a trainer stream's thread; see :mod:`~freeride._manager.inbox`);
        ``job``: the run that sent them, as the stream's layout named it.

        An end first sets the word of the worker that holds its bubble (:mod:`~freeride._manager.ends`).
        Returns how many events were not enqueued: those still waiting for room when the loop stopped.
        """
        self.ends.trainer_events(events, received_ns)
        return self.inbox.post_bubbles(events, received_ns, job)

    def _trainer_input(self, event: TrainerEvent, received_ns: int, job: str = "") -> _TrainerInput:
        """The core's event for a trainer's; ``job``: the run that sent it, as its connection's layout named it."""
        if isinstance(event, BubbleStart):
            return C.BubbleStarted(event, received_ns, job=job)
        if isinstance(event, TrainerLayout):
            self._say_if_cores_shared(event)
            return C.LayoutChanged(event, received_ns, event.hosts_stage(str(self.device), self.config.node))
        return C.BubbleEnded(event, received_ns, job=job)

    def _say_if_cores_shared(self, layout: TrainerLayout) -> None:
        """Warn once when every core this manager may run on computes a stage of ``layout`` (``cpu:N`` ranks):
        its own CPU then comes out of training's (module doc of :func:`cores_shared_with_training`)."""
        if self._said_cores_shared:
            return
        shared = cores_shared_with_training(self.device.name, layout, self.config.node, self._cores)
        guessed = False
        if not shared and self.device.name.kind == "cpu" and self.config.end_board_path is not None:
            shared = cores_with_cpu_managers(self.config.end_board_path.parent, self._cores)
            guessed = bool(shared)
        if shared:
            self._said_cores_shared = True
            if guessed:
                # A guess from the managers' sockets (the layout names no devices): a stranger's ranks both ran on
                # one core, and the other core's manager made this one turn its spin off, "every core computes a
                # rank", for a core no rank used. The spin gives way by itself where a rank takes its core.
                whose = (f"has a cpu manager, and is taken for a rank's: the layout ({layout.describe()}) names no "
                         "devices, and one rank per cpu manager is the usual way")
            else:
                whose = f"is a training rank's ({layout.describe()})"
                if self._event_spin_ns:
                    self._event_spin_ns = self._spin_until_ns = 0
                    log.warning("[%s] --event-spin-us is off: every core this manager may run on computes a rank, "
                                "and turning awake between events would take that core from it", self.device)
            log.warning("[%s] every core this manager may run on (%s) %s. Its own CPU (0.4-1 ms per bubble on the "
                        "2-core test VM, 1 ms with a side task running) is then taken from the ranks: two 1F1B ranks "
                        "ran +10%% slower at 45 ms iterations, +45-93%% at 16-19 ms "
                        "(bench/results/cpu/instrumentation-side-task.md). Give the managers a core no rank uses "
                        "(taskset -c K freeride manager ...)", self.device, ",".join(map(str, sorted(shared))), whose)

    def call(self, request: Request | GetQueueView, timeout_s: float = 10.0) -> Any:
        """Run a request on the loop thread and return its answer (or raise its error)."""
        return self.call_async(request).result(timeout=timeout_s)

    def call_async(self, request: Request | GetQueueView) -> Future[Any]:
        """Enqueue a request; the loop completes the returned future. Once the loop has stopped, it fails at
        once with :class:`ManagerUnavailable` ("the manager is stopping")."""
        return self.inbox.call_async(request)

    def subscribe(self) -> Any:
        """A live-view queue; it ends (None) when the loop stops, at once if it has stopped already."""
        return self.watchers.subscribe()

    def unsubscribe(self, q: Any) -> None:
        self.watchers.unsubscribe(q)

    @property
    def queue_notes(self) -> Callable[[QueueNote], None] | None:
        """The queue agent's inbox: what a cluster task did here (called on the loop thread)."""
        return self.cluster.notes

    @queue_notes.setter
    def queue_notes(self, sink: Callable[[QueueNote], None] | None) -> None:
        self.cluster.notes = sink

    @property
    def queue_stats(self) -> Callable[[], QueueStats] | None:
        """The queue agent's figures (a frozen snapshot; read on the loop thread for ``Stats``)."""
        return self.cluster.stats_source

    @queue_stats.setter
    def queue_stats(self, source: Callable[[], QueueStats] | None) -> None:
        self.cluster.stats_source = source

    @property
    def events_received(self) -> int:
        return self.inbox.received

    @property
    def events_rejected(self) -> int:
        return self.inbox.rejected

    @property
    def events_dropped(self) -> int:
        return self.inbox.dropped

    @property
    def messages_dropped(self) -> int:
        return self.workers.messages_dropped

    @property
    def watch_events_dropped(self) -> int:
        return self.watchers.dropped

    def task_dir(self, task_id: str) -> Path:
        return self.paths.task_dir(task_id)

    def slot_stats(self) -> list[BubbleSlotStats]:
        return self.core.slot_stats()

    def watch_addresses(self, watch: AddressWatch) -> None:
        """Check, with the state directory, the files trainers and clients reach this manager by (set before
        the loop runs)."""
        self._addresses = watch

    def listen_locally(self, local: LocalEvents) -> None:
        """Select on a local trainer's event datagrams (:mod:`freeride._local_events`); closed when the loop stops."""
        self._local = local
        self._selector.register(local.fileno(), selectors.EVENT_READ, self._read_local)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT only enqueue a shutdown: drain (every task checkpointed), then stop.

        SIGTERM always stops this way, however often it comes (service managers, Slurm and
        Kubernetes may repeat it): a drain is idempotent, and tasks that ignore their stop are
        killed after the stop timeout. Only a second SIGINT (Ctrl-C twice at a terminal) stops at
        once, killing the workers without checkpoints.
        """

        def handler(signum: int, frame: object) -> None:
            self.post(Shutdown(immediate=signum == signal.SIGINT and self._stop_after_drain))

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # ------------------------------------------------------------------ select, timers, dispatch

    def run(self) -> None:
        self.poller.start()  # its first reading comes at once
        # After the poller's thread started: only this thread wakes for bubbles (workers put theirs back).
        short = set_time_slice(LOOP_TIME_SLICE_NS)
        how = ["short time slice"] if short else []
        if self._event_spin_ns:
            how.append(f"awake {self._event_spin_ns / 1000:g} us after each trainer event")
        log.info("[%s] manager loop running%s", self.device, f" ({'; '.join(how)})" if how else "")
        while self._running:
            for key, _ in self._selector.select(self._timeout_s()):
                for event in key.data():
                    self._dispatch(event)
            self._take_inbox()
            self._timers()
            if self.core.wants_tick(self.now_ns()):
                self._feed(C.Tick())
            self._follow_local()
        self._close()

    def _follow_local(self) -> None:
        """Read a local trainer's events at each one while a task could take a grant (its descriptor in the
        selector), else every :data:`LAZY_READ_NS`, waking no one at a send (out of the selector). Back in it,
        whatever waits is read at once: the task that came may take the bubble now open."""
        local = self._local
        if local is None or not self._running:
            return
        self.quiet.publish(self.core.quiet_slots())
        every = self.config.idle_read_ns
        eager = not every or self.core.wants_trainer_events()
        if eager != self._local_eager:
            self._local_eager = eager
            if eager:
                self._selector.unregister(local.listener_fileno())
                self._selector.register(local.fileno(), selectors.EVENT_READ, self._read_local)
                self._read_local(lazy=True)  # read now, but they waited: not timed as their delay
                return
            self._selector.unregister(local.fileno())
            # New trainers are still taken at once: the lazy reads are due only while some are connected.
            self._selector.register(local.listener_fileno(), selectors.EVENT_READ, self._accept_local)
            self._lazy_read_at_ns = self.now_ns() + every
        if not eager and self.now_ns() >= self._lazy_read_at_ns:
            self._read_local(lazy=True)
            self._lazy_read_at_ns = self.now_ns() + every

    def _accept_local(self) -> list[Any]:
        """A trainer connected while the loop reads local events late (the selector's callback)."""
        if self._local is not None:
            self._local.accept()
        return []

    def _timeout_s(self) -> float:
        if self.inbox.has_work():
            return 0
        now = self.now_ns()
        if now < self._spin_until_ns and self._still_spinning(now):
            return 0  # awake for the trainer's next event (LoopConfig.event_spin_ns)
        deadline = now + IDLE_WAKE_NS
        if not self._local_eager and self._local is not None and self._local.connections:
            deadline = min(deadline, self._lazy_read_at_ns)
        core_timer = self.core.next_timer_ns()
        if self._timer is not None:
            freeze = self.core.next_freeze_ns()
            if freeze is not None and freeze - FREEZE_LEAD_NS <= now:
                return 0  # due within the lead: turn until it is (FREEZE_LEAD_NS)
            if freeze is not None and core_timer is not None and freeze <= core_timer + FREEZE_LEAD_NS:
                core_timer = freeze - FREEZE_LEAD_NS
            self._timer.arm(core_timer)
        for timer in (core_timer, self.workers.next_timer_ns(), self.durability.next_timer_ns()):
            if timer is not None and timer < deadline:
                deadline = timer
        return max(0.0, (deadline - now) / 1e9)

    def _read_local(self, lazy: bool = False) -> list[Any]:
        """Feed every local datagram waiting (the selector's callback, and before each chunk of wire events:
        a connection's datagrams all precede its wire events, see :mod:`freeride._local_events`).

        Each is validated as an event from the wire is; one that is not an event is counted as rejected. An
        end first sets its worker's word and arms the freeze at the trainer's own end + grace
        (:meth:`EndPath.local_end`), then parks as an end from the wire does. ``lazy``: a read of
        :meth:`_follow_local`'s, up to :data:`LAZY_READ_NS` after the events: not timed as their delay, no spin
        after it."""
        local = self._local
        if local is None:
            return []
        datagrams = local.read_from()
        if not datagrams:
            return []
        received_ns = self.now_ns()
        latest_ns = received_ns + MAX_CLOCK_AHEAD_NS
        events: list[TrainerEvent] = []
        jobs: list[str] = []  # the job each came from, as its connection's layout named it
        held: list[bool] = []  # read late on purpose (a lazy read, or a quiet slot's: QuietSlots): not timed
        for connection, data in datagrams:
            try:
                event = decode(data)
                if isinstance(event, TrainerLayout):
                    validate_layout(event, latest_ns)
                    local.set_job(connection, event.job)
                else:
                    validate_bubble_event(event, latest_ns)
            except ConfigError as exc:
                self._reject_local(exc, received_ns)
                continue
            events.append(event)
            jobs.append(local.job(connection))
            held.append(lazy or sent_late(data))
        self.inbox.count_received(len(events))
        self.events_late += sum(held)
        inputs = with_ends_known([self._trainer_input(event, received_ns, job)
                                  for event, job in zip(events, jobs, strict=True)])
        for event, given, late in zip(events, inputs, held, strict=True):
            if not self._running:
                break
            now = self.now_ns()
            if isinstance(event, BubbleEnd):
                for seen in self.ends.local_end(event, received_ns):
                    self._feed(seen, now)
            self._feed_trainer(given, now, timed=not late)
        return []

    def _feed_trainer(self, event: _TrainerInput, now_ns: int, timed: bool = True) -> None:
        """Feed a trainer's event, timing a bubble event's delay from the trainer's own stamp (``event_delay``).

        Not a layout's: its time is when the layout took effect, and a reporter tells the last one again at
        each connection (a manager restarted under a running trainer read 6-19 s of "delay" from it). Not an event
        read late on purpose (``timed`` False: :data:`LAZY_READ_NS`), nor does the loop spin after one."""
        if not timed:
            self._feed(event, now_ns)
            return
        if isinstance(event, C.BubbleStarted):
            self.event_delay.record(now_ns - event.bubble.start_ns)
        elif isinstance(event, C.BubbleEnded):
            self.event_delay.record(now_ns - event.bubble.end_ns)
        if self._event_spin_ns and now_ns >= self._spin_off_until_ns:
            if now_ns >= self._spin_until_ns:  # a new spin (not one this event extends): a new baseline
                self._spin_check_ns, self._spin_delay = 0, None
            self._spin_until_ns = now_ns + self._event_spin_ns
        self._feed(event, now_ns)

    def _still_spinning(self, now_ns: int) -> bool:
        """Whether the spin goes on: not once the loop's thread waited for its core while it spun.

        A loop that never sleeps is, to the kernel, a busy task like any other: on a core where something else
        runs (another manager, the reporter's threads, a job's process) it waits its turn, and a trainer event
        that comes meanwhile waits with it. A probe measured the spin's rarest event delays at 2.7-4.6 ms (p99.9)
        against 1.3-1.5 ms asleep, where a sleeping loop woken by an event runs at once. So while it spins the loop
        reads its own run delay every :data:`SPIN_CHECK_NS`, and where that grew by more than
        :data:`SPIN_GIVE_WAY_NS` it stops spinning for a back-off (:data:`SPIN_BACKOFF_NS`, doubled at each
        give-way up to :data:`MAX_SPIN_BACKOFF_NS`, short again after :data:`SPIN_QUIET_NS` without one): it is
        preempted inside a spin before it can tell, so giving way only until the next event changed nothing on a
        shared core (``bench.bench_spin``). The threshold is a preemption's, not the few microseconds other
        threads of the manager or the kernel take now and then, which cost the spin most of its use."""
        if now_ns < self._spin_check_ns:
            return True
        self._spin_check_ns = now_ns + SPIN_CHECK_NS
        reading = self._spin_reading()
        last, self._spin_delay = self._spin_delay, reading
        if reading is None or last is None:
            return True
        # What the loop waited for its core, less what the manager's other threads ran meanwhile (its gRPC
        # threads, its watchdog, on the same core): those are its own work, which a core of its own also runs.
        waited = (reading[0] - last[0]) - ((reading[1] - last[1]) - (reading[2] - last[2]))
        if waited <= SPIN_GIVE_WAY_NS:
            return True
        self._spin_until_ns = 0
        if now_ns - self._spin_gave_way_ns >= SPIN_QUIET_NS:
            self._spin_backoff_ns = SPIN_BACKOFF_NS  # the last contention was long ago: start short again
        self._spin_gave_way_ns = now_ns
        self._spin_off_until_ns = now_ns + self._spin_backoff_ns
        self._spin_backoff_ns = min(2 * self._spin_backoff_ns, MAX_SPIN_BACKOFF_NS)
        self.spins_given_way += 1
        if self.spins_given_way == 1:
            log.info("[%s] --event-spin-us gives way: the loop waited %.0f us for its core while it spun; it stops "
                     "spinning for a while whenever another process wants the core (said once)",
                     self.device.name, waited / 1000)
        return False

    def _spin_reading(self) -> tuple[int, int, int] | None:
        """The loop thread's run delay, the process's CPU time and the loop thread's (ns); None where the run
        delay cannot be read."""
        delay = self._run_delay.read()
        if delay is None:
            return None
        return delay, time.process_time_ns(), time.thread_time_ns()

    def _reject_local(self, exc: ConfigError, now_ns: int) -> None:
        """Count a local message that is no event; log it, or, within ``LOCAL_REJECT_LOG_INTERVAL_NS`` of the
        last line, only count it for the next."""
        self.inbox.reject()
        self._local_rejects_unlogged += 1
        if now_ns < self._local_reject_log_ns:
            return
        n, self._local_rejects_unlogged = self._local_rejects_unlogged, 0
        self._local_reject_log_ns = now_ns + LOCAL_REJECT_LOG_INTERVAL_NS
        what = "a local trainer message was" if n == 1 else f"{n} local trainer messages were"
        log.warning("[%s] %s rejected (counted in the statistics; the next such line within %d s at most), "
                    "last: %s", self.device, what, LOCAL_REJECT_LOG_INTERVAL_NS // 1_000_000_000, exc)

    def _take_inbox(self) -> None:
        """One turn's share of the inbox: every waiting item, then up to ``BUBBLES_PER_TURN`` bubble events."""
        for item in self.inbox.items():
            self._dispatch(item)
        budget = BUBBLES_PER_TURN
        while budget > 0 and self._running and self.inbox.has_chunks():
            # A connection's datagrams precede its wire events (the selector reads the rest); read late on purpose
            # while nothing could be decided on them (_follow_local): not timed then.
            self._read_local(lazy=not self._local_eager)
            chunk = self.inbox.take_chunk()
            if chunk is None:
                break
            for event in with_ends_known(chunk):
                if isinstance(event, C.BubbleEnded):
                    for seen in self.ends.stopped_end(event.bubble):  # only where the trainer stopped the worker
                        self._feed(seen)
                self._feed_trainer(event, self.now_ns())
            budget -= len(chunk)

    def _timers(self) -> None:
        now = self.now_ns()
        if now >= self._next_parked_check_ns:
            self._next_parked_check_ns = now + PARKED_CPU_CHECK_NS
            self._check_parked_cpu(now)
        self.durability.poll(now)
        if now >= self._next_home_check_ns:
            self._next_home_check_ns = now + HOME_CHECK_NS
            if self._state_lock is not None and self.durability.check_home(self._state_lock, self._records_now,
                                                                           self._live_task_dirs):
                self.workers.reopen_logs()
            if self._addresses is not None:
                self._addresses.check()
        if self.trace is not None:
            self.trace.poll(now)
        for event in self.workers.poll(now):
            self._dispatch(event)

    def _records_now(self) -> list[TaskRecord]:
        """Every task of this manager's own store as it is now (its record, updated from the core for a task
        this run knows): what a store made again holds (:meth:`Durability.check_home`)."""
        out = []
        now = time.time()
        for tid, meta in self.durability.records.items():
            if is_cluster_id(tid):
                continue  # the queue holds it, not the store
            task = self.core.tasks.get(tid)
            if task is not None:
                meta = dataclasses.replace(meta, spec=task.spec, state=task.state.value, figures=figures_of(task),
                                           checkpoint_path=task.checkpoint_path, failure=self.failures.of(task),
                                           updated_unix_s=now)
            out.append(meta)
        return out

    def _live_task_dirs(self) -> list[Path]:
        return [self.paths.task_dir(tid) for tid, task in self.core.tasks.items()
                if not task.state.is_terminal and not is_cluster_id(tid)]

    def _check_parked_cpu(self, now_ns: int) -> None:
        """Read the CPU time of every parked worker; one that used :data:`OUTSIDE_GRANTS_SHARE` of the time since
        the last reading, still parked and granted nothing meanwhile, runs threads of its own between its steps
        (a prefetcher, a spinner started in setup()): found using 27% of a core, parked, beside the trainer. Its
        worker is stopped whenever it parks from then on (:meth:`Supervisor.hold_while_parked`).

        Not a task being stopped: its checkpoint (a drain's, an eviction's) is written parked, outside any grant,
        and takes the CPU it takes. Held for it, a task of a 200 MiB state was stopped mid-checkpoint by the drain
        at the end of a `launch` and killed at the stop timeout, its work since its last checkpoint lost."""
        readings: dict[str, tuple[int, int, int]] = {}
        for task in self.core.tasks.values():
            if task.state is not TaskState.PARKED or task.stopping or self.workers.holds_while_parked(task.task_id):
                continue
            cpu = self.workers.cpu_ns(task.task_id)
            if cpu is None:
                continue
            readings[task.task_id] = (cpu, now_ns, task.grant_id)
            last = self._parked_cpu.get(task.task_id)
            if last is None or last[2] != task.grant_id or now_ns <= last[1]:
                continue
            used, wall = cpu - last[0], now_ns - last[1]
            if used >= OUTSIDE_GRANTS_MIN_NS and used >= OUTSIDE_GRANTS_SHARE * wall:
                log.warning("[%s task=%s] used %.0f ms of CPU in %.0f ms while parked: threads of its own run "
                            "between its steps, taking the device from training. Its worker is stopped whenever "
                            "it parks from now on (start no threads that run outside step(), or stop them before "
                            "it returns)", self.device, task.task_id, used / 1e6, wall / 1e6)
                self.workers.hold_while_parked(task.task_id)
        self._parked_cpu = readings

    def _dispatch(self, item: Any) -> None:
        """Route one input: a request, the loop's own control, a component's notice, or a core event."""
        if isinstance(item, tuple):
            self._answer(*item)
        elif isinstance(item, StepsReported):
            self.ends.reported(item.parked.grant_id)
            if self.trace is not None:
                self.trace.steps(item.task_id, item.parked)
        elif isinstance(item, Shutdown):
            self._shutdown(item)
        elif isinstance(item, ClaimedTask):
            for event in self.cluster.claimed(item.record, item.epoch):
                self._feed(event)
        elif isinstance(item, (ReleaseTask, QueueCancel)):
            for event in self.cluster.request(item):
                self._feed(event)
        else:
            self._feed(item)
            if isinstance(item, C.DeviceStatusChanged):
                self.on_device_state(item.problem)

    def _feed(self, event: Any, now_ns: int | None = None) -> None:
        """Feed one event to the core and apply its actions; what the components answer them with is
        dispatched after every action is applied.

        A grant that only records come before (a bubble's start: the task's PARKED -> RUNNING, a note) is
        sent first, and the records after it, in their order: on a core the trainer's host work shares, each
        microsecond of the loop's before the grant was about two of the bubble's before the worker could
        start (``decision`` in :mod:`freeride.harvest`)."""
        now = self.now_ns() if now_ns is None else now_ns
        due = self.core.next_freeze_ns()
        if due is not None and due <= now and not isinstance(event, C.TrainerEndSeen):
            # The core freezes a step on its timer in this event (any event fires the timers due): first, whether
            # the trainer stopped that worker at its end already, the end's message still unread, so that the
            # freeze is booked when it was (EndPath.stopped_before_freeze).
            for seen in self.ends.stopped_before_freeze():
                self._feed(seen, now)
        try:
            actions = self.core.on_event(event, now)
        except Exception:
            # A bug in policy must not take the manager down; the event is dropped and logged.
            log.exception("[%s] core failed on %r", self.device, event)
            return
        trace = self.trace
        follow: list[Any] | None = None
        early: C.Grant | None = None
        stamp: dict[str, int] | None = None
        if len(actions) > 1 and type(actions[-1]) is C.Grant and all(type(a) in _RECORDS for a in actions[:-1]):
            early = actions[-1]
            actions = actions[:-1]
            if trace is not None:
                stamp = trace.sent(early)  # its time is when it went, though it is written after the records
            follow = self._apply_one(early)
        if trace is not None:
            trace.event(event)
        for action in actions:
            # A grant is stamped as it goes, before the trainer can stop its worker (the stop record is armed as it is
            # sent): stamped once applied, a loop that lost its core between the two wrote a grant after the stop
            # of its own worker, and the trace's reader gave that freeze to the grant before (a hold of 65 ms read
            # where the trainer had stopped the worker 10 us past the end).
            sent = trace.sent(action) if trace is not None and type(action) is C.Grant else None
            more = self._apply_one(action)
            if trace is not None:
                # Once applied: a freeze's worker CPU time is read after it was sent.
                trace.action(action, sent)
            if more:
                follow = more if follow is None else follow + more
        if early is not None and trace is not None:
            trace.action(early, stamp)
        if self.watchers.queues and isinstance(event, (C.BubbleStarted, C.BubbleEnded)):
            self.watchers.publish(TaskEvent(time.time(), bubble=event.bubble))
        if follow:
            for more_event in follow:
                self._dispatch(more_event)

    def _apply_one(self, action: Any) -> list[Any] | None:
        """Apply one action; one that fails is logged (the loop goes on) and answers nothing."""
        try:
            return self._apply_by_type[type(action)](action)
        except Exception:
            log.exception("[%s] failed to apply %r", self.device, action)
            return None

    # ------------------------------------------------------------------ actions

    def _grant(self, action: C.Grant) -> list[Any]:
        # The grant goes out before a frozen worker is thawed: its interrupted step then ends with the new
        # grant waiting, rather than with the old grant's ended word alone.
        tid = action.task_id
        if action.trainer_ends:  # before the grant goes out: its worker may begin a step (or go on with one) at once
            self.ends.arm_stop(tid, action.grant_id, action.bubble_key, action.bubble_start_ns, self.workers.pid(tid),
                               self.workers.command_group(tid))
        events = self.workers.send(tid, W.Grant(action.grant_id, action.deadline_ns, action.margin_ns,
                                                probe=action.probe, rank=action.rank,
                                                bubble_start_ns=action.bubble_start_ns,
                                                trainer_ends=action.trainer_ends, survival_ns=action.survival_ns,
                                                grace_ns=action.grace_ns))
        if action.thaw:
            self.workers.signal(tid, signal.SIGCONT)
        self.workers.granted(tid)  # after the grant is on its way: the worker does not wait for this reading
        if action.trainer_ends:
            self.ends.granted(tid, action.grant_id, action.bubble_key, action.bubble_start_ns, self.workers.board(tid))
        return events

    def _park(self, action: C.Park) -> list[Any]:
        handle = self.workers.workers.get(action.task_id)
        if handle is None:
            return []
        self.ends.parked(handle.board, action.grant_id, action.end_ns, action.end_received_ns)
        return self.workers.send(action.task_id, W.Park(action.grant_id))

    def _freeze(self, action: C.Freeze) -> list[Any]:
        self.ends.grant_over(action.task_id)
        return self.workers.freeze(action.task_id)

    def _stop(self, action: C.Stop) -> list[Any]:
        # The trainer's stop armed for its grant is taken back first: made at the bubble's end after this, it stopped
        # the worker in its checkpoint, and nothing continued it (no message came after the stop), so a drain beside
        # a running job killed it past the stop timeout, its work since the last checkpoint lost (a stranger's; a CI
        # run's). One the trainer made already is read here and continued by the message.
        self.ends.grant_over(action.task_id)
        if action.checkpoint and self._in_setup(action.task_id):
            # Setup cannot read the stop: continued, it ran on to its end (outside every bubble, beside training)
            # or to the stop timeout, and either way its next start sets up again. Killed now, nothing is lost.
            log.info("[%s task=%s] stopped in setup(): nothing to checkpoint yet (its next start sets up again); its "
                     "worker is killed now", self.device, action.task_id)
            self.workers.signal(action.task_id, signal.SIGKILL)
            return []
        events = self.workers.send(action.task_id, W.Stop(action.checkpoint))
        self.workers.signal(action.task_id, signal.SIGCONT)  # a frozen worker must run to obey
        return events

    def _in_setup(self, task_id: str) -> bool:
        """Whether ``task_id``'s worker is inside its setup (granted, and its board says no step has begun in this
        process: setup, or restoring its checkpoint)."""
        task = self.core.tasks.get(task_id)
        board = self.workers.board(task_id)
        if task is None or board is None or task.state not in (TaskState.RUNNING, TaskState.FROZEN):
            return False
        try:
            return board.step() < 0
        except (OSError, ValueError):  # a closed mapping: as if unknown
            return False

    def _thaw(self, action: C.Thaw) -> None:
        self.workers.signal(action.task_id, signal.SIGCONT)

    def _kill(self, action: C.Kill) -> None:
        self.workers.signal(action.task_id, signal.SIGKILL)

    def _state_changed(self, action: C.StateChanged) -> None:
        tid = action.task_id
        if action.new is TaskState.PARKED:
            self.workers.parked(tid)  # stopped until its next message, if its threads ran while parked
        log.debug("[%s task=%s] %s -> %s (%s)", self.device, tid, action.old.value if action.old else "-",
                  action.new.value, action.reason)
        task = self.core.tasks.get(tid)
        if action.failure is not None and not action.failure.at_unix_s:
            # The pure core has no wall clock and cannot see the worker's step board or log: complete it.
            failure = stamped(action.failure, self.paths.board_step(tid), lambda: self.workers.log_tail(tid))
            if task is not None and task.failure is not None:
                self.failures.completed(tid, task.failure, failure)
            action = dataclasses.replace(action, failure=failure)
        if tid in self.cluster:
            self.cluster.state_changed(action)
        else:
            self.durability.state_changed(action, task)
        if self.watchers.queues and task is not None:
            # The core may have moved on within the same event (SUBMITTED -> STARTING): report the
            # state this change produced, so viewers see every transition.
            info = self.views.info(tid)
            self.watchers.publish(TaskEvent(time.time(), task=dataclasses.replace(info, state=action.new.value)))

    def _checkpoint_recorded(self, action: C.CheckpointRecorded) -> None:
        if action.task_id in self.cluster:
            return  # the queue agent reads it from the core at its next poll
        self.durability.checkpoint_recorded(action, self.core.tasks.get(action.task_id))

    def _drain_complete(self, action: C.DrainComplete) -> None:
        if not self._stop_after_drain and not self._said_drained:  # a drain asked again completes again, unsaid
            self._said_drained = True
            log.warning("[%s] drained: no task is resident; it takes none until it is stopped and started again",
                        self.device)
        for future in self._drain_waiters:
            if not future.done():
                future.set_result(None)
        self._drain_waiters.clear()
        if self._stop_after_drain:
            self._running = False

    def _note(self, action: C.Note) -> None:
        # The core does no I/O: what it would log comes back as a note.
        log.log(action.level, "[%s%s] %s", self.device, f" task={action.task_id}" if action.task_id else "",
                action.message)

    # ------------------------------------------------------------------ requests

    def _answer(self, request: Any, future: Future[Any]) -> None:
        try:
            if isinstance(request, Drain):
                self._drain(future)
                return
            reply = self.views.answer(request)
            for event in reply.events:
                self._feed(event)
            future.set_result(reply.answer())
        except Exception as exc:  # every request error goes back to its caller
            if not future.done():
                future.set_exception(exc)

    def _drain(self, future: Future[Any]) -> None:
        """Answer (tasks parked, of them checkpointed at their last step) once nothing is resident."""
        # The tasks themselves, not their ids: a cluster task leaves the core once handed back to the queue, and
        # a queue manager's drain read "3 parked, 0 checkpointed" of tasks it had checkpointed and killed.
        stopping = [t for t in self.core.tasks.values() if t.state.is_resident]

        def counted() -> tuple[int, int]:
            # A task stopped in its setup has no checkpoint to claim (stranger trial: it was counted). One killed
            # past the stop timeout is said to be (a stranger's drain read "2 parked, 2 checkpointed").
            return (sum(1 for t in stopping if t.checkpoint_path and t.checkpoint_step >= t.steps),
                    sum(1 for t in stopping if t.killed_at_stop))

        self._drain_waiters.append(_chain(future, len(stopping), counted))
        if not self.core.draining:  # a stranger found nothing in the log of a drain (a SIGTERM's stop says itself)
            log.warning("[%s] draining (`freeride drain`): parking and checkpointing %d resident task(s); no new task "
                        "is taken, and the manager stays up, drained, until it is stopped", self.device,
                        len(stopping))
        self._start_drain()

    def _start_drain(self) -> None:
        announce = not self.core.draining
        self._feed(C.DrainRequested())
        if announce:
            self.on_draining()

    def _shutdown(self, request: Shutdown) -> None:
        self.on_shutdown(request.immediate)
        if request.immediate:
            log.warning("[%s] stopping now: killing workers without checkpoints", self.device)
            self.workers.kill_all()
            self._running = False
            return
        log.info("[%s] stopping: parking and checkpointing every task", self.device)
        self._stop_after_drain = True
        self._start_drain()

    def _counters(self) -> Counters:
        return Counters(self.started_unix, self.inbox.received, self.inbox.rejected, self.inbox.dropped,
                        self.workers.messages_dropped, self.event_delay.percentiles(), self.ends.end_to_worker_ms(),
                        self.ends.trainer_stops, self.events_late)

    # ------------------------------------------------------------------ shutdown

    def _close(self) -> None:
        self.inbox.close()  # from now on calls are refused at once, and streams waiting for room give up
        stopping = ManagerUnavailable("the manager is stopping")
        for future in self._drain_waiters:
            if not future.done():
                future.set_exception(stopping)
        self._drain_waiters.clear()
        self.poller.stop()
        if self._local is not None:
            self._local.close()
        if self._addresses is not None:
            self._addresses.close()
        self.ends.close()  # before the workers are reaped: no trainer signals their pids from now on
        self.quiet.close()
        self.workers.close()
        self.durability.close()
        self.watchers.close()
        if self.trace is not None:
            self.trace.close()
        # The eventfd stays open: gRPC threads and scrapes may still post until the server has
        # stopped. release() closes it once nothing can post any more.
        self._selector.close()
        if self._timer is not None:
            self._timer.close()
        log.info("[%s] manager loop stopped", self.device)

    def release(self) -> None:
        """Close the wake-up eventfd; call after every thread that could post has stopped."""
        self.inbox.release()

    def stop(self) -> None:
        """Stop without draining (tests, and a manager that must go now)."""
        self.post(Shutdown(immediate=True))


def _chain(future: Future[Any], parked: int, counted: Callable[[], tuple[int, int]]) -> Future[Any]:
    """A drain waiter: completing it answers ``future`` with (tasks parked, of them checkpointed at their
    last step, of them killed past the stop timeout), or with its error. ``counted`` gives the last two when
    the drain completes."""
    inner: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        if future.done():
            return
        error = f.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result((parked, *counted()))

    inner.add_done_callback(done)
    return inner
