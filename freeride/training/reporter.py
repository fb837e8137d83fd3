"""The trainer's side of the bubble protocol: report bubbles without ever slowing training.

:class:`BubbleReporter` is what an instrumented schedule calls at the start and end of every idle
slot. Over the wire, the two calls only put a tuple on a bounded queue (a C ``SimpleQueue``: no lock
the training thread can contend on for long, no allocation beyond the tuple) and return in about a
microsecond; when the queue is full the event is dropped and counted. On the manager's host they send
a message instead (below: ~7 us an event, unless ``local_events=False``). Nothing on those calls can raise.

A daemon thread owns the connection. It opens one ``Trainer.StreamBubbles`` call
(:class:`freeride._wire.client.BubbleStream`) fed by a generator that reads the queue, so events go
out as soon as gRPC's sender thread picks them up. Each time the sender thread asks for a message,
the generator takes everything queued by then (up to ``MAX_BATCH_EVENTS``) and sends it as one
batch: it never waits to fill a batch, so a lone event goes out at once, on its own, and batches
only form while the sender is busy with the previous message. When the manager is absent, refuses,
or dies, the call ends; the thread then waits with exponential backoff (``backoff_initial_s`` doubling up to
``backoff_max_s``, reset after a connection that carried events) and reconnects. Events queued
while no manager listens are discarded (counted in ``dropped``): a bubble is only useful live.

Sending costs CPU: about a hundred microseconds per *message* in gRPC's Python streaming path
(measured in ``bench/bench_instrumentation.py``), plus a few microseconds per event to convert it.
Batching is what lets a stream go past ~7,000 events/s (``bench/bench_load.py``): under load the
per-message cost is shared by the whole batch. A trainer pinned to one core passes
``cpu_affinity`` (for example the cores it was given before pinning) so that the sender thread and
the gRPC thread it starts are not confined to the training thread's core.

**On the manager's host, events skip the wire.** A manager on a unix socket keeps an *end board*
beside it (:mod:`freeride._boards`): a small shared file in the socket's owner-only directory. The
reporter maps it each time it connects, and :meth:`BubbleReporter.bubble_end` writes the ended
bubble's start and end time into this rank's record (two memory stores, no system call) first; the
side task granted that bubble reads the record before each step and stops at once; a worker still holding
the bubble at the end (in a step, or not yet parked), on a ``cpu:N`` device where the manager armed that, is
stopped by the training thread itself (one ``killpg``, about a microsecond, only then). Then every event,
starts and layouts too, goes from the training thread straight to the manager's loop as one message
(``<socket>.events``, :mod:`freeride._local_events`: one non-blocking ``send``, ~7 us an event on the
2-core test VM against ~1 us for the queue; ``local_events=False`` keeps the queue), so the scheduler
has it about a wake-up later instead of four threads later, and freezes a step still running at the
trainer's own end + grace. What was queued before the connection goes first, as messages; a send that
fails (the manager far behind, or gone) sends that event and the connection's later ones over the wire,
so that none overtakes another. Over TCP (another user, another host) there is neither: there a
message is cut right after each end, so an end is never held behind events queued after it.

**Quiet slots wait.** The end board also says which of this rank's slots no side task could use now (the
manager's :mod:`freeride._manager.quiet`: every resident task's step is longer than any of the slot's recent
waits). A bubble of such a slot is held back on the training thread, its start and its end (a list append,
~0.3 us, instead of a send that may wake the manager's core), and sent, marked late, right before this rank's
next event of another slot, or with the next event once the first held one is :data:`QUIET_HOLD_NS` old, or
at :meth:`BubbleReporter.close`. The end board's record is written at the end as always.

Times are ``time.monotonic_ns()``: ``CLOCK_MONOTONIC`` is shared by every process on the host, so
the manager compares them with its own clock directly.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freeride._boards import EndBoard, end_board_path
from freeride._local_events import LocalEventSender, local_events_path
from freeride.devices import parse_device_name
from freeride.endpoints import Endpoint, resolve_endpoint
from freeride.errors import ConfigError
from freeride.messages import (
    MAX_LAYOUT_TEXT_CHARS,
    UNKNOWN_MEMORY,
    BubbleEnd,
    BubbleStart,
    StreamSummary,
    TrainerEvent,
    TrainerLayout,
    validate_bubble_event,
    validate_layout,
)

if TYPE_CHECKING:
    from freeride._wire.client import BubbleStream

log = logging.getLogger(__name__)

#: Default bound of the event queue: ~minutes of events of a fast schedule, a few hundred KiB.
DEFAULT_QUEUE_SIZE = 4096
#: Most events in one message (~50 bytes each on the wire, far below the message size limit).
MAX_BATCH_EVENTS = 512

_STOP = object()
#: Put on the queue as a call ends: its request iterator, blocked in the queue's ``get`` on gRPC's thread, returns
#: at once instead of taking the next connection's first events and dropping them as its own call's (a manager
#: restarted under a trainer lost the first events the new one was sent, up to 0.2 s of them).
_CALL_ENDED = object()
_START = 0
_END = 1
_LAYOUT = 2
#: A quiet slot's events (the manager's end board says no side task could use that slot now) are held back on the
#: training thread and sent with the next event of a slot that is not quiet, or once the first of them is this old
#: (the next event after that sends them all) ...
QUIET_HOLD_NS = 10_000_000
#: ... or this many are held.
MAX_HELD_EVENTS = 64


@dataclass(frozen=True)
class ReporterCounters:
    """What a reporter did so far: events handed to the manager, dropped, and connections opened.

    ``messages`` is how many stream messages carried the ``sent`` events that went over the wire. ``accepted``,
    ``rejected`` and ``manager_dropped`` add up the manager's summaries of the streams closed so far
    (a stream is summarised only when it closes; a manager that died sends none; local datagrams are
    not in them: the manager counts those it rejects in its own ``events_rejected``); ``rejected`` also
    counts the malformed events this reporter did not put on the wire (a negative iteration, say);
    ``manager_dropped`` counts valid events a stopping manager never handed to its scheduler.
    ``connected``: the manager answered on the open stream's channel (``connects`` counts streams opened,
    answered or not; ``reconnects``, the connections a manager answered after the first: a manager that was
    absent for a while opens many streams, and reconnects none until it answers).
    """

    #: Events taken from the training thread: queued for the wire, or sent as local datagrams.
    enqueued: int
    sent: int
    dropped: int
    connects: int
    reconnects: int
    connected: bool
    messages: int = 0
    accepted: int = 0
    rejected: int = 0
    manager_dropped: int = 0
    #: Of ``sent``, the events that went as local datagrams (a trainer on the manager's host).
    local: int = 0
    #: Connections whose events fell back from datagrams to the wire (a full or closed socket).
    local_fallbacks: int = 0


#: A reporter whose manager's unix socket is not there says so, once, after this long (it retries on: a
#: manager started after the trainer is served from then on).
ABSENT_WARNING_S = 5.0


class BubbleReporter:
    """Streams one trainer rank's bubble events to the manager of its device.

    ``device`` names the device this rank trains on (``cuda:0``, ``cpu:1``); its manager is found
    at ``endpoint`` if given, else ``$FREERIDE_ENDPOINT``, else the device's default socket.
    ``stage`` and ``rank`` are the pipeline stage and global rank stamped on every event.
    ``end_board=False`` leaves the manager's end board alone: ends then reach side tasks over the wire
    only (a measurement of what the board saves), and so do all events. ``local_events=False`` keeps the
    board but sends events over the wire: the training thread then pays a queue ``put`` (~1-2 us a call
    pair) instead of a message per event (~14 us a call pair on the 2-core test VM, most of it waking
    the manager's core: ``bench/results/cpu/local_events.md``), and the manager learns of each event
    ~0.6 ms later (``bench/results/cpu/end_stop.md``).
    """

    def __init__(
        self,
        device: str,
        stage: int,
        rank: int,
        endpoint: str | Endpoint | None = None,
        token: str | None = None,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        start: bool = True,
        cpu_affinity: set[int] | None = None,
        end_board: bool = True,
        local_events: bool = True,
        job: str | None = None,
    ) -> None:
        # A bad name is a bug at construction, never on the hot path; a good one is kept as the manager and the
        # adapters spell it ("cpu:1 " was refused as another device than the rank's "cpu:1").
        parsed = parse_device_name(device)
        device = str(parsed)
        if job is not None and (not isinstance(job, str) or not job.strip() or len(job) > MAX_LAYOUT_TEXT_CHARS
                                or not job.isprintable()):
            raise ConfigError(f"job must be text of 1 to {MAX_LAYOUT_TEXT_CHARS} printable characters, not all "
                              f"blank; got {job!r}")
        #: Which run of the trainer this reporter's layouts come from (:meth:`report_layout`): the trainer's
        #: name for it, else one of the reporter's own, so that a manager tells this run from the last one.
        self.job = job or uuid.uuid4().hex[:12]
        self.device = device
        self.stage = int(stage)
        self.rank = int(rank)
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else resolve_endpoint(endpoint, device)
        self._token = token
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._queue_size = int(queue_size)
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._cpu_affinity = set(cpu_affinity) if cpu_affinity else None
        #: ``cpu:N``: the core whose pinning the first bubble's thread is checked for (:meth:`_check_pinned`); -1: none.
        self._pin_core = parsed.index if parsed.kind == "cpu" else -1
        #: ``cpu:N``: the thread that reported the first bubble (the one that computes and waits), said on the end
        #: board for the side tasks granted this rank's bubbles (:meth:`EndBoard.set_trainer_thread`); 0: not yet.
        self._trainer_tid = 0
        self._use_end_board = end_board  # False: ends reach side tasks over the wire only (measurements)
        self._use_local_events = local_events
        self._closed = threading.Event()
        #: Whether the manager answered on the open stream's channel (the sender thread checks at connecting).
        self._connected = False
        #: The job's last layout as reported (schedule, stages, micro-batches, stage devices, at_ns, free bytes):
        #: told again at every reconnection, since the manager there may be a restarted one that never heard it.
        self._last_layout: tuple[str, int, int, tuple[str, ...], int, int] | None = None
        #: The layout still to tell this connection's manager again (sender thread; :meth:`_resend_layout`).
        self._relayout: TrainerLayout | None = None
        #: The manager's end board, mapped at each connection (a restarted manager makes a new one); the
        #: training thread writes to whichever mapping it reads here. A replaced mapping is not closed
        #: (the training thread may be writing to it), only dropped.
        self._end_board: EndBoard | None = None
        #: Where the training thread sends: the manager's local event socket (:mod:`freeride._local_events`), or
        #: None for the wire's queue; and the route's epoch, which tags every queued event. Replaced whole (one
        #: attribute: the training thread reads both at once), under ``_route_lock``.
        self._route: tuple[LocalEventSender | None, int] = (None, 0)
        #: The wire sends only events queued at this epoch or later: an event queued before this connection's
        #: datagrams began could reach the manager after them (see :meth:`_use_local`).
        self._wire_from = 0
        self._route_lock = threading.Lock()
        #: Over TCP the wire is the only path of an end: a message ends right after each end.
        self._cut_at_ends = self.endpoint.kind != "unix"
        #: (iteration, slot, start_ns) of the last bubble started: the identity an end writes on the board.
        self._last_start: tuple[int, int, int] | None = None
        #: Whether that bubble's slot was quiet, its start held back: its end is held too (training thread).
        self._last_quiet = False
        #: Events held back (quiet slots'), in order, as queue items without their epoch (training thread only).
        self._held: list[tuple[object, ...]] = []
        self._held_since_ns = 0  # the first held event's time
        # Counters: each is written by one thread only, so plain ints are race-free under the GIL.
        self._enqueued = 0
        self._dropped_hot = 0
        self._said_closed = False  # a bubble after close() was logged
        self._dropped_bg = 0
        self._sent = 0
        self._sent_local = 0  # events the training thread sent as local datagrams (counted enqueued and sent)
        self._drained_local = 0  # queued events the background thread sent as datagrams at a connection
        #: Set at :meth:`close` (a plain attribute: the hot path reads it without a call).
        self._closing = False
        self._local_fallbacks = 0
        self._messages = 0
        self._connects = 0
        self._answered = 0  # connections a manager answered (``reconnects``)
        self._accepted = self._rejected = self._manager_dropped = 0
        self._rejected_here = 0  # malformed events this reporter refused to put on the wire (_sendable)
        self._rejected_last = ""
        self._rejected_start: tuple[int, int] | None = None  # (iteration, slot) of the last start refused
        self._thread = threading.Thread(
            target=self._run, name=f"freeride-reporter-{self.stage}", daemon=True
        )
        if start:
            self._thread.start()

    # ---------------------------------------------------------------- hot path (training thread)

    def bubble_start(
        self,
        iteration: int,
        slot: int,
        kind: str,
        predicted_ns: int,
        free_memory_bytes: int = UNKNOWN_MEMORY,
        start_ns: int | None = None,
        learned: bool = False,
    ) -> None:
        """Report that this stage starts waiting now (or at ``start_ns``). Never blocks or raises.

        ``predicted_ns``: the bubble's predicted length; one below 1 is sent as 1 ns (a bubble with no usable
        prediction). A malformed event (a negative iteration or slot) is rejected and counted, by the manager or
        here, and the events after it go on.

        ``learned``: the slot is one the instrumentation learned from recurring waits, not one the
        schedule model lists (:mod:`freeride.training.learned_slots`); managers show them apart.
        """
        if self._closing:
            self._reported_after_close()
            return
        if self._pin_core >= 0:
            self._check_pinned()
        try:
            if start_ns is None:
                start_ns = time.monotonic_ns()
            self._last_start = (iteration, slot, start_ns)
            board = self._end_board
            if board is not None and self._route[0] is not None and board.quiet(self.rank, slot):
                self._last_quiet = True
                self._hold((_START, iteration, slot, kind, start_ns, predicted_ns, free_memory_bytes, learned),
                           start_ns)
                return
            self._last_quiet = False
            if self._held:
                self._send_held()
            self._send_start(iteration, slot, kind, start_ns, predicted_ns, free_memory_bytes, learned)
        except Exception:  # noqa: BLE001 - the training thread must never see our failures
            self._dropped_hot += 1

    def _check_pinned(self) -> None:
        """Once, at the first bubble (on the thread that waits, after the trainer pinned it): that thread is said on
        the end board (its side tasks stop stepping once it is runnable), and a ``cpu:N`` rank runs on core N
        alone, as its side tasks do, or says how it runs instead. A rank free to run on other cores waits
        on them too, while its side task, pinned to core N, competes with it there (a stranger's DeepSpeed
        trainer, its ranks left unpinned as the snippet showed, trained 30% slower, without a word)."""
        core, self._pin_core = self._pin_core, -1
        self._trainer_tid = threading.get_native_id()
        board = self._end_board
        if board is not None:  # else said when the board is mapped (the sender thread's connection)
            board.set_trainer_thread(self.rank, self._trainer_tid)
        try:
            cores = os.sched_getaffinity(0)
        except OSError:
            return
        if cores != {core}:
            log.warning("[%s stage=%d] this rank may run on cores %s, not on core %d alone: its side tasks, pinned to "
                        "core %d, compete with it wherever it computes there and cannot use its waits elsewhere; pin "
                        "the thread that trains (os.sched_setaffinity(0, {%d})) before its first bubble",
                        self.device, self.stage, _cores_text(cores), core, core, core)

    def _send_start(self, iteration: int, slot: int, kind: str, start_ns: int, predicted_ns: int,
                    free_memory_bytes: int, learned: bool, late: bool = False) -> None:
        local, epoch = self._route
        if local is not None:
            if local.send_start(self.stage, self.rank, iteration, slot, kind, start_ns, max(1, predicted_ns),
                                free_memory_bytes, learned, late):
                self._sent_local += 1
                return
            epoch = self._local_failed(local)
        self._enqueue((_START, iteration, slot, kind, start_ns, predicted_ns, free_memory_bytes, learned, epoch))

    def _enqueue(self, item: tuple[object, ...]) -> None:
        """Put an event (its route's epoch last) on the wire's queue, or drop and count it where the reporter is
        closing or the queue is full."""
        if self._closing or self._queue.qsize() >= self._queue_size:
            self._dropped_hot += 1
            return
        self._queue.put(item)
        self._enqueued += 1

    def _hold(self, item: tuple[object, ...], at_ns: int) -> None:
        """Hold a quiet slot's event back (:data:`QUIET_HOLD_NS`, :data:`MAX_HELD_EVENTS`)."""
        held = self._held
        if not held:
            self._held_since_ns = at_ns
        held.append(item)
        if len(held) >= MAX_HELD_EVENTS or at_ns - self._held_since_ns >= QUIET_HOLD_NS:
            self._send_held()

    def _send_held(self) -> None:
        """Send the held events, in order and marked late, by the route they would have taken."""
        held, self._held = self._held, []
        for item in held:
            if item[0] == _START:
                _, iteration, slot, kind, start_ns, predicted_ns, free, learned = item
                self._send_start(iteration, slot, kind, start_ns, predicted_ns, free, learned,  # type: ignore[arg-type]
                                 late=True)
            else:
                _, iteration, slot, end_ns = item
                self._send_end(iteration, slot, end_ns, late=True)  # type: ignore[arg-type]

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        """Report that the wait is over now (or at ``end_ns``). Never blocks or raises.

        A side task in this bubble learns of the end from the end board at once (see the module
        docstring), then the manager, from a local message or over the wire.
        """
        try:
            if end_ns is None:
                end_ns = time.monotonic_ns()
            board, last = self._end_board, self._last_start
            if board is not None and last is not None and last[0] == iteration and last[1] == slot:
                board.record_end(self.rank, last[2], end_ns)
                if board.stops:  # a worker still holding this bubble, where the manager armed that: stop it now
                    board.stop_at_end(self.rank, last[2])
        except Exception:  # noqa: BLE001 - a board gone bad costs only its speed-up; the end still goes out
            pass
        try:
            if end_ns is None:
                end_ns = time.monotonic_ns()
            if self._last_quiet:
                last = self._last_start
                if last is not None and last[0] == iteration and last[1] == slot:
                    self._hold((_END, iteration, slot, end_ns), end_ns)  # its start was held: it follows
                    return
            if self._held:
                self._send_held()
            self._send_end(iteration, slot, end_ns)
        except Exception:  # noqa: BLE001
            self._dropped_hot += 1

    def _send_end(self, iteration: int, slot: int, end_ns: int, late: bool = False) -> None:
        local, epoch = self._route
        if local is not None:
            if local.send_end(self.stage, self.rank, iteration, slot, end_ns, late):
                self._sent_local += 1
                return
            epoch = self._local_failed(local)
        self._enqueue((_END, iteration, slot, end_ns, epoch))

    def report_layout(
        self,
        schedule: str,
        stages: int,
        microbatches: int,
        stage_devices: tuple[str, ...] | list[str] = (),
        free_memory_bytes: int = UNKNOWN_MEMORY,
        at_ns: int | None = None,
    ) -> None:
        """Report that the job's pipeline layout changed (elastic training). Never blocks or raises.

        Call it after re-sharding and before the first step of the new layout: it travels on the
        bubble stream, in order. ``stage_devices[i]`` is where stage ``i`` runs (``cuda:0`` or
        ``node/cuda:0``; empty if this rank does not know the whole map); ``free_memory_bytes`` is
        this device's free memory under the new layout, when known. The manager drops its bubble
        statistics and re-learns them; tasks that no longer fit its memory budget are evicted (and,
        from a cluster queue, placed again elsewhere). Reporting the same layout again changes nothing;
        the same layout from another reporter's job (``job``: the trainer run again) is a new one.
        """
        try:
            if at_ns is None:
                at_ns = time.monotonic_ns()
            self._last_layout = (str(schedule), int(stages), int(microbatches), tuple(str(d) for d in stage_devices),
                                 int(at_ns), int(free_memory_bytes))
            if self._held:
                self._send_held()  # no event overtakes another
            local, epoch = self._route
            if local is not None:
                layout = TrainerLayout(str(schedule), int(stages), int(microbatches),
                                       tuple(str(d) for d in stage_devices), int(at_ns), int(free_memory_bytes),
                                       self.job)
                if local.send(layout):
                    self._sent_local += 1
                    return
                epoch = self._local_failed(local)
            self._enqueue((_LAYOUT, schedule, stages, microbatches, tuple(stage_devices), at_ns, free_memory_bytes,
                           epoch))
        except Exception:  # noqa: BLE001
            self._dropped_hot += 1

    # ---------------------------------------------------------------- counters and lifecycle

    @property
    def sent(self) -> int:
        """Events handed to the manager: over the wire (to gRPC) and as local datagrams."""
        return self._sent + self._sent_local + self._drained_local

    @property
    def dropped(self) -> int:
        return self._dropped_hot + self._dropped_bg

    @property
    def reconnects(self) -> int:
        """Connections a manager answered (or that carried events), after the first; counted as each ends, and the
        open one once it is answered. Streams that no manager answered are not counted."""
        return max(0, self._answered + self._connected - 1)

    @property
    def connected(self) -> bool:
        """Whether a manager answers on this reporter's open stream (not only that the stream is open)."""
        return self._connected

    def counters(self) -> ReporterCounters:
        return ReporterCounters(
            enqueued=self._enqueued + self._sent_local,
            sent=self.sent,
            dropped=self.dropped,
            connects=self._connects,
            reconnects=self.reconnects,
            connected=self.connected,
            messages=self._messages,
            accepted=self._accepted,
            rejected=self._rejected + self._rejected_here,
            manager_dropped=self._manager_dropped,
            local=self._sent_local + self._drained_local,
            local_fallbacks=self._local_fallbacks,
        )

    def _reported_after_close(self) -> None:
        """A bubble after :meth:`close` is dropped, and said once: a trainer that closed its reporter before its
        instrumented schedule, and trained on, had its bubbles vanish without a word."""
        self._dropped_hot += 1
        if not self._said_closed:
            self._said_closed = True
            log.warning("[%s stage=%d] a bubble was reported after the reporter was closed: it and every later one "
                        "are dropped (close the instrumented schedule first, then its reporter)", self.device,
                        self.stage)

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued (up to ``timeout_s``) and stop the background thread."""
        if self._closed.is_set():
            return
        if self._held:  # the training thread's (close it from there, after the instrumented schedule)
            held = len(self._held)
            try:
                self._send_held()
            except Exception:  # noqa: BLE001 - never raise at close; what did not go is counted
                self._dropped_hot += held
        self._closing = True
        self._closed.set()
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._rejected_here > 1:  # the first was said as it came; the rest only counted (a stranger missed them)
            log.warning("[%s stage=%d] %d bubble events in all were rejected and not sent, the last: %s", self.device,
                        self.stage, self._rejected_here, self._rejected_last)
        log.debug("[%s stage=%d] reporter closed: %s", self.device, self.stage, self.counters())

    def __enter__(self) -> BubbleReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- background thread

    def _to_event(self, item: tuple[object, ...]) -> TrainerEvent:
        """A queued item (its route epoch last, left out here) as the event it reports."""
        item = item[:-1]
        if item[0] == _LAYOUT:
            _, schedule, stages, microbatches, devices, at_ns, free = item
            return TrainerLayout(
                schedule=str(schedule),
                stages=int(stages),  # type: ignore[call-overload]
                microbatches=int(microbatches),  # type: ignore[call-overload]
                stage_devices=tuple(str(d) for d in devices),  # type: ignore[attr-defined]
                at_ns=int(at_ns),  # type: ignore[call-overload]
                free_memory_bytes=int(free),  # type: ignore[call-overload]
                job=self.job,
            )
        if item[0] == _START:
            _, iteration, slot, kind, start_ns, predicted_ns, free, learned = item
            return BubbleStart(
                stage=self.stage,
                rank=self.rank,
                iteration=int(iteration),  # type: ignore[call-overload]
                slot=int(slot),  # type: ignore[call-overload]
                kind=str(kind),
                start_ns=int(start_ns),  # type: ignore[call-overload]
                predicted_ns=max(1, int(predicted_ns)),  # type: ignore[call-overload]
                free_memory_bytes=int(free),  # type: ignore[call-overload]
                learned=bool(learned),
            )
        _, iteration, slot, end_ns = item
        return BubbleEnd(self.stage, self.rank, int(iteration), int(slot), int(end_ns))  # type: ignore[call-overload]

    def _batches(self, alive: threading.Event) -> Iterator[list[TrainerEvent]]:
        """The request iterator of one call: runs on gRPC's sender thread until the call ends.

        Blocks for the first event, then takes whatever else is queued without waiting, so each
        message carries everything that piled up while the previous one was being sent.
        """
        q = self._queue
        relayout, self._relayout = self._relayout, None
        if relayout is not None and alive.is_set():
            yield [relayout]
        while alive.is_set():
            try:
                item = q.get(timeout=0.2)
            except queue.Empty:
                continue
            batch: list[TrainerEvent] = []
            stop = False
            while True:
                if item is _STOP:
                    stop = True
                    break
                if item is _CALL_ENDED:  # its own call's end (a later call's iterator passes it by)
                    if not alive.is_set():
                        break
                    try:
                        item = q.get_nowait()
                    except queue.Empty:
                        break
                    continue
                try:
                    if item[-1] >= self._wire_from:  # type: ignore[index]
                        event = self._to_event(item)  # type: ignore[arg-type]
                        if self._sendable(event):
                            batch.append(event)
                    else:  # queued before this connection's datagrams began: it would arrive after them
                        self._dropped_bg += 1
                except Exception:  # noqa: BLE001 - a malformed event is dropped, the stream goes on
                    self._dropped_bg += 1
                if len(batch) >= MAX_BATCH_EVENTS or (self._cut_at_ends and item[0] == _END):  # type: ignore[index]
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
            if not alive.is_set():
                # This call ended while we waited; the events would go nowhere. Count them.
                self._dropped_bg += len(batch)
                batch = []
            if batch:
                self._sent += len(batch)
                self._messages += 1
                yield batch
            if stop:
                q.put(_STOP)  # let the supervisor see it too
                return
            if not alive.is_set():
                return

    def _discard_queued(self) -> bool:
        """Drop what piled up while disconnected; True if close() was requested meanwhile."""
        stop = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return stop
            if item is _STOP:
                stop = True
            elif item is not _CALL_ENDED:
                self._dropped_bg += 1

    def _run(self) -> None:
        if self._cpu_affinity:
            # Linux affinity is per thread and inherited by the threads this one starts (gRPC's
            # request-consumer thread): a trainer pinned to one core keeps the sends off that core.
            try:
                os.sched_setaffinity(0, self._cpu_affinity)
            except OSError as exc:
                log.debug("reporter thread affinity %s not applied: %s", self._cpu_affinity, exc)
        backoff = self._backoff_initial_s
        absent_since: float | None = None  # since when no manager's socket has been at the endpoint
        absent_told = False
        lost: tuple[float, int] | None = None  # since when an answering manager went away, and the drops then
        while not self._closed.is_set():
            alive = threading.Event()
            alive.set()
            sent_before = self.sent
            stream = None
            answered = False  # the manager answered on this connection (``reconnects``)
            try:
                self._end_board = self._open_end_board()
                if self._end_board is not None and self._trainer_tid:
                    self._end_board.set_trainer_thread(self.rank, self._trainer_tid)
                if self._end_board is not None and self._use_local_events:
                    self._use_local(self._open_local())  # before the wire takes anything from the queue
                if self._connects:
                    self._resend_layout()
                stream = self._open_stream(alive)
                self._connects += 1
                while not stream.done():
                    if self._closed.is_set():
                        break
                    if self._connected:
                        time.sleep(0.05)
                    else:  # until the manager answers (gRPC connects lazily): waits as long as the sleep
                        self._connected = stream.answers(timeout_s=0.05) and not stream.done()
                        answered = self._connected
                        if answered and lost is not None:
                            self._tell_back(*lost)
                            lost = None
                        # Over TCP a peer that takes the connection and never answers keeps the stream open.
                        if not answered and self.endpoint.kind == "tcp" and not absent_told:
                            absent_since = absent_since or time.monotonic()
                            absent_told = self._tell_absent(absent_since)
                if self._closed.is_set():
                    try:
                        self._add_summary(stream.summary(timeout_s=2.0))
                    except Exception:  # noqa: BLE001 - closing: the outcome no longer matters
                        pass
                    break
                summary = stream.summary(timeout_s=0)
                self._add_summary(summary)
                if summary.rejected:
                    log.warning("[%s stage=%d] manager rejected %d bubble events, last: %s", self.device,
                                self.stage, summary.rejected, summary.last_error)
            except Exception as exc:  # noqa: BLE001 - any failure means: back off and retry
                if self.sent > sent_before or self._connects <= 1:
                    log.info("[%s stage=%d] bubble stream to %s ended: %s", self.device, self.stage,
                             self.endpoint, exc)
                # A typo in the device or the endpoint would otherwise go unnoticed: say it once, when no
                # manager's socket has been there for a while (a killed manager's stays: not this case), or no
                # manager has answered over TCP for as long (a TCP endpoint was dropped without a word).
                unix = self.endpoint.kind == "unix"
                absent = not os.path.exists(self.endpoint.address) if unix else not answered
                absent_since = (absent_since or time.monotonic()) if absent else None
                if absent_since is not None and not absent_told:
                    absent_told = self._tell_absent(absent_since)
            finally:
                with self._route_lock:  # the training thread may be sending on it: dropped, never closed here
                    self._route = (None, self._route[1] + 1)
                alive.clear()
                self._queue.put(_CALL_ENDED)  # before any event for the next call: its iterator stops here
                # A connection that carried events was answered too, whether or not its health check ran first.
                self._answered += answered or self.sent > sent_before
                self._connected = False
                if stream is not None:
                    stream.close()
            if self.sent > sent_before:
                backoff = self._backoff_initial_s
            # gRPC takes events from the queue before it finds no one there: events taken say that a manager was
            # reached only where its socket is there (a killed one leaves it; a rank whose manager never ran, or
            # whose socket was removed, was told that it "went away").
            reached = answered or (self.sent > sent_before and not (
                self.endpoint.kind == "unix" and not os.path.exists(self.endpoint.address)))
            if reached and lost is None and not self._closed.is_set():
                # A killed manager leaves its socket behind, so the absence above says nothing of it.
                lost = (time.monotonic(), self.dropped)
                log.warning("[%s stage=%d] the freeride manager at %s went away: this rank's bubbles are dropped "
                            "until one answers there again (reconnecting)", self.device, self.stage, self.endpoint)
            if self._closed.wait(backoff) or self._discard_queued():
                break
            backoff = min(self._backoff_max_s, backoff * 2)
        self._discard_queued()

    def _tell_back(self, since: float, dropped: int) -> None:
        """Say that a manager answers again, after the one before went away at ``since`` (monotonic s)."""
        log.warning("[%s stage=%d] a freeride manager answers at %s again after %.1f s (%d bubble events dropped "
                    "meanwhile)", self.device, self.stage, self.endpoint, time.monotonic() - since,
                    self.dropped - dropped)

    def _tell_absent(self, since: float) -> bool:
        """Say once that no manager has been there since ``since`` (monotonic s), when that is
        :data:`ABSENT_WARNING_S` ago; True when said."""
        now = time.monotonic()
        if now - since < ABSENT_WARNING_S:
            return False
        unix = self.endpoint.kind == "unix"
        hint = (f"is `freeride manager --device {self.device}` running, and is the device name right?" if unix
                else f"is a manager started with --endpoint {self.endpoint} running, and does this host reach it?")
        log.warning("[%s stage=%d] no freeride manager %s at %s (for %.0f s): this rank's bubbles are dropped until "
                    "one does (%s)", self.device, self.stage, "listens" if unix else "answers", self.endpoint,
                    now - since, hint)
        return True

    def _resend_layout(self) -> None:
        """Tell a reconnection's manager the job's last layout again (sender thread): a restarted manager never
        heard it, and one that had it changes nothing (the same job). As a local datagram where that route is
        up, else as the new stream's first message. Not an event of the training thread's: no counter counts
        it, so that ``sent + dropped == enqueued`` holds however often the reporter reconnects."""
        last = self._last_layout
        self._relayout = None
        if last is None:
            return
        layout = TrainerLayout(*last, job=self.job)
        local, _ = self._route
        if local is None or not local.send(layout):
            self._relayout = layout  # :meth:`_batches` sends it first

    def _open_end_board(self) -> EndBoard | None:
        """The manager's end board, when it listens on a unix socket and keeps one (else None)."""
        if self.endpoint.kind != "unix" or not self._use_end_board:
            return None
        try:
            return EndBoard.open(end_board_path(self.endpoint.address), writable=True)
        except (OSError, ValueError) as exc:  # an older manager, or one that could not make it
            log.debug("[%s stage=%d] no end board beside %s: %s", self.device, self.stage, self.endpoint, exc)
            return None

    def _open_local(self) -> LocalEventSender | None:
        """The manager's local event socket (else None: events go over the wire)."""
        try:
            return LocalEventSender(local_events_path(self.endpoint.address))
        except OSError as exc:
            log.debug("[%s stage=%d] no local event socket beside %s: %s", self.device, self.stage, self.endpoint,
                      exc)
            return None

    @property
    def _local(self) -> LocalEventSender | None:
        return self._route[0]

    def _use_local(self, local: LocalEventSender | None) -> None:
        """This connection's events go as datagrams (``local``; None: over the wire, as they did).

        Called before the wire takes anything from the queue: what is queued now goes first, as datagrams,
        in order (a send that fails means the manager is gone: the rest is dropped and counted, as events
        queued while no manager listens are). An event the training thread queues under the old route while
        the route changes would reach the manager after the datagrams that follow it: the wire drops it
        (its epoch is older than ``_wire_from``), counted; that takes a call racing this one to the
        microsecond, once per connection.
        """
        if local is None:
            return
        with self._route_lock:
            epoch = self._route[1] + 1
            drained: list[object] = []
            while True:
                try:
                    drained.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for i, item in enumerate(drained):
                if item is _CALL_ENDED:  # the last call's iterator is gone, or stops on its own
                    continue
                if item is _STOP:
                    self._queue.put(_STOP)
                    continue
                try:
                    sent = local.send(self._to_event(item))  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001 - a malformed event is dropped, as the wire would
                    sent = False
                if not sent:
                    self._dropped_bg += sum(1 for rest in drained[i:] if rest is not _STOP and rest is not _CALL_ENDED)
                    if _STOP in drained[i:]:
                        self._queue.put(_STOP)
                    return  # the manager is gone (or far behind): this connection stays on the wire
                self._drained_local += 1
            self._route = (local, epoch)
            self._wire_from = epoch + 1

    def _local_failed(self, local: LocalEventSender) -> int:
        """A datagram did not go (the manager is thousands of events behind, or gone): this connection's
        events go over the wire from now on, the failed one first, so that none overtakes another
        (:mod:`freeride._local_events`). Returns the epoch to queue it under."""
        with self._route_lock:
            if self._route[0] is local:
                epoch = self._route[1] + 1
                self._route = (None, epoch)
                self._wire_from = epoch
                self._local_fallbacks += 1
            return self._route[1]

    def _sendable(self, event: TrainerEvent) -> bool:
        """Whether ``event`` is well formed: one that is not is rejected here, counted and said (the first as it
        comes, how many at close), as the manager rejects it from the local socket, and not sent. A negative
        iteration went out and failed the stream's serializer: the stream ended, "the manager went away" was
        logged, and the events queued after it were lost (a stranger's trial)."""
        try:
            if isinstance(event, TrainerLayout):
                validate_layout(event)
            else:
                validate_bubble_event(event)
                if isinstance(event, BubbleEnd) and (event.iteration, event.slot) == self._rejected_start:
                    # Its start was not sent: sent alone, the end reached the manager as "out of order", one bad
                    # bubble in two counters on two machines (a stranger's).
                    raise ConfigError("its start was rejected")
        except ConfigError as exc:
            self._rejected_here += 1
            self._rejected_last = str(exc)
            if isinstance(event, BubbleStart):
                self._rejected_start = (event.iteration, event.slot)
            if self._rejected_here == 1:
                log.warning("[%s stage=%d] a bubble event was rejected and not sent: %s (each such event is counted "
                            "in the reporter's rejected events, said again when it closes, and the stream goes on)",
                            self.device, self.stage, exc)
            return False
        return True

    def _add_summary(self, summary: StreamSummary) -> None:
        self._accepted += summary.accepted
        self._rejected += summary.rejected
        self._manager_dropped += summary.dropped
        if summary.dropped:
            log.info("[%s stage=%d] the manager stopped before handling %d bubble events", self.device, self.stage,
                     summary.dropped)

    def _open_stream(self, alive: threading.Event) -> BubbleStream:
        from freeride._wire.client import BubbleStream

        return BubbleStream(self.endpoint, self._batches(alive), token=self._token)


def _cores_text(cores: set[int]) -> str:
    """``0-3,6``: a set of cores as ranges."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
