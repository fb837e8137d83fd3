"""The manager loop: the thin shell that owns sockets, timers and processes around the core.

One thread runs :meth:`ManagerLoop.run`: it waits in a single ``select`` on an eventfd (posted
events from gRPC threads and signal handlers), every worker's channel and every worker's pidfd,
with a timeout equal to the next timer. Each wake-up feeds events to the pure
:class:`~freeride._manager.core.SchedulerCore` and carries out the actions it returns. gRPC
servicers never touch state: they :meth:`post` events (fire and forget) or :meth:`call` a request
and wait for the loop's answer.

Bubble events arrive in batches (one per trainer message, :meth:`ManagerLoop.post_bubbles`): a batch
costs one append to the loop's bubble inbox and one eventfd wake-up, and the loop then feeds its
events to the core one at a time, in order, timing each one's delay from the trainer's timestamp
(``event_delay``). The bubble inbox holds a bounded number of events; a stream that outpaces the
loop is held back rather than buffered (see ``post_bubbles``). Each turn of the loop handles every
waiting request first and then at most ``BUBBLES_PER_TURN`` bubble events, so that under a flood
worker messages, timers and control calls still get a turn every few milliseconds.

Workers: ``python -m freeride._worker`` in a new session (so one ``killpg`` reaches the worker and
whatever it spawned), with one end of a SEQPACKET socketpair, ``PR_SET_PDEATHSIG`` and the
channel's end-of-file tying its life to the manager's. Their output goes to a pipe that the loop
drains into ``<state>/tasks/<id>/worker.log``, bounded in size and rotated
(:mod:`freeride._manager.worker_log`); its tail becomes part of a failure record. A worker's process
group dies with it (whatever it spawned is killed when it is reaped), and processes that a killed
manager's workers left behind are killed by the next manager (:mod:`freeride._manager.orphans`).

The state directory may stop taking writes (full, read-only, failing disk). Training is served as
before; a store write that fails is kept and retried every ``store_retry_ms`` (writes are absolute,
so only the latest per task and kind is kept), and while any is pending, submissions are refused
with :class:`~freeride.errors.StateNotWritable`: a task is acknowledged only once it is on disk.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import queue
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freeride import _channel as W
from freeride import _checkpoints
from freeride._boards import WorkerBoard, read_step
from freeride._channel import Channel, ChannelClosed, ChannelFull, ProtocolError, socketpair
from freeride._cluster.placement import Capacity
from freeride._cluster.records import CancelTask as QueueCancel
from freeride._cluster.records import ClaimedTask, GetQueueView, QueueNote, QueueView, ReleaseTask, is_cluster_id
from freeride._manager import core as C
from freeride._manager import orphans
from freeride._manager.device_poller import DevicePoller
from freeride._manager.histogram import LatencyHistogram
from freeride._manager.store import TaskStore
from freeride._manager.trace import TraceWriter
from freeride._manager.worker_log import CHUNK_BYTES, WorkerLog, check_limits, read_tail_bytes
from freeride.devices import Device
from freeride.devices.cuda import MIN_ALLOCATOR_BYTES
from freeride.errors import ConfigError, ManagerUnavailable, RequestRejected, StateNotWritable, TaskNotFound
from freeride.messages import (
    BubbleEnd,
    BubbleSlotStats,
    BubbleStart,
    FailureRecord,
    ManagerStats,
    Percentiles,
    TaskEvent,
    TaskInfo,
    TaskProgress,
    TaskRecord,
    TaskSpec,
    TrainerEvent,
    TrainerLayout,
)
from freeride.states import TaskState
from freeride.units import format_mib

log = logging.getLogger(__name__)

_TASK_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
LOG_TAIL_BYTES = 4096
#: Bubble events fed to the core per turn of the loop at most (a few ms of work), and the size of
#: the chunks ``post_bubbles`` cuts larger batches into.
BUBBLES_PER_TURN = 256
#: The loop wakes at least this often with nothing to do (every event, timer and message wakes it
#: anyway): a bound on how long a lost wake-up could go unnoticed, not a poll.
IDLE_WAKE_NS = 1_000_000_000

_TrainerInput = C.BubbleStarted | C.BubbleEnded | C.LayoutChanged

#: How often the loop hands a ``--trace`` file's buffer to the kernel.
TRACE_FLUSH_INTERVAL_NS = 1_000_000_000


@dataclass(frozen=True)
class _HotGrant:
    """The grant a trainer's end may end before the loop sees that end (see ``post_bubbles``)."""

    grant_id: int
    bubble_key: tuple[int, int, int, int]
    start_ns: int
    board: WorkerBoard


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
    #: measured in ``bench/bench_load.py``, under 1 MiB. See :meth:`ManagerLoop.post_bubbles`.
    max_pending_events: int = 2048
    store_retry_ms: float = 1000.0
    #: This host as the cluster names it: in a layout's stage map (``node/cuda:0``) and in the queue.
    node: str = field(default_factory=socket.gethostname)
    #: Where cluster tasks checkpoint (``--checkpoint-dir``, shared by every node): ``<dir>/<task id>/``,
    #: so that a task reclaimed elsewhere resumes from the newest checkpoint its last holder wrote.
    checkpoint_root: Path | None = None
    #: A worker's log is rotated when it would grow past this; ``worker_log_backups`` older ones are kept.
    worker_log_max_bytes: int = 8 * 2**20
    worker_log_backups: int = 1
    #: The trainer's end board (:class:`freeride._boards.EndBoard`), made by the daemon next to its unix
    #: socket; workers read it. None: ends reach workers through the manager only.
    end_board_path: Path | None = None

    def __post_init__(self) -> None:
        for name in ("memory_poll_ms", "device_poll_ms", "eof_grace_ms", "max_pending_events", "store_retry_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        check_limits(self.worker_log_max_bytes, self.worker_log_backups)


# ---------------------------------------------------------------- requests (call)


@dataclass(frozen=True)
class SubmitTask:
    spec: TaskSpec


@dataclass(frozen=True)
class ListTasks:
    include_finished: bool


@dataclass(frozen=True)
class GetTask:
    task_id: str


@dataclass(frozen=True)
class CancelTask:
    task_id: str


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class GetBubbles:
    pass


@dataclass(frozen=True)
class Drain:
    pass


@dataclass(frozen=True)
class Shutdown:
    """Drain, then stop the loop (SIGTERM, SIGINT)."""

    immediate: bool = False


Request = SubmitTask | ListTasks | GetTask | CancelTask | GetStats | GetBubbles | Drain | GetQueueView


@dataclass
class WorkerHandle:
    task_id: str
    proc: subprocess.Popen[bytes]
    channel: Channel
    pidfd: int
    log: WorkerLog
    log_fd: int  # the read end of the worker's output pipe; -1 once closed
    board: WorkerBoard | None  # its step and ended-grant words (None: the state directory refused it)
    extra_pgids: list[int] = field(default_factory=list)
    closed: bool = False
    goodbye: bool = False  # the worker announced its exit: end-of-file is expected
    eof_at_ns: int = 0


class ManagerLoop:
    def __init__(self, device: Device, config: LoopConfig, now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.device = device
        self.config = config
        self.now_ns = now_ns
        self.core = C.SchedulerCore(config.core)
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"state directory {config.state_dir} is not writable: {exc}") from None
        self.store = TaskStore(config.state_dir / "tasks.db")
        self.started_unix = time.time()
        self.events_received = 0
        self.events_rejected = 0
        self.events_dropped = 0  # valid bubble events never handed to the core: the loop stopped first
        self.watch_events_dropped = 0  # live-view events a slow viewer's full queue did not take
        self.messages_dropped = 0
        #: Trainer timestamp -> handed to the core, for every bubble event (loop thread only).
        self.event_delay = LatencyHistogram()
        #: A bubble end received (the servicer's stamp) -> the running worker's ended-grant word set.
        #: Recorded by servicer threads and the loop thread: under its lock.
        self.end_to_worker = LatencyHistogram()
        self._end_lock = threading.Lock()
        #: Published by the loop thread at each grant that follows real ends, read by servicer threads.
        self._hot: _HotGrant | None = None
        self._pending_events = 0  # bubble events posted and not yet taken by the loop
        self._room = threading.Condition()  # guards _pending_events; notified when the loop takes some
        self._stopped = threading.Event()
        # Guards the check "stopped?" and the posting of a request, so that a request is either
        # answered by the loop, or failed by _close, or refused at once: never left unanswered.
        self._call_lock = threading.Lock()
        self.on_draining: Callable[[], None] = lambda: None
        #: Called on the loop thread with the device's problem when it stops answering, "" when it answers
        #: again (the daemon turns it into the health status).
        self.on_device_state: Callable[[str], None] = lambda problem: None
        self._inbox: collections.deque[Any] = collections.deque()
        self._bubbles: collections.deque[list[_TrainerInput]] = collections.deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_fd, selectors.EVENT_READ, ("wake", None))
        self._workers: dict[str, WorkerHandle] = {}
        self._meta: dict[str, TaskRecord] = {}
        #: Tasks claimed from the cluster queue and held here; never in the local store (Redis holds them).
        self._cluster: set[str] = set()
        #: Called on the loop thread, must not block: what a cluster task did here (the queue agent's inbox).
        self.queue_notes: Callable[[QueueNote], None] | None = None
        self._subscribers: list[queue.Queue[TaskEvent | None]] = []
        self._sub_lock = threading.Lock()
        self._drain_waiters: list[Future[Any]] = []
        self._stop_after_drain = False
        self._running = True
        self.poller = DevicePoller(device, self.post, config.memory_poll_ms, config.device_poll_ms)
        self._trace = TraceWriter(config.trace_path, str(device)) if config.trace_path else None
        self._next_trace_flush_ns = 0
        # Store writes the state directory refused, oldest first, and why (empty: all written).
        self._pending_writes: dict[tuple[str, str], Callable[[], None]] = {}
        self.store_fault = ""
        self._next_store_retry = 0
        self._recover()

    # ------------------------------------------------------------------ thread-safe entry points

    def post(self, event: Any) -> None:
        """Enqueue an event from any thread (or a signal handler); returns at once."""
        self._inbox.append(event)
        self._wake()

    def _wake(self) -> None:
        fd = self._wake_fd
        if fd < 0:
            return  # the loop has stopped: nothing will read the event
        try:
            os.eventfd_write(fd, 1)
        except OSError:  # the counter is saturated: the loop is awake anyway
            pass

    def post_bubble(self, event: TrainerEvent, received_ns: int) -> int:
        """Enqueue one valid bubble event; see :meth:`post_bubbles`."""
        return self.post_bubbles((event,), received_ns)

    def post_bubbles(self, events: Sequence[TrainerEvent], received_ns: int) -> int:
        """Enqueue valid bubble events, in order, with one wake-up of the loop per chunk.

        Called once per trainer message from that stream's gRPC thread. At most
        ``max_pending_events`` bubble events wait in the inbox: a stream that outpaces the loop
        waits here for room (the loop makes some each time it takes a batch), so gRPC stops reading
        it, its flow control holds the sender back, and the trainer's bounded reporter queue drops
        and counts what does not fit; the training thread itself never waits. Holding back rather
        than shedding here keeps every event the manager accepted, ends included, in order, and
        keeps the delay bounded (~50 ms of the loop's work) instead of letting stale starts pile up.
        A layout report travels the same way, in order with the bubbles around it. A batch larger
        than the bound goes in chunks. Returns how many events were not enqueued:
        those still waiting for room when the loop stopped. They, and the events the stopped loop
        left in its inbox, are counted in ``events_dropped``.
        """
        self._end_hot_grant(events, received_ns)
        limit = self.config.max_pending_events
        size = min(limit, BUBBLES_PER_TURN)
        with self._room:
            self.events_received += len(events)
        for first in range(0, len(events), size):
            chunk = [self._trainer_event(e, received_ns) for e in events[first:first + size]]
            with self._room:
                while self._pending_events + len(chunk) > limit and not self._stopped.is_set():
                    self._room.wait(0.1)
                if self._stopped.is_set():
                    lost = len(events) - first
                    self.events_dropped += lost
                    return lost
                self._pending_events += len(chunk)
            self._bubbles.append(chunk)
            self._wake()
        return 0

    def _end_hot_grant(self, events: Sequence[TrainerEvent], received_ns: int) -> None:
        """Set the ended-grant word of the worker that holds a bubble as soon as its end arrives.

        Runs on the stream's servicer thread, before the end even waits in the inbox: the loop's turn
        (a thread hand-off, the GIL, a busy loop) would otherwise stand between the manager receiving
        an end and the worker learning of it. It decides nothing the core would not: the loop publishes
        the grant (``_hot``) only under a policy that parks at real ends, and an end with that grant's
        bubble key, at or after its start, is what makes the core park it (the core still does, and
        the loop's write of the same word is then a no-op). A stale publication is harmless: grant ids
        only grow, and saying that an ended bubble ended changes nothing.
        """
        hot = self._hot
        if hot is None:
            return
        for event in events:
            if isinstance(event, BubbleEnd) and event.key == hot.bubble_key and event.end_ns >= hot.start_ns:
                try:
                    if hot.board.end_grant(hot.grant_id, event.end_ns):
                        with self._end_lock:
                            self.end_to_worker.record(self.now_ns() - received_ns)
                except ValueError:  # the worker was reaped and its board closed meanwhile
                    pass
                return

    def _trainer_event(self, event: TrainerEvent, received_ns: int) -> _TrainerInput:
        if isinstance(event, BubbleStart):
            return C.BubbleStarted(event, received_ns)
        if isinstance(event, TrainerLayout):
            return C.LayoutChanged(event, received_ns, event.hosts_stage(str(self.device), self.config.node))
        return C.BubbleEnded(event, received_ns)

    def call(self, request: Request, timeout_s: float = 10.0) -> Any:
        """Run a request on the loop thread and return its answer (or raise its error)."""
        return self.call_async(request).result(timeout=timeout_s)

    def call_async(self, request: Request) -> Future[Any]:
        """Enqueue a request; the loop completes the returned future (a caller may stop waiting).

        Once the loop has stopped, the future fails at once with :class:`ManagerUnavailable`
        ("the manager is stopping"); requests still queued when it stopped fail the same way.
        """
        future: Future[Any] = Future()
        with self._call_lock:
            if self._stopped.is_set():
                future.set_exception(ManagerUnavailable("the manager is stopping"))
                return future
            self.post((request, future))
        return future

    def subscribe(self) -> queue.Queue[TaskEvent | None]:
        """A live-view queue; it ends (None) when the loop stops, at once if it has stopped already."""
        q: queue.Queue[TaskEvent | None] = queue.Queue(maxsize=10_000)
        with self._sub_lock:
            if self._stopped.is_set():
                q.put_nowait(None)
            else:
                self._subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[TaskEvent | None]) -> None:
        with self._sub_lock:
            if q in self._subscribers:
                self._subscribers.remove(q)

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

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        log.info("[%s] manager loop running", self.device)
        self.poller.start()  # its first reading comes at once
        while self._running:
            timeout = self._timeout_s()
            for key, _ in self._selector.select(timeout):
                kind, handle = key.data
                if kind == "wake":
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                elif kind == "chan":
                    self._read_channel(handle)
                elif kind == "log":
                    self._read_log(handle)
                elif kind == "exit":
                    self._reap(handle)
            self._drain_inbox()
            self._polls()
            self._feed(C.Tick())
        self._close()

    def _timeout_s(self) -> float:
        now = self.now_ns()
        deadlines = [now + IDLE_WAKE_NS]
        timer = self.core.next_timer_ns()
        if timer is not None:
            deadlines.append(timer)
        deadlines += [h.eof_at_ns for h in self._workers.values() if h.eof_at_ns]
        if self._pending_writes:
            deadlines.append(self._next_store_retry)
        if self._inbox or self._bubbles:
            return 0
        return max(0.0, (min(deadlines) - now) / 1e9)

    def _drain_inbox(self) -> None:
        """One turn's share of the inbox: every waiting request, then up to ``BUBBLES_PER_TURN`` events."""
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, tuple):
                request, future = item
                try:
                    future.set_result(self._handle_request(request, future))
                except _Deferred:
                    pass
                except Exception as exc:  # every request error goes back to its caller
                    if not future.done():
                        future.set_exception(exc)
            elif isinstance(item, Shutdown):
                self._shutdown(item)
            elif isinstance(item, ClaimedTask):
                self._add_claimed(item.record)
            elif isinstance(item, ReleaseTask):
                self._feed(C.ReleaseRequested(item.task_id, item.reason, item.checkpoint))
            elif isinstance(item, QueueCancel):
                self._feed(C.CancelRequested(item.task_id))
            else:
                self._feed(item)
                if isinstance(item, C.DeviceStatusChanged):
                    self.on_device_state(item.problem)
        budget = BUBBLES_PER_TURN
        while budget > 0 and self._bubbles and self._running:
            chunk = self._bubbles.popleft()
            self._feed_bubbles(chunk)
            budget -= len(chunk)

    def _feed_bubbles(self, events: list[_TrainerInput]) -> None:
        """Feed one posted chunk to the core: each event on its own, in order, its delay recorded."""
        with self._room:
            self._pending_events -= len(events)
            self._room.notify_all()
        record = self.event_delay.record
        for event in events:
            now = self.now_ns()
            if isinstance(event, C.LayoutChanged):
                record(now - event.layout.at_ns)
            else:
                bubble = event.bubble
                record(now - (bubble.start_ns if isinstance(bubble, BubbleStart) else bubble.end_ns))
            self._feed(event, now)

    def _feed(self, event: Any, now_ns: int | None = None) -> None:
        try:
            actions = self.core.on_event(event, self.now_ns() if now_ns is None else now_ns)
        except Exception:
            # A bug in policy must not take the manager down; the event is dropped and logged.
            log.exception("[%s] core failed on %r", self.device, event)
            return
        if self._trace is not None:
            self._trace_event(event)
        self._apply(actions)
        if isinstance(event, (C.BubbleStarted, C.BubbleEnded)) and self._subscribers:
            self._publish(TaskEvent(time.time(), bubble=event.bubble))

    def _trace_event(self, event: Any) -> None:
        assert self._trace is not None
        if isinstance(event, C.BubbleStarted):
            b = event.bubble
            self._trace.write("bubble_start", stage=b.stage, rank=b.rank, iteration=b.iteration, slot=b.slot,
                              kind=b.kind, start_ns=b.start_ns, predicted_ns=b.predicted_ns,
                              received_ns=event.received_ns, **({"learned": True} if b.learned else {}))
        elif isinstance(event, C.BubbleEnded):
            e = event.bubble
            self._trace.write("bubble_end", stage=e.stage, rank=e.rank, iteration=e.iteration, slot=e.slot,
                              end_ns=e.end_ns, received_ns=event.received_ns)
        elif isinstance(event, C.LayoutChanged):
            lay = event.layout
            self._trace.write("layout", schedule=lay.schedule, stages=lay.stages, microbatches=lay.microbatches,
                              stage_devices=list(lay.stage_devices), at_ns=lay.at_ns, received_ns=event.received_ns)

    def _trace_action(self, action: C.Action) -> None:
        assert self._trace is not None
        if isinstance(action, C.Grant):
            self._trace.write("grant", task=action.task_id, grant=action.grant_id, deadline_ns=action.deadline_ns,
                              thaw=action.thaw, at_ns=self.now_ns())
        elif isinstance(action, C.Park):
            self._trace.write("park", task=action.task_id, grant=action.grant_id, at_ns=self.now_ns())
        elif isinstance(action, C.Freeze):
            self._trace.write("freeze", task=action.task_id, at_ns=self.now_ns())
        elif isinstance(action, C.StateChanged):
            self._trace.write("state", task=action.task_id, old=action.old.value if action.old else None,
                              new=action.new.value, reason=action.reason, at_ns=self.now_ns())

    def _polls(self) -> None:
        now = self.now_ns()
        if self._pending_writes and now >= self._next_store_retry:
            self._flush_writes()
        if self._trace is not None and now >= self._next_trace_flush_ns:
            # Once a second: the trace can be followed while the manager runs, and a kill -9 loses
            # at most that second (a write to the page cache, not an fsync).
            self._next_trace_flush_ns = now + TRACE_FLUSH_INTERVAL_NS
            self._trace.flush()
        for handle in list(self._workers.values()):
            if handle.eof_at_ns and now >= handle.eof_at_ns:
                handle.eof_at_ns = 0
                if handle.proc.poll() is None:
                    self._feed(
                        C.WorkerFailed(
                            handle.task_id,
                            FailureRecord(
                                kind="PROTOCOL",
                                message="the worker closed its channel but kept running",
                                step=self._board_step(handle.task_id),
                                at_unix_s=time.time(),
                            ),
                        )
                    )
                    self._signal(handle, signal.SIGKILL)

    # ------------------------------------------------------------------ actions

    def _apply(self, actions: list[C.Action]) -> None:
        for action in actions:
            try:
                self._apply_one(action)
            except Exception:
                log.exception("[%s] failed to apply %r", self.device, action)

    def _apply_one(self, action: C.Action) -> None:
        if self._trace is not None:
            self._trace_action(action)
        if isinstance(action, C.Grant):
            handle = self._workers.get(action.task_id)
            if handle is None:
                return
            # The grant goes out before a frozen worker is thawed: its interrupted step then ends with
            # the new grant waiting, rather than with the old grant's ended word alone.
            self._send(handle, W.Grant(action.grant_id, action.deadline_ns, action.margin_ns, probe=action.probe,
                                       rank=action.rank, bubble_start_ns=action.bubble_start_ns,
                                       trainer_ends=action.trainer_ends))
            if action.thaw:
                self._signal(handle, signal.SIGCONT)
            if action.trainer_ends and handle.board is not None:
                self._hot = _HotGrant(action.grant_id, action.bubble_key, action.bubble_start_ns, handle.board)
        elif isinstance(action, C.Park):
            handle = self._workers.get(action.task_id)
            if handle is not None:
                # The word first: the worker reads it before every step, whether or not it has read
                # its channel (or the channel was full). The message only wakes a worker that waits.
                if handle.board is not None and handle.board.end_grant(action.grant_id, action.end_ns) \
                        and action.end_received_ns:
                    with self._end_lock:
                        self.end_to_worker.record(self.now_ns() - action.end_received_ns)
                self._send(handle, W.Park(action.grant_id))
        elif isinstance(action, C.Freeze):
            handle = self._workers.get(action.task_id)
            if handle is not None:
                self._signal(handle, signal.SIGSTOP)
                if handle.board is not None:
                    # Steps it finished inside the grant it is frozen in have not been reported yet;
                    # a step word still at -1 says it has begun none: it is inside setup().
                    self._feed(C.WorkerStepsSeen(action.task_id, handle.board.steps_done(), handle.board.step() < 0))
        elif isinstance(action, C.Spawn):
            self._spawn(action)
        elif isinstance(action, C.Stop):
            handle = self._workers.get(action.task_id)
            if handle is not None:
                self._send(handle, W.Stop(action.checkpoint))
                self._signal(handle, signal.SIGCONT)  # a frozen worker must run to obey
        elif isinstance(action, C.Kill):
            handle = self._workers.get(action.task_id)
            if handle is not None:
                self._signal(handle, signal.SIGKILL)
        elif isinstance(action, C.StateChanged):
            log.debug("[%s task=%s] %s -> %s (%s)", self.device, action.task_id,
                      action.old.value if action.old else "-", action.new.value, action.reason)
            self._persist_state(action)
        elif isinstance(action, C.CheckpointRecorded):
            if action.task_id in self._cluster:
                return  # the queue agent reads it from the core at its next poll
            task = self.core.tasks.get(action.task_id)
            harvested_s = task.harvested_ns / 1e9 if task is not None else 0.0
            self._durable(action.task_id, "checkpoint", functools.partial(
                self.store.record_checkpoint, action.task_id, action.step, action.path, action.progress, harvested_s))
        elif isinstance(action, C.Released):
            self._released(action)
        elif isinstance(action, C.DrainComplete):
            for future in self._drain_waiters:
                if not future.done():
                    future.set_result(None)
            self._drain_waiters.clear()
            if self._stop_after_drain:
                self._running = False
        elif isinstance(action, C.Note):
            # The core does no I/O: what it would log comes back as a note.
            log.log(action.level, "[%s%s] %s", self.device, f" task={action.task_id}" if action.task_id else "",
                    action.message)

    def _send(self, handle: WorkerHandle, message: W.ManagerMessage) -> None:
        if handle.closed:
            return
        try:
            handle.channel.send(message)
        except ChannelFull:
            # The worker is busy (a long step or setup) or frozen: a grant or park it cannot read
            # now is stale by the time it could. The freeze timer and stop timeout still apply.
            self.messages_dropped += 1
            log.debug("[%s task=%s] worker not reading; dropped %s", self.device, handle.task_id, message.TAG)
        except ChannelClosed:
            self._channel_eof(handle)

    def _signal(self, handle: WorkerHandle, sig: int) -> None:
        for pgid in [handle.proc.pid, *handle.extra_pgids]:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            for pgid in [handle.proc.pid, *handle.extra_pgids]:
                try:
                    os.killpg(pgid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass

    def _persist_state(self, action: C.StateChanged) -> None:
        task = self.core.tasks.get(action.task_id)
        if action.failure is not None and not action.failure.at_unix_s:
            # The pure core has no wall clock and cannot see the worker's step board or log: failures
            # it decides (memory, timeouts, exits) are completed here with the time, the step the
            # worker was in (its board: the core's own count is only updated when the worker parks,
            # so a task that died in its third step of a grant read "step 0"), and the log's tail.
            failure = action.failure
            step = self._board_step(action.task_id)
            stamped = dataclasses.replace(
                failure, at_unix_s=time.time(), step=step if step >= 0 else failure.step,
                log_tail=failure.log_tail or self._log_tail(action.task_id),
            )
            action = dataclasses.replace(action, failure=stamped)
            if task is not None and task.failure is not None:
                task.failure = stamped
        if action.task_id in self._cluster:
            # Redis, not the local store, keeps a cluster task: the queue agent records it.
            if action.new.is_terminal and task is not None:
                self._note("ended", self._status(task), action.reason)
            if action.new.is_terminal or action.new == TaskState.STARTING:
                log.info("[%s task=%s] %s -> %s (%s)", self.device, action.task_id,
                         action.old.value if action.old else "-", action.new.value, action.reason)
        elif action.old in (TaskState.PARKED, TaskState.RUNNING, TaskState.FROZEN) and action.new in (
            TaskState.PARKED,
            TaskState.RUNNING,
            TaskState.FROZEN,
        ):
            pass  # frequent flips are not durable information
        else:
            self._durable(action.task_id, "state", functools.partial(
                self.store.set_state, action.task_id, action.new, action.failure))
            if task is not None and (action.new.is_terminal or action.new == TaskState.SUBMITTED):
                # The figures are bound now, not read when a deferred write is finally carried out.
                self._durable(task.task_id, "progress", functools.partial(
                    self.store.record_progress, task.task_id, figures_of(task)))
            if action.new.is_terminal or action.new in (TaskState.SUBMITTED, TaskState.STARTING):
                log.info("[%s task=%s] %s -> %s (%s)", self.device, action.task_id,
                         action.old.value if action.old else "-", action.new.value, action.reason)
            if action.failure is not None:
                log.warning("[%s task=%s] failed: %s: %s", self.device, action.task_id, action.failure.kind,
                            action.failure.message)
        if self._subscribers and task is not None:
            # The core may have moved on within the same event (SUBMITTED -> STARTING): report the
            # state this change produced, so viewers see every transition.
            info = dataclasses.replace(self._info(task.task_id), state=action.new.value)
            self._publish(TaskEvent(time.time(), task=info))

    def _durable(self, task_id: str, kind: str, write: Callable[[], None]) -> None:
        """Carry out one store write now, or keep it for later if the state directory refuses it.

        Writes set absolute values, so a newer write of the same (task, kind) replaces a pending
        one; the rest keep their order. A pending write is only in memory: a manager killed before
        the directory recovers loses it (the task then comes back in its last durable state).
        """
        key = (task_id, kind)
        self._pending_writes.pop(key, None)
        self._pending_writes[key] = write
        if not self.store_fault:  # while the directory refuses writes, the retry timer tries again
            self._flush_writes()

    def _flush_writes(self) -> bool:
        """Write what is pending, oldest first; True when nothing is left."""
        while self._pending_writes:
            key, write = next(iter(self._pending_writes.items()))
            try:
                write()
            except StateNotWritable as exc:
                if not self.store_fault:
                    log.error("[%s] %s; training is still served, task records are kept in memory and "
                              "retried, new submissions are refused", self.device, exc)
                self.store_fault = str(exc)
                self._next_store_retry = self.now_ns() + int(self.config.store_retry_ms * 1e6)
                return False
            del self._pending_writes[key]
        if self.store_fault:
            log.warning("[%s] the state directory takes writes again; deferred task records saved", self.device)
            self.store_fault = ""
        return True

    def _publish(self, event: TaskEvent) -> None:
        with self._sub_lock:
            for q in self._subscribers:
                try:
                    q.put_nowait(event)
                except queue.Full:  # a slow viewer loses events, never the manager's time
                    self.watch_events_dropped += 1

    # ------------------------------------------------------------------ workers

    def task_dir(self, task_id: str) -> Path:
        """``<state dir>/tasks/<id>``: state, checkpoints, log and work directory of one task.

        Ids are made by the store from a slug of ``[a-z0-9-]`` and a sequence number, never from a
        user's text as given, so no name or argument can make this path leave the state directory;
        the check makes that an invariant rather than a property of the store.
        """
        if not _TASK_ID_RE.fullmatch(task_id):
            raise ValueError(f"task id {task_id[:80]!r} is not a manager-made id")
        return self.config.state_dir / "tasks" / task_id

    def checkpoint_dir(self, task_id: str) -> Path:
        """Where a task's worker writes its checkpoints: ``<task dir>/checkpoints``, or for a cluster task
        ``<checkpoint root>/<id>``, which every node sees."""
        if task_id in self._cluster and self.config.checkpoint_root is not None:
            self.task_dir(task_id)  # the same check of the id
            return self.config.checkpoint_root / task_id
        return self.task_dir(task_id) / "checkpoints"

    def _spawn(self, action: C.Spawn) -> None:
        task_dir = self.task_dir(action.task_id)
        checkpoint_dir = self.checkpoint_dir(action.task_id)
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            (task_dir / "work").mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a full or read-only state directory: say so rather than stay STARTING
            self._spawn_failed(action.task_id, f"cannot prepare the task directory {task_dir}: {exc}")
            return
        board: WorkerBoard | None = None
        try:
            board = WorkerBoard.create(task_dir / "board")
        except OSError as exc:  # the worker then learns of ends by its channel only
            log.warning("[%s task=%s] no board for the worker: %s", self.device, action.task_id, exc)
        try:
            log_fd, out_fd = os.pipe2(os.O_CLOEXEC)
        except OSError as exc:
            self._spawn_failed(action.task_id, f"cannot make the worker's output pipe: {exc}")
            return
        worker_log = WorkerLog(task_dir / "worker.log", self.config.worker_log_max_bytes,
                               self.config.worker_log_backups)
        parent_sock, child_sock = socketpair()
        env = dict(os.environ)
        env.update(self.device.worker_env(action.memory_bytes))
        env[orphans.MARKER_ENV] = str(task_dir)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        spec = action.spec
        cwd = spec.working_dir if spec.working_dir and os.path.isdir(spec.working_dir) else str(task_dir / "work")
        argv = [sys.executable, "-m", "freeride._worker", "--fd", str(child_sock.fileno()),
                "--parent-pid", str(os.getpid())]
        try:
            proc = subprocess.Popen(
                argv,
                pass_fds=(child_sock.fileno(),),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
            )
        except OSError as exc:
            parent_sock.close()
            child_sock.close()
            os.close(log_fd)
            os.close(out_fd)
            worker_log.close()
            if board is not None:
                board.close()
            self._spawn_failed(action.task_id, f"cannot start the worker: {exc}")
            return
        child_sock.close()
        os.close(out_fd)
        os.set_blocking(log_fd, False)
        orphans.record(task_dir, proc.pid)
        parent_sock.setblocking(False)
        channel = Channel(parent_sock)
        pidfd = os.pidfd_open(proc.pid)
        handle = WorkerHandle(action.task_id, proc, channel, pidfd, worker_log, log_fd, board)
        self._workers[action.task_id] = handle
        self._selector.register(channel.fileno(), selectors.EVENT_READ, ("chan", handle))
        self._selector.register(pidfd, selectors.EVENT_READ, ("exit", handle))
        self._selector.register(log_fd, selectors.EVENT_READ, ("log", handle))
        self.poller.watch(action.task_id, [proc.pid])
        init = W.Init(
            task_id=action.task_id,
            target=spec.target,
            args=spec.args,
            command=spec.command,
            working_dir=spec.working_dir,
            device=str(self.device),
            memory_limit_bytes=action.memory_bytes,
            work_dir=str(task_dir / "work"),
            checkpoint_dir=str(checkpoint_dir),
            resume_path=action.resume_path,
            checkpoint_interval_s=spec.checkpoint_interval_s or self.config.core.default_checkpoint_interval_s,
            step_time_hint_ms=spec.step_time_hint_ms,
            board_file=str(task_dir / "board") if board is not None else "",
            end_board=str(self.config.end_board_path or ""),
            admission=self.config.core.policy,
        )
        try:
            handle.channel.send(init)
        except (ProtocolError, ChannelFull, ChannelClosed) as exc:
            # Validation bounds what a spec carries, so this is a backstop: a worker that never gets
            # its init would hold the task in STARTING for good. Fail the task; its exit completes it.
            failure = FailureRecord(kind="SPAWN", message=f"cannot send the task to its worker: {exc}",
                                    at_unix_s=time.time())
            self._feed(C.WorkerFailed(action.task_id, failure))
            self._signal(handle, signal.SIGKILL)
            return
        log.info("[%s task=%s] worker pid %d started", self.device, action.task_id, proc.pid)

    def _spawn_failed(self, task_id: str, message: str) -> None:
        self._feed(C.WorkerFailed(task_id, FailureRecord(kind="SPAWN", message=message, at_unix_s=time.time())))
        self._feed(C.WorkerExited(task_id, exit_code=None, signal=0))

    def _read_channel(self, handle: WorkerHandle) -> None:
        while not handle.closed:
            try:
                msg = handle.channel.recv_nowait()
            except ChannelClosed:
                self._channel_eof(handle)
                return
            except ProtocolError as exc:
                self._feed(C.WorkerFailed(handle.task_id, FailureRecord(
                    kind="PROTOCOL", message=f"the worker sent a malformed message: {exc}",
                    step=self._board_step(handle.task_id), at_unix_s=time.time())))
                self._signal(handle, signal.SIGKILL)
                return
            if msg is None:
                return
            try:
                self._on_worker_message(handle, msg)
            except ProtocolError as exc:
                self._feed(C.WorkerFailed(handle.task_id, FailureRecord(
                    kind="PROTOCOL", message=f"the worker sent a malformed {msg.TAG!r}: {exc}",
                    step=self._board_step(handle.task_id), at_unix_s=time.time())))
                self._signal(handle, signal.SIGKILL)
                return

    def _on_worker_message(self, handle: WorkerHandle, msg: W.Message) -> None:
        """Turn a decoded worker message into core events; ProtocolError for one that is not the worker's to send."""
        tid = handle.task_id
        if isinstance(msg, W.Parked):
            hot = self._hot
            if hot is not None and hot.grant_id == msg.grant_id:
                self._hot = None  # its bubble is no longer held: an end for it times no worker
            if self._trace is not None:
                # A worker of an older version sends no starts: its grant then has no spans.
                spans = [[s, s + d] for s, d in zip(msg.starts_ns, msg.durations_ns, strict=False)]
                self._trace.write("steps", task=tid, grant=msg.grant_id, reason=msg.reason, count=msg.steps,
                                  spans=spans)
            self._feed(C.WorkerParked(
                tid, msg.grant_id, msg.steps, msg.durations_ns, msg.first_step_ns, msg.last_end_ns, msg.parked_ns,
                msg.reason, msg.progress, msg.total_steps, warmup_steps=msg.warmup_steps,
                device_bytes=msg.device_bytes, seen_end_ns=msg.end_ns))
        elif isinstance(msg, W.Ready):
            self._feed(C.WorkerReady(tid, msg.pid, msg.progress_unit, msg.context_bytes, msg.baseline_bytes,
                                     msg.host_baseline_bytes))
        elif isinstance(msg, W.Checkpointed):
            home = self.checkpoint_dir(tid) if tid in self._cluster else self.task_dir(tid)
            if not Path(msg.path).resolve().is_relative_to(home.resolve()):
                raise ProtocolError(f"checkpoint path {msg.path!r} is outside the task's directory")
            self._feed(C.WorkerCheckpointed(tid, msg.step, msg.path, msg.progress))
        elif isinstance(msg, W.Finished):
            self._feed(C.WorkerFinished(tid, msg.total_steps, msg.progress))
        elif isinstance(msg, W.Failed):
            self._feed(C.WorkerFailed(tid, FailureRecord(
                kind=msg.kind, message=msg.message, traceback=msg.traceback, step=msg.step, at_unix_s=time.time()),
                msg.durations_ns, msg.progress, msg.total_steps))
        elif isinstance(msg, W.CheckpointFailed):
            # The worker goes on and tries again later; the last acknowledged checkpoint stands.
            log.warning("[%s task=%s] checkpoint at step %s not written: %s", self.device, tid, msg.step, msg.error)
        elif isinstance(msg, W.Bye):
            handle.goodbye = True
        elif isinstance(msg, W.ProcessGroup):
            # The manager will SIGKILL this group: 0 or a negative number would make killpg name the
            # manager's own group or fail with EINVAL on the loop thread, and 1 is init's.
            if msg.pgid <= 1 or msg.pgid == os.getpgrp():
                raise ProtocolError(f"process group {msg.pgid} is not one a command task could have made")
            handle.extra_pgids.append(msg.pgid)
            self.poller.watch(tid, [handle.proc.pid, *handle.extra_pgids])
        else:  # the channel decodes only worker messages: a manager's own is no business of a worker
            raise ProtocolError(f"a {msg.TAG!r} message is not one a worker may send")

    def _read_log(self, handle: WorkerHandle, chunks: int = 1) -> None:
        """Move up to ``chunks`` chunks of the worker's output from its pipe to its log (one per wake-up:
        a task that prints without pause costs each turn of the loop one read and one write)."""
        for _ in range(chunks):
            if handle.log_fd < 0:
                return
            try:
                data = os.read(handle.log_fd, CHUNK_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer is gone
                self._close_log(handle)
                return
            handle.log.write(data)

    def _close_log(self, handle: WorkerHandle) -> None:
        if handle.log_fd >= 0:
            self._selector.unregister(handle.log_fd)
            os.close(handle.log_fd)
            handle.log_fd = -1
        handle.log.close()

    def _channel_eof(self, handle: WorkerHandle) -> None:
        if handle.closed:
            return
        handle.closed = True
        self._selector.unregister(handle.channel.fileno())
        handle.channel.close()
        if not handle.goodbye and handle.proc.poll() is None:
            handle.eof_at_ns = self.now_ns() + int(self.config.eof_grace_ms * 1e6)

    def _reap(self, handle: WorkerHandle) -> None:
        if not handle.closed:
            self._read_channel(handle)  # messages sent just before exiting come first
            self._channel_eof(handle)
        # Whatever the task spawned dies with it. The unreaped worker still holds its pid, so the
        # group id cannot have been reused by an unrelated process yet.
        try:
            os.killpg(handle.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        returncode = handle.proc.wait()
        # What the worker wrote last (a crash's last words) is still in the pipe: log it before the
        # tail is read. Bounded: a process the task left behind may still be writing.
        self._read_log(handle, chunks=64)
        tail = handle.log.tail(LOG_TAIL_BYTES)
        self._close_log(handle)
        if handle.board is not None:
            handle.board.close()
        orphans.forget(self.task_dir(handle.task_id))
        self._selector.unregister(handle.pidfd)
        os.close(handle.pidfd)
        self._workers.pop(handle.task_id, None)
        self.poller.forget(handle.task_id)
        for pgid in handle.extra_pgids:  # a command task's own group dies with its worker
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        sig = -returncode if returncode < 0 else 0
        code = returncode if returncode >= 0 else None
        self._feed(C.WorkerExited(handle.task_id, code, sig, tail, self._board_step(handle.task_id)))

    def _board_step(self, task_id: str) -> int:
        """The step a task's worker last began, from its board (the file outlives the worker); -1: none."""
        return read_step(self.task_dir(task_id) / "board")

    def _log_tail(self, task_id: str) -> str:
        handle = self._workers.get(task_id)
        if handle is not None:
            self._read_log(handle, chunks=64)
            return handle.log.tail(LOG_TAIL_BYTES)
        return read_tail_bytes(self.task_dir(task_id) / "worker.log", LOG_TAIL_BYTES).decode(errors="replace")

    # ------------------------------------------------------------------ requests

    def _handle_request(self, request: Request, future: Future[Any]) -> Any:
        if isinstance(request, SubmitTask):
            if self.core.draining:
                raise RequestRejected("the manager is draining and accepts no new tasks")
            total = self.device.total_memory_bytes()
            if total and request.spec.memory_bytes > total:
                raise RequestRejected(
                    f"memory {format_mib(request.spec.memory_bytes)} is more than {self.device} has in all "
                    f"({format_mib(total)}): the task could never be placed"
                )
            context = self.core.context_bytes
            if context and request.spec.memory_bytes < context + MIN_ALLOCATOR_BYTES:
                raise RequestRejected(
                    f"memory {request.spec.memory_bytes / 2**20:.0f} MiB is below what a task needs on "
                    f"{self.device}: its CUDA context takes {context / 2**20:.0f} MiB (measured by a worker "
                    f"here), so give at least {(context + MIN_ALLOCATOR_BYTES) / 2**20:.0f} MiB"
                )
            if self._pending_writes and not self._flush_writes():
                raise StateNotWritable(f"{self.store_fault}; the task was not submitted (training is still served)")
            try:
                stored = self.store.add(request.spec)
            except StateNotWritable as exc:
                raise StateNotWritable(f"{exc}; the task was not submitted (training is still served)") from None
            self._meta[stored.task_id] = stored
            self._feed(task_added(stored))
            return self._info(stored.task_id)
        if isinstance(request, ListTasks):
            infos = [self._info(tid) for tid in self._meta]
            return [i for i in infos if request.include_finished or not TaskState(i.state).is_terminal]
        if isinstance(request, GetTask):
            return self._info(request.task_id)
        if isinstance(request, CancelTask):
            if request.task_id not in self.core.tasks:
                self._info(request.task_id)  # raises TaskNotFound for unknown ids
                return self._info(request.task_id)  # already terminal before this run
            self._feed(C.CancelRequested(request.task_id))
            return self._info(request.task_id)
        if isinstance(request, GetStats):
            return self._stats()
        if isinstance(request, GetBubbles):
            return self.core.slot_stats()
        if isinstance(request, GetQueueView):
            return self._queue_view()
        if isinstance(request, Drain):
            stopping = [t.task_id for t in self.core.tasks.values() if t.state.is_resident]

            def checkpointed() -> int:
                # A task stopped in its setup has no checkpoint to claim (stranger trial: it was counted).
                tasks = [self.core.tasks.get(tid) for tid in stopping]
                return sum(1 for t in tasks if t is not None and t.checkpoint_path and t.checkpoint_step >= t.steps)

            self._drain_waiters.append(_chain(future, len(stopping), checkpointed))
            self._start_drain()
            raise _Deferred()
        raise TypeError(f"unknown request {request!r}")

    def _start_drain(self) -> None:
        announce = not self.core.draining
        self._feed(C.DrainRequested())
        if announce:
            self.on_draining()

    def _shutdown(self, request: Shutdown) -> None:
        if request.immediate:
            log.warning("[%s] stopping now: killing workers without checkpoints", self.device)
            for handle in list(self._workers.values()):
                self._signal(handle, signal.SIGKILL)
            self._running = False
            return
        log.info("[%s] stopping: parking and checkpointing every task", self.device)
        self._stop_after_drain = True
        self._start_drain()

    def _info(self, task_id: str) -> TaskInfo:
        meta = self._meta.get(task_id)
        task = self.core.tasks.get(task_id)
        if meta is None:
            raise TaskNotFound(f"no task {task_id!r} on this manager")
        if task is None:  # terminal before this manager started
            return TaskInfo(task_id=task_id, spec=meta.spec, state=meta.state, figures=meta.figures,
                            submitted_unix_s=meta.submitted_unix_s, updated_unix_s=meta.updated_unix_s,
                            failure=meta.failure)
        p50 = task.estimator.median_ns()
        handle = self._workers.get(task_id)
        return TaskInfo(
            task_id=task_id,
            spec=task.spec,
            state=task.state.value,
            figures=figures_of(task),
            step_p50_ms=(p50 or 0) / 1e6,
            waiting_reason=self.core.waiting_reason(task),
            submitted_unix_s=meta.submitted_unix_s,
            updated_unix_s=time.time(),
            failure=task.failure,
            pid=handle.proc.pid if handle else 0,
        )

    # ------------------------------------------------------------------ cluster tasks

    def _add_claimed(self, claim: TaskRecord) -> None:
        """Add a task the queue agent claimed; it resumes from the newest checkpoint in the shared directory.

        The newest file wins over the record's checkpoint when it is newer: the last holder may have
        died between writing a file and the record catching up (as in a manager's own restart).
        """
        tid = claim.task_id
        if tid in self.core.tasks or tid in self._meta or not is_cluster_id(tid):
            # The same task twice (its earlier copy here is still on its way out; the agent avoids it):
            # the claim is dropped and the agent told to forget it, so its lease runs out and the queue
            # places it again.
            log.warning("[%s task=%s] claimed while still held here; dropped", self.device, tid)
            self._note("lost", claim, "claimed while still held here")
            return
        self._cluster.add(tid)
        ck_path, ck_step = claim.checkpoint_path, claim.checkpoint_step
        if self.config.checkpoint_root is not None:
            ck_path, ck_step = _checkpoints.newest(self.checkpoint_dir(tid), ck_path, ck_step)
        if ck_path and not Path(ck_path).resolve().is_relative_to(self.checkpoint_dir(tid).resolve()):
            ck_path = ""  # a path from another checkpoint root: the worker looks in its own directory
        now = time.time()
        # A new holder starts its own count of harvested time and overruns (the queue's record takes the
        # holder's figures as they are).
        figures = dataclasses.replace(claim.figures, checkpoint_step=ck_step, harvested_s=0.0, overruns=0)
        meta = dataclasses.replace(claim, state=TaskState.SUBMITTED.value, figures=figures, checkpoint_path=ck_path,
                                   submitted_unix_s=claim.submitted_unix_s or now, updated_unix_s=now)
        self._meta[tid] = meta
        log.info("[%s task=%s] claimed from the cluster queue (checkpoint step %d)", self.device, tid, ck_step)
        self._feed(task_added(meta, from_queue=True))

    def _released(self, action: C.Released) -> None:
        """A cluster task left this device: hand it back to the queue (or forget it if it was lost)."""
        meta = self._meta.pop(action.task_id, None)
        self._cluster.discard(action.task_id)
        figures = TaskProgress(
            steps=action.steps, progress=action.progress, progress_unit=meta.progress_unit if meta else "steps",
            checkpoint_step=action.checkpoint_step, restarts=action.restarts,
            step_p95_ms=(action.step_p95_ns or 0) / 1e6,
        )
        record = TaskRecord(action.task_id, meta.spec if meta else TaskSpec(), "EVICTED", figures,
                            action.checkpoint_path, seq=meta.seq if meta else 0)
        log.info("[%s task=%s] left this device: %s", self.device, action.task_id, action.reason)
        self._note("left" if action.checkpoint else "lost", record, action.reason)

    def _note(self, kind: str, record: TaskRecord, reason: str) -> None:
        sink = self.queue_notes
        if sink is not None:
            try:
                sink(QueueNote(kind, record, reason))
            except Exception:  # the agent's inbox must never take the loop down
                log.exception("[%s] queue note dropped", self.device)

    def _status(self, task: C.TaskRuntime) -> TaskRecord:
        failure = task.failure
        if failure is not None and not failure.at_unix_s:
            failure = dataclasses.replace(failure, at_unix_s=time.time())
        return TaskRecord(task.task_id, task.spec, task.state.value, figures_of(task), task.checkpoint_path,
                          failure, seq=task.seq)

    def _queue_view(self) -> QueueView:
        core = self.core
        layout = core.layout
        capacity = Capacity(
            budget_bytes=core.budget_bytes(),
            longest_bubble_ns=core.longest_bubble_ns,
            margin_ns=self.config.core.margin_ns,
            waiting=core.count_in(TaskState.SUBMITTED),
            draining=core.draining,
            hosts_stage=layout is None or layout.hosts_stage(str(self.device), self.config.node),
            device_problem=core.device_problem,
        )
        tasks = tuple(self._status(core.tasks[tid]) for tid in sorted(self._cluster) if tid in core.tasks)
        return QueueView(capacity, tasks)

    def _stats(self) -> ManagerStats:
        s = self.core.stats
        by_state: dict[str, int] = {}
        for tid, meta in self._meta.items():
            task = self.core.tasks.get(tid)
            state = task.state.value if task else meta.state
            by_state[state] = by_state.get(state, 0) + 1
        budget = self.core.budget_bytes()
        return ManagerStats(
            device=str(self.device),
            uptime_s=time.time() - self.started_unix,
            bubbles=s.bubbles,
            bubble_time_s=s.bubble_ns / 1e9,
            granted_s=s.granted_ns / 1e9,
            harvested_s=s.harvested_ns / 1e9,
            overruns=s.overruns,
            overrun_ms=_pct(s.overrun_ms),
            grant_latency_ms=_pct(s.grant_latency_ms),
            park_latency_ms=_pct(s.park_latency_ms),
            memory_budget_bytes=-1 if budget is None else budget,
            tasks_by_state=by_state,
            events_received=self.events_received,
            events_rejected=self.events_rejected + s.ignored_events,
            draining=self.core.draining,
            messages_dropped=self.messages_dropped,
            event_delay_ms=self.event_delay.percentiles(),
            end_to_worker_ms=self._end_to_worker_ms(),
            events_dropped=self.events_dropped,
            device_info=self.device.describe(),
            device_problem=self.core.device_problem,
            layout_changes=s.layout_changes,
            layout=self.core.layout.describe() if self.core.layout is not None else "",
        )

    def slot_stats(self) -> list[BubbleSlotStats]:
        return self.core.slot_stats()

    def _end_to_worker_ms(self) -> Percentiles:
        with self._end_lock:
            return self.end_to_worker.percentiles()

    # ------------------------------------------------------------------ startup and shutdown

    def _recover(self) -> None:
        """Load the store; tasks that were alive when the last manager died start again.

        Processes a killed manager's workers left behind are killed first. A task resumes from the
        newest checkpoint file in its directory when that is newer than the one recorded: files are
        written whole (fsync, rename), and the manager may have died before recording the newest.
        """
        # A cluster task is not in the store (Redis holds it; its lease runs out and it is placed again),
        # but what its workers spawned here dies all the same.
        tasks_dir = self.config.state_dir / "tasks"
        for path in sorted(tasks_dir.iterdir()) if tasks_dir.is_dir() else []:
            if is_cluster_id(path.name) and orphans.kill_leftovers(path):
                log.warning("[%s task=%s] killed process(es) left by the previous manager's worker", self.device,
                            path.name)
        for stored in self.store.all():
            self._meta[stored.task_id] = stored
            killed = orphans.kill_leftovers(self.task_dir(stored.task_id))
            if killed:
                log.warning("[%s task=%s] killed %d process(es) left by the previous manager's worker",
                            self.device, stored.task_id, killed)
            state = TaskState(stored.state)
            if state.is_terminal:
                continue
            restarts = stored.restarts + (1 if state != TaskState.SUBMITTED else 0)
            if state != TaskState.SUBMITTED:
                log.info("[%s task=%s] recovered after a manager restart (was %s)", self.device, stored.task_id,
                         stored.state)
                self._durable(stored.task_id, "state", functools.partial(
                    self.store.set_state, stored.task_id, TaskState.SUBMITTED))
            ck_path, ck_step = _checkpoints.newest(self.task_dir(stored.task_id) / "checkpoints",
                                                   stored.checkpoint_path, stored.checkpoint_step)
            figures = dataclasses.replace(stored.figures, restarts=restarts, checkpoint_step=ck_step)
            self._apply(self.core.on_event(
                task_added(dataclasses.replace(stored, figures=figures, checkpoint_path=ck_path)), self.now_ns()))

    def _close(self) -> None:
        with self._call_lock, self._room:
            # From now on call_async refuses at once, and streams waiting for room give up.
            self._stopped.set()
        stopping = ManagerUnavailable("the manager is stopping")
        for item in self._inbox:
            if isinstance(item, tuple) and not item[1].done():
                item[1].set_exception(stopping)
        self._inbox.clear()
        for future in self._drain_waiters:
            if not future.done():
                future.set_exception(stopping)
        self._drain_waiters.clear()
        self.poller.stop()
        for handle in list(self._workers.values()):
            self._signal(handle, signal.SIGKILL)
            handle.proc.wait()
            self._read_log(handle, chunks=64)
            self._close_log(handle)
            if handle.board is not None:
                handle.board.close()
            orphans.forget(self.task_dir(handle.task_id))
        if self._pending_writes and not self._flush_writes():
            log.error("[%s] stopping with %d task record(s) not saved (%s): those tasks come back in their last "
                      "saved state", self.device, len(self._pending_writes), self.store_fault)
        with self._sub_lock:
            for q in self._subscribers:
                try:
                    q.put_nowait(None)
                except queue.Full:
                    pass
        with self._room:
            self.events_dropped += sum(len(chunk) for chunk in self._bubbles)
            self._bubbles.clear()
            self._room.notify_all()
        self.store.close()
        if self._trace is not None:
            self._trace.close()
        # The eventfd stays open: gRPC threads and scrapes may still post until the server has
        # stopped, and a closed descriptor number could be reused by another file in the meantime.
        # release() closes it once nothing can post any more.
        self._selector.close()
        log.info("[%s] manager loop stopped", self.device)

    def release(self) -> None:
        """Close the wake-up eventfd; call after every thread that could post has stopped."""
        fd, self._wake_fd = self._wake_fd, -1
        if fd >= 0:
            os.close(fd)

    def stop(self) -> None:
        """Stop without draining (tests, and a manager that must go now)."""
        self.post(Shutdown(immediate=True))


class _Deferred(Exception):
    """The request's future is completed later by the loop (drain)."""


def _chain(future: Future[Any], parked: int, checkpointed: Callable[[], int]) -> Future[Any]:
    """A drain waiter: completing it answers ``future`` with (tasks parked, of them checkpointed at their
    last step), or with its error. ``checkpointed`` is counted when the drain completes."""
    inner: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        if future.done():
            return
        error = f.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result((parked, checkpointed()))

    inner.add_done_callback(done)
    return inner


def _pct(values: Any) -> Percentiles:
    return Percentiles(*C.percentiles(values))



def figures_of(task: C.TaskRuntime) -> TaskProgress:
    """A task's figures as the core has them now."""
    p95 = task.estimator.estimate_ns() if task.estimator.count else None
    return TaskProgress(steps=task.steps, progress=task.progress, progress_unit=task.progress_unit,
                        harvested_s=task.harvested_ns / 1e9, overruns=task.overruns, restarts=task.restarts,
                        checkpoint_step=task.checkpoint_step, step_p95_ms=(p95 or 0) / 1e6)


def task_added(record: TaskRecord, from_queue: bool = False) -> C.TaskAdded:
    """The core's event for a task that comes in (submitted, recovered at a start, claimed from the queue)
    with the figures and checkpoint it comes with. A claimed task brings its step estimate as a hint."""
    figures = record.figures
    return C.TaskAdded(
        task_id=record.task_id, spec=record.spec, seq=record.seq, checkpoint_path=record.checkpoint_path,
        checkpoint_step=figures.checkpoint_step, steps=max(figures.steps, figures.checkpoint_step),
        progress=figures.progress, restarts=figures.restarts, harvested_ns=int(figures.harvested_s * 1e9),
        overruns=figures.overruns, from_queue=from_queue,
        step_hint_ns=int(figures.step_p95_ms * 1e6) if from_queue else 0,
    )
