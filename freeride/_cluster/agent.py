"""A manager's queue agent: the thread that does all of the manager's Redis I/O.

The manager loop never waits on Redis. The agent talks to the loop only the way gRPC servicers do:
it *posts* claimed tasks and release requests (fire and forget), and *asks* the loop, through
``call_async`` with a deadline, for a :class:`~freeride._cluster.records.QueueView` (room for more,
and the cluster tasks held here). The loop tells the agent what a cluster task did through a
callback that only appends to a deque (``ManagerLoop.queue_notes``), and reads the agent's figures
(:class:`~freeride.messages.QueueStats`, a frozen snapshot replaced at each poll) through
``ManagerLoop.queue_stats``.

Each poll (``poll_ms``), in this order:

1. **Write what the loop reported**: a task that ended is recorded and acknowledged (``finish``); a
   task that left this device (evicted, drained, released) is handed back to the waiting room
   (``release``); a lost one is forgotten; a claimed record that turned out unreadable is set aside.
   These writes are kept until Redis takes them.
2. **Renew the leases** every third of the lease -- before anything that asks the loop, so that a busy
   loop never delays a renewal. Tasks the renewal says are lost (another manager took them after this
   one's lease expired) are killed here without a checkpoint; tasks a user cancelled with ``freeride
   cancel --queue`` are cancelled.
3. **Progress** of every held task whose figures changed (one pipelined round trip).
4. **Hand back** a claimed task still waiting for memory here after ``hold_ms``: this device cannot
   start it, another may. And, when nothing waits in the queue, one task (at most one per lease) that a
   manager holding at least two fewer could place, as it announced itself (:meth:`QueueAgent._hand_over`).
5. **Sweep** expired leases back to the waiting room. One manager per half lease does it for the whole
   cluster (a lock in Redis), and the server itself holds every sweep back until managers have been in
   contact with it for a whole lease (the contact clock, :mod:`~freeride._cluster.scripts`): after a
   restart of Redis, or an outage every manager saw, every live holder renews before anyone takes its
   silence for death.
6. **Claim**: peek at the waiting room; set aside what cannot be read there; unless this manager claimed
   less than ``spread_ms`` times the cluster tasks it holds ago (a device runs one task at a time: a
   manager holding fewer takes the next one first), rank what
   :mod:`~freeride._cluster.placement` says this manager can place, claim the first it can (atomically;
   another manager may have been faster, then the next), read the whole record (unreadable: set aside,
   never run), validate its spec with the same function as ``Submit``, and post it to the loop. A few per
   poll, each decided on a fresh view.

**Outages.** Any Redis error ends the poll: the agent marks itself disconnected, logs once, and tries
again after a backoff (doubling from ``poll_ms`` to ``backoff_max_ms``, and never beyond a quarter of
the lease, so that a holder cut off alone renews soon after Redis answers again). Each command is bounded
by a timeout of at most half the lease. Nothing escapes into the loop; local tasks and the cluster tasks
already here go on. On reconnection it renews its leases first: what it lost meanwhile is stopped here,
what it kept goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from freeride._cluster import fencing, placement, require_client, schema
from freeride._cluster.records import (
    CLAIMED,
    CancelTask,
    ClaimedTask,
    ClusterRecord,
    GetQueueView,
    QueueNote,
    QueueView,
    ReleaseTask,
    status_fields,
)
from freeride._cluster.url import QueueURL, parse_queue_url
from freeride._validation import validate_submission
from freeride.errors import ConfigError, FreerideError, ManagerUnavailable, RequestRejected, Unauthenticated
from freeride.messages import FailureRecord, QueueStats, TaskProgress, TaskRecord, TaskSpec

log = logging.getLogger(__name__)

#: Claims an agent makes in one poll at most, each on a fresh view of the loop.
CLAIMS_PER_POLL = 8
#: Queued tasks an agent looks at per poll (the head of the waiting room, in claim order).
PEEK_TASKS = 64
#: For how many leases a manager does not claim back a task it handed over to a manager holding fewer.
HANDED_OVER_LEASES = 3
#: For how many leases a manager that did not take a task handed over for it is handed no other.
PASSED_OVER_LEASES = 30


@dataclass(frozen=True)
class QueueConfig:
    """A manager's queue settings; units are in the names."""

    url: QueueURL
    #: Shared by every node: cluster tasks checkpoint to ``<checkpoint_dir>/<task id>/``.
    checkpoint_dir: Path
    #: A holder that has not renewed for this long loses its tasks to the queue.
    lease_ms: int = 10_000
    poll_ms: float = 200.0
    #: A claimed task still waiting for memory here after this long is handed back.
    hold_ms: float = 5_000.0
    #: After a claim, a manager holding n cluster tasks claims its next only n times this later: a manager
    #: with fewer tasks (one whose device saw its first bubble a moment later) takes the next one first.
    #: Bubble time, not memory, is what a device runs short of: a device runs one task at a time.
    spread_ms: float = 1_000.0
    backoff_max_ms: float = 5_000.0
    #: How long a stopping manager keeps trying to hand its tasks back before their leases do it.
    flush_timeout_ms: float = 5_000.0

    def __post_init__(self) -> None:
        if self.lease_ms < 100:
            raise ConfigError(f"the queue lease must be at least 100 ms, got {self.lease_ms}")
        if not 0 < self.poll_ms <= self.lease_ms / 3:
            raise ConfigError(f"the queue poll ({self.poll_ms} ms) must be > 0 and at most a third of the lease "
                              f"({self.lease_ms} ms): leases are renewed at polls")
        for name in ("hold_ms", "backoff_max_ms", "flush_timeout_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"queue {name} must be > 0")
        if not 0 <= self.spread_ms < float("inf"):
            raise ConfigError(f"queue spread_ms must be a finite number >= 0, got {self.spread_ms}")

    @classmethod
    def from_text(cls, url: str, checkpoint_dir: str | Path, **kw: Any) -> QueueConfig:
        return cls(parse_queue_url(url), Path(checkpoint_dir), **kw)

    @property
    def retry_max_ms(self) -> float:
        """The longest wait between two tries while Redis does not answer: the backoff's cap, and never
        more than a quarter of the lease (a holder cut off alone must renew soon after Redis is back)."""
        return max(self.poll_ms, min(self.backoff_max_ms, self.lease_ms / 4))

    @property
    def command_timeout_s(self) -> float:
        """Each Redis command's limit: 2 s, or half the lease if that is shorter."""
        return min(2.0, self.lease_ms / 2000)


class LoopPort(Protocol):
    """What the agent needs of the manager loop (``ManagerLoop`` provides it; tests may fake it).

    The agent posts :class:`ClaimedTask`, :class:`ReleaseTask` and :class:`CancelTask`, asks
    :class:`GetQueueView`, is told what its tasks did through ``queue_notes``, and offers its figures
    through ``queue_stats``.
    """

    queue_notes: Callable[[QueueNote], None] | None
    queue_stats: Callable[[], QueueStats] | None

    def post(self, event: Any) -> None: ...

    def call_async(self, request: Any) -> Any: ...


class QueueAgent:
    """Connects one manager to the cluster queue; see the module docstring."""

    def __init__(
        self,
        loop: LoopPort,
        config: QueueConfig,
        device: str,
        node: str,
        queue_factory: Callable[[QueueURL], Any] | None = None,
    ) -> None:
        if queue_factory is None:
            require_client()
        from freeride._cluster.redis_queue import Held, RedisQueue

        self._held_type = Held
        self.loop = loop
        self.config = config
        self.where = f"{node}/{device}"
        #: This manager's consumer in the group: unique per process, so a restarted manager never
        #: mistakes its predecessor's tasks for its own (they come back through the lease).
        self.me = f"{self.where}/{os.getpid()}-{secrets.token_hex(3)}"
        self._factory = queue_factory or (lambda url: RedisQueue(url, timeout_s=config.command_timeout_s))
        self._queue: Any = None
        self._notes: collections.deque[QueueNote] = collections.deque()
        loop.queue_notes = self._notes.append  # called on the loop thread: an append, never blocks
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: dict[str, Any] = {}  # task id -> Held
        self._leaving: set[str] = set()  # asked to leave; the loop has not said it left yet
        self._pending: dict[str, QueueNote] = {}  # final writes Redis has not taken yet
        self._asides: dict[str, tuple[Any, str]] = {}  # claimed, unreadable, not yet set aside: (Held, why)
        self._written: dict[str, dict[str, str]] = {}
        self._waiting_since: dict[str, float] = {}
        self._connected_at: float | None = None
        self._next_heartbeat = 0.0
        self._claimed_at = -math.inf  # when it last claimed (``QueueConfig.spread_ms``)
        self._handed_over: dict[str, float] = {}  # task id -> until when it is not claimed back (:meth:`_hand_over`)
        self._handed_over_at = -math.inf
        self._peers: list[Any] = []  # the other managers, as the last announce read them
        self._given_to: dict[str, tuple[str, float]] = {}  # task id handed over -> (the manager it was for, until)
        self._passed_over: dict[str, float] = {}  # manager that did not take one -> until when it is handed none
        self._in_grace = False
        self.counters: dict[str, int] = collections.Counter()
        self._failed_attempts = 0  # since the last connection
        self.last_error = ""
        self._depth = (0, 0)  # the queue's waiting tasks and set-aside records at the last peek
        self._stats = self._snapshot()
        loop.queue_stats = self.stats

    # ------------------------------------------------------------ lifecycle

    @property
    def connected(self) -> bool:
        return self._connected_at is not None

    def stats(self) -> QueueStats:
        """The figures as of the last poll (any thread: a frozen snapshot, replaced whole)."""
        return self._stats

    def _snapshot(self) -> QueueStats:
        c = self.counters
        return QueueStats(
            connected=self.connected, lease_ms=self.config.lease_ms, depth=self._depth[0], set_aside=self._depth[1],
            held=len(self._held), claims=c["claims"], reclaims=c["reclaimed"], renewals=c["renewals"],
            lost=c["lost"], handed_back=c["handed_back"], set_aside_here=c["set_aside"], errors=c["errors"],
            graces=c["graces"], last_error=self.last_error,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="freeride-queue", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop polling; hand back what the loop released (until ``flush_timeout_ms``), then stop."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            limit = self.config.flush_timeout_ms / 1000 + 5 if timeout_s is None else timeout_s
            self._thread.join(limit)
        self.loop.queue_notes = None
        self.loop.queue_stats = None

    def check_credentials(self) -> None:
        """Connect once now: refused credentials are a configuration error (raised); an unreachable
        queue is an outage (logged, and the agent keeps trying once started)."""
        try:
            self._connect()
        except Unauthenticated:
            raise
        except FreerideError as exc:
            log.warning("[%s] the queue is not reachable yet (%s); local tasks are served, retrying", self.where,
                        exc)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        backoff = self.config.poll_ms
        while not self._stopping.is_set():
            if self._pass():
                backoff = self.config.poll_ms
                delay = self.config.poll_ms
            else:
                delay = backoff
                backoff = min(self.config.retry_max_ms, backoff * 2)
            self._stats = self._snapshot()
            self._wake.wait(delay / 1000)
            self._wake.clear()
        self._final_flush()

    def _pass(self) -> bool:
        """One pass of the thread's loop: connect where not connected, then poll. False when it failed: a
        queue error (an outage, a slow reply past the socket timeout) or a bug here is counted and logged,
        never raised, and the loop backs off and tries again (the queue's writes are fenced by claim epoch, and a
        claim whose answer was lost comes back to the queue when its lease runs out)."""
        try:
            if self._queue is None or self._connected_at is None:
                self._connect()
            self._poll()
            return True
        except FreerideError as exc:
            self._disconnected(exc)
        except Exception as exc:  # a bug here must not stop the manager: log, back off, go on
            log.exception("[%s] queue agent poll failed", self.where)
            self._disconnected(exc)
        return False

    def _connect(self) -> None:
        if self._queue is None:
            self._queue = self._factory(self.config.url)
        self._queue.connect()
        if self._connected_at is None:
            # Said as loudly as the outage before it: at the default level the log had the loss and never the
            # recovery.
            failed, self._failed_attempts = self._failed_attempts, 0
            again = f" (again, after {failed} failed attempt(s))" if failed else ""
            log.log(logging.WARNING if failed else logging.INFO, "[%s] connected to the queue at %s as %s%s",
                    self.where, self.config.url, self.me, again)
            self._connected_at = time.monotonic()
            self._next_heartbeat = 0.0  # renew at once: this manager may have been away for a while

    def _disconnected(self, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self._failed_attempts += 1
        self.last_error = str(exc)
        if self._connected_at is not None or self.counters["errors"] == 1:
            log.warning("[%s] queue unavailable: %s; local and running tasks go on, retrying with backoff",
                        self.where, str(exc).rstrip(". "))
        self._connected_at = None

    def _final_flush(self) -> None:
        """Hand back what the loop released while stopping (a drain), for at most ``flush_timeout_ms``."""
        deadline = time.monotonic() + self.config.flush_timeout_ms / 1000
        while (self._notes or self._pending or self._asides) and time.monotonic() < deadline:
            try:
                if self._queue is None or self._connected_at is None:
                    self._connect()
                self._write_notes()
            except FreerideError as exc:
                self._disconnected(exc)
                time.sleep(min(0.2, self.config.poll_ms / 1000))
        if self._notes or self._pending:
            log.warning("[%s] stopping with %d task(s) not handed back to the queue; their leases will expire",
                        self.where, len(self._notes) + len(self._pending))
        elif self._connected_at is not None:
            try:
                self._queue.retire(self.me)
            except FreerideError:
                pass
        if self._queue is not None:
            self._queue.close()

    # ------------------------------------------------------------ one poll

    def _poll(self) -> None:
        self._write_notes()
        now = time.monotonic()
        beat = now >= self._next_heartbeat
        if beat:
            self._heartbeat()
            self._next_heartbeat = now + self.config.lease_ms / 3000
        view = self._view()
        if view is None:
            return
        if beat:  # this device's size and room, for submit --queue and for managers holding more than it
            self._peers = self._queue.announce(self.me, self.where, view.capacity, len(self._held),
                                               self.config.lease_ms, time.time())
        self._write_progress(view)
        self._hand_back_waiting(view, now)
        if beat:
            self._hand_over(view, now)
        self._sweep()
        for _ in range(CLAIMS_PER_POLL):
            if self._stopping.is_set() or not self._claim_one(view):
                break
            self._claimed_at = time.monotonic()
            view = self._view()
            if view is None:
                break

    def _sweep(self) -> None:
        sweep = self._queue.sweep(self.me, self.config.lease_ms, max(1, self.config.lease_ms // 2), time.time())
        self.counters["set_aside"] += sweep.set_aside
        if sweep.status == "grace":
            self.counters["graces"] += 1
            if not self._in_grace:
                log.info("[%s] the queue's server restarted, or no manager had reached it for a lease: no lease "
                         "expires for %d ms, while every live holder renews", self.where, sweep.grace_ms)
            self._in_grace = True
        elif sweep.status == "swept":
            self._in_grace = False
        if sweep.moved > 0:
            self.counters["reclaimed"] += sweep.moved
            log.info("[%s] %d task(s) whose holder's lease expired went back to the queue", self.where, sweep.moved)

    def _view(self) -> QueueView | None:
        future = self.loop.call_async(GetQueueView())
        deadline = time.monotonic() + 1.0
        try:
            # In slices, so that a manager that stops (its loop no longer answers) does not wait here.
            while True:
                try:
                    view = future.result(timeout=0.05)
                    break
                except FutureTimeout:
                    if self._stopping.is_set() or time.monotonic() > deadline:
                        return None  # the loop is busy or stopped: no decisions on stale figures
        except ManagerUnavailable:  # the loop has stopped
            return None
        except Exception:  # noqa: BLE001 - the loop's answer failed; try again at the next poll
            log.exception("[%s] the loop did not give its queue view", self.where)
            return None
        return view if isinstance(view, QueueView) else None

    def _write_notes(self) -> None:
        while self._notes:
            note = self._notes.popleft()
            self._pending[note.record.task_id] = note
        for task_id, note in list(self._pending.items()):
            held = self._held.get(task_id)
            if held is not None and note.kind != "lost":
                fields = status_fields(note.record, time.time())
                if note.kind == "ended":
                    fields["reason"] = note.reason or note.record.state.lower()
                    self._queue.finish(self.me, held, fields)
                    self.counters["ended"] += 1
                else:
                    fields["reason"] = f"left {self.where}: {note.reason}"
                    outcome = self._queue.release(self.me, held, fields, time.time())
                    if outcome == "released":
                        self.counters["handed_back"] += 1
                    elif outcome == "aside":  # its record can no longer be queued: the queue set it aside
                        self.counters["set_aside"] += 1
            del self._pending[task_id]
            self._forget(task_id)
        for task_id, (held, why) in list(self._asides.items()):
            if self._queue.set_aside(task_id, why, time.time(), self.me, held):
                self.counters["set_aside"] += 1
            del self._asides[task_id]
            self._forget(task_id)

    def _forget(self, task_id: str) -> None:
        self._held.pop(task_id, None)
        self._leaving.discard(task_id)
        self._written.pop(task_id, None)
        self._waiting_since.pop(task_id, None)

    def _write_progress(self, view: QueueView) -> None:
        writes = []
        for task in view.tasks:
            held = self._held.get(task.task_id)
            if held is None or task.task_id in self._leaving or task.task_id in self._pending:
                continue
            fields = status_fields(task, time.time())
            compare = {k: v for k, v in fields.items() if k != "updated_unix"}
            if self._written.get(task.task_id) != compare:
                writes.append((held, fields, compare))
        if not writes:
            return
        results = self._queue.update(self.me, [(h, f) for h, f, _ in writes])
        for (held, _fields, compare), ok in zip(writes, results, strict=True):
            if ok:
                self._written[held.task_id] = compare
            else:
                self._lost(held.task_id)

    def _heartbeat(self) -> None:
        held = [h for tid, h in self._held.items()
                if tid not in self._leaving and tid not in self._pending and tid not in self._asides]
        renewal = self._queue.heartbeat(self.me, held, self.config.lease_ms)
        self.counters["renewals"] += renewal.renewed
        for task_id in renewal.lost:
            self._lost(task_id)
        for task_id in renewal.cancelled:
            log.info("[%s task=%s] cancelled through the queue", self.where, task_id)
            self.loop.post(CancelTask(task_id))

    def _lost(self, task_id: str) -> None:
        if task_id in self._leaving:
            return
        self.counters["lost"] += 1
        log.warning("[%s task=%s] another manager holds this task now (this one's lease expired); stopping "
                    "the copy here without a checkpoint", self.where, task_id)
        self._leaving.add(task_id)
        self._held.pop(task_id, None)
        self.loop.post(ReleaseTask(task_id, "lease lost to another manager", checkpoint=False))

    def _hand_back_waiting(self, view: QueueView, now: float) -> None:
        waiting = {s.task_id for s in view.tasks if s.state == "SUBMITTED"}
        for task_id in list(self._waiting_since):
            if task_id not in waiting:
                del self._waiting_since[task_id]
        for task_id in waiting:
            if task_id in self._leaving or task_id not in self._held:
                continue
            since = self._waiting_since.setdefault(task_id, now)
            if now - since >= self.config.hold_ms / 1000:
                log.info("[%s task=%s] still waiting for memory after %.0f ms: handing it back", self.where,
                         task_id, self.config.hold_ms)
                self._leaving.add(task_id)
                self.loop.post(ReleaseTask(task_id, "waited for memory here", checkpoint=True))

    def _hand_over(self, view: QueueView, now: float) -> None:
        """Hand one task back, with a checkpoint, for a manager that holds at least two fewer and could place it,
        when nothing waits in the queue: claims are spread as tasks arrive, but a manager that joined (or whose
        trainer started) after the queue emptied got none of the tasks the others held, and its device idled
        while theirs ran several each in turn. At most one per lease; the task is not claimed back here for
        :data:`HANDED_OVER_LEASES` leases, so that the manager with fewer takes it (a manager that cannot, after
        all, leaves it to be claimed again, and is not handed another for :data:`PASSED_OVER_LEASES` leases: a task
        must not shuttle between two managers, stopped with a checkpoint at each move)."""
        lease_s = self.config.lease_ms / 1000
        self._forget_expired_hand_overs(now)
        if self._depth[0] > 0 or now < self._handed_over_at + lease_s or self._stopping.is_set():
            return
        mine = [t for t in view.tasks if t.task_id in self._held and t.task_id not in self._leaving
                and t.task_id not in self._pending and t.state not in ("FINISHED", "FAILED", "CANCELLED")]
        if len(mine) < 2:
            return
        peers = [p for p in self._peers  # as this beat's announce read them
                 if p.capacity is not None and p.held <= len(mine) - 2 and p.me not in self._passed_over]
        # The lowest priority, then the newest submission: the task this manager would have claimed last.
        for task in sorted(mine, key=lambda t: (t.spec.priority, -t.seq)):
            step_ms = task.figures.step_p95_ms or task.spec.step_time_hint_ms
            candidate = placement.Candidate(task.task_id, task.spec.memory_bytes, task.spec.priority, task.seq,
                                            int(step_ms * 1e6) if step_ms > 0 else None)
            for peer in sorted(peers, key=lambda p: p.held):
                if placement.refusal(candidate, peer.capacity) is None:
                    log.info("[%s task=%s] handing it back for %s, which holds %d cluster task(s) to this "
                             "device's %d and nothing waits in the queue", self.where, task.task_id, peer.where,
                             peer.held, len(mine))
                    self._leaving.add(task.task_id)
                    self._handed_over[task.task_id] = now + HANDED_OVER_LEASES * lease_s
                    self._given_to[task.task_id] = (peer.me, now + PASSED_OVER_LEASES * lease_s)
                    self._handed_over_at = now
                    self.loop.post(ReleaseTask(task.task_id, f"handed over to {peer.where}, which held fewer tasks",
                                               checkpoint=True))
                    return

    def _forget_expired_hand_overs(self, now: float) -> None:
        for task_id in [t for t, until in self._handed_over.items() if now >= until]:
            del self._handed_over[task_id]
        for peer_id in [m for m, until in self._passed_over.items() if now >= until]:
            del self._passed_over[peer_id]
        for task_id in [t for t, (_peer, until) in self._given_to.items() if now >= until]:
            del self._given_to[task_id]

    def _claim_one(self, view: QueueView) -> bool:
        """Claim one task this manager can place; True if it did (worth looking again). Whatever cannot be
        read at the head of the waiting room is set aside on the way, even by a manager that takes nothing."""
        peek = self._queue.waiting(PEEK_TASKS)
        self._depth = (peek.depth, peek.set_aside)
        for raw_id, why in peek.unreadable:
            if self._queue.set_aside(raw_id, why, time.time()):
                self.counters["set_aside"] += 1
                log.warning("[%s] set aside queue record %s: %s", self.where, schema.shown(raw_id), why)
        if placement.closed_reason(view.capacity) is not None or self._spreading():
            return False
        here = set(self._held) | self._leaving | {s.task_id for s in view.tasks} | set(self._handed_over)
        claim = self._first_claim([c for c in peek.candidates if c.task_id not in here], view.capacity)
        if claim is None or claim.held is None:
            return False
        held = claim.held
        self._held[held.task_id] = held
        self.counters["claims"] += 1
        given_to = self._given_to.pop(held.task_id, None)
        if given_to is not None:  # a task handed over came back: that manager did not take it
            self._passed_over[given_to[0]] = time.monotonic() + PASSED_OVER_LEASES * self.config.lease_ms / 1000
        if claim.record is None:  # claimed, but the record cannot be read: set it aside, never run it
            log.warning("[%s task=%s] claimed an unreadable record; setting it aside: %s", self.where, held.task_id,
                        claim.reason)
            self._asides[held.task_id] = (held, claim.reason)
            return True
        claimed = self._claimed(claim.record)
        if claimed is None:
            return True
        log.info("[%s task=%s] claimed (epoch %d, restarts %d)", self.where, held.task_id, held.epoch,
                 claim.record.restarts)
        self.loop.post(claimed)
        return True

    def _spreading(self) -> bool:
        """It claimed less than ``spread_ms`` times the tasks it holds ago: the more it holds, the longer it
        leaves the next task to managers holding fewer (a device runs one task at a time)."""
        return time.monotonic() < self._claimed_at + len(self._held) * self.config.spread_ms / 1000

    def _first_claim(self, candidates: list[Any], capacity: Any) -> Any:
        """Claim the first task this manager can place, in placement's order; the claim, or None."""
        for choice in placement.ranked(candidates, capacity):
            claim = self._queue.claim(choice.task_id, self.me, self.where, time.time())
            if claim.held is not None:
                return claim
            if claim.status == "aside":
                self.counters["set_aside"] += 1
                log.warning("[%s task=%s] set aside: %s", self.where, choice.task_id, claim.reason)
            # else another manager was faster (or it left the queue): the next one in line
        return None

    def _claimed(self, record: ClusterRecord) -> ClaimedTask | None:
        """The task to post to the loop; a spec that does not validate fails the task in the queue."""
        sub = record.submission
        # The working directory must exist where the task runs, not where it was submitted: a node that
        # lacks it starts the task in its own work directory (the import then says what is missing).
        local_dir = sub.working_dir if sub.working_dir and os.path.isdir(sub.working_dir) else ""
        try:
            spec = validate_submission(dataclasses.replace(sub, working_dir=local_dir))
        except RequestRejected as exc:
            failure = FailureRecord(kind="INVALID", message=f"the queued spec does not validate: {exc}",
                                    at_unix_s=time.time())
            # No spec validated: the record keeps the name only (the queue writes state, figures and failure).
            failed = TaskRecord(record.task_id, spec=TaskSpec(name=record.name), state="FAILED", figures=record.figures,
                                checkpoint_path=record.checkpoint_path, failure=failure, seq=record.seq)
            self._pending[record.task_id] = QueueNote("ended", failed, "invalid spec")
            return None
        spec = dataclasses.replace(spec, working_dir=sub.working_dir)
        # Fenced by claim epoch (fencing.py): the record's checkpoint, or a newer file of the previous claim.
        task_root = self.config.checkpoint_dir / record.task_id
        ck_path, ck_step = fencing.resume_point(task_root, record.epoch, record.checkpoint_path,
                                                record.checkpoint_step)
        fencing.prune(task_root, record.epoch, ck_path)
        return ClaimedTask(TaskRecord(
            task_id=record.task_id, spec=spec, state=CLAIMED, figures=resumed_figures(record.figures, ck_step),
            checkpoint_path=ck_path, seq=record.seq, submitted_unix_s=record.submitted_unix,
        ), epoch=record.epoch)


def resumed_figures(figures: TaskProgress, checkpoint_step: int) -> TaskProgress:
    """A claimed task's figures as it resumes from ``checkpoint_step`` (-1: none, it starts over): its steps and,
    where it counts in steps, its progress go back to that point. A reclaimed task showed its last holder's 44
    steps, then 43 once its new holder had resumed from step 35 and stepped on (a stranger's trial). Progress in
    a unit of the task's own stays as its last holder reported it until its new worker reports (the record does
    not keep what it was at the checkpoint)."""
    if checkpoint_step < 0:
        return dataclasses.replace(figures, checkpoint_step=-1, steps=0, progress=0.0)
    if figures.steps <= checkpoint_step:
        return dataclasses.replace(figures, checkpoint_step=checkpoint_step)
    progress = float(checkpoint_step) if figures.progress_unit == "steps" else figures.progress
    return dataclasses.replace(figures, checkpoint_step=checkpoint_step, steps=checkpoint_step, progress=progress)
