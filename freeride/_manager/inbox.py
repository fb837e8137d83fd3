"""The loop's inbox: what other threads hand the loop, how it wakes it, and how a flood is held back.

Two queues and one eventfd. Requests, posted events and signals' shutdowns go to the first, in
order; trainer bubble events go to the second, in chunks, one chunk per trainer message (or per
:data:`BUBBLES_PER_TURN` events of a larger one). Each post writes the eventfd, which the loop's
one ``select`` waits on. A turn of the loop takes every waiting item of the first queue, then at
most ``BUBBLES_PER_TURN`` bubble events, so that under a flood worker messages, timers and control
calls still get a turn every few milliseconds.

Backpressure: at most ``max_pending`` bubble events wait. A stream that outpaces the loop waits in
:meth:`Inbox.post_bubbles` for room (the loop makes some each time it takes a chunk), so gRPC stops
reading it, its flow control holds the sender back, and the trainer's bounded reporter queue drops
and counts what does not fit; the training thread itself never waits. Holding back rather than
shedding keeps every event the manager accepted, ends included, in order, and keeps the delay
bounded (~50 ms of the loop's work) instead of letting stale starts pile up.

Once closed, :meth:`call_async` refuses at once with "the manager is stopping", requests still
queued fail the same way, and bubble events still waiting or waiting for room are counted as
dropped: a request is always answered, an event always counted.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from freeride.errors import ManagerUnavailable

#: Bubble events handed to the loop per turn at most (a few ms of work), and the size of the chunks
#: larger trainer messages are cut into.
BUBBLES_PER_TURN = 256

T = TypeVar("T")


class Inbox(Generic[T]):
    """Thread-safe ingress of one loop; ``T`` is what a bubble chunk holds (the loop's trainer input)."""

    def __init__(self, max_pending: int, convert: Callable[[Any, int, str], T]) -> None:
        #: Turns a trainer event, its receive time and its job into what the loop's chunk holds (on the poster's
        #: thread).
        self._convert = convert
        self.max_pending = max_pending
        self._items: collections.deque[Any] = collections.deque()
        self._chunks: collections.deque[list[T]] = collections.deque()
        self._pending = 0  # bubble events posted and not yet taken by the loop
        self._room = threading.Condition()  # guards _pending and the counters; notified when the loop takes some
        self._closed = threading.Event()
        # Guards the check "closed?" and the posting of a request, so that a request is either answered
        # by the loop, or failed by close(), or refused at once: never left unanswered.
        self._call_lock = threading.Lock()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.received = 0  # bubble events posted
        self.rejected = 0  # bubble events the servicers refused as malformed
        self.dropped = 0  # valid bubble events never handed to the loop: it stopped first

    # ------------------------------------------------------------ any thread

    def fileno(self) -> int:
        return self._wake_fd

    def post(self, item: Any) -> None:
        """Enqueue an item for the loop from any thread (or a signal handler); returns at once."""
        self._items.append(item)
        self._wake()

    def _wake(self) -> None:
        fd = self._wake_fd
        if fd < 0:
            return  # released: nothing will read the item
        try:
            os.eventfd_write(fd, 1)
        except OSError:  # the counter is saturated: the loop is awake anyway
            pass

    def call_async(self, request: Any) -> Future[Any]:
        """Enqueue a request; the loop completes the returned future (a caller may stop waiting)."""
        future: Future[Any] = Future()
        with self._call_lock:
            if self._closed.is_set():
                future.set_exception(ManagerUnavailable("the manager is stopping"))
                return future
            self.post((request, future))
        return future

    def reject(self, count: int = 1) -> None:
        """Count bubble events a servicer refused as malformed."""
        with self._room:
            self.rejected += count

    def count_received(self, count: int) -> None:
        """Count bubble events the loop read itself (a local trainer's datagrams), in ``received``."""
        with self._room:
            self.received += count

    def post_bubbles(self, events: Sequence[Any], received_ns: int, job: str = "") -> int:
        """Enqueue valid bubble events, in order, one wake-up per chunk, waiting for room (see the module
        docstring); ``job`` goes to the conversion. Returns how many were not enqueued: those still waiting when
        the loop stopped."""
        limit = self.max_pending
        size = min(limit, BUBBLES_PER_TURN)
        with self._room:
            self.received += len(events)
        for first in range(0, len(events), size):
            chunk = [self._convert(e, received_ns, job) for e in events[first:first + size]]
            with self._room:
                while self._pending + len(chunk) > limit and not self._closed.is_set():
                    self._room.wait(0.1)
                if self._closed.is_set():
                    lost = len(events) - first
                    self.dropped += lost
                    return lost
                self._pending += len(chunk)
            self._chunks.append(chunk)
            self._wake()
        return 0

    # ------------------------------------------------------------ the loop's thread

    def has_work(self) -> bool:
        return bool(self._items or self._chunks)

    def clear_wake(self) -> list[Any]:
        """Reset the eventfd after a wake-up (the loop's selector callback); no events of its own."""
        try:
            os.eventfd_read(self._wake_fd)
        except (BlockingIOError, OSError):
            pass
        return []

    def items(self) -> Iterator[Any]:
        """Every item waiting now, and those posted while they are handled."""
        while self._items:
            yield self._items.popleft()

    def has_chunks(self) -> bool:
        """Whether a bubble chunk waits (the loop thread's cheap look before it takes one)."""
        return bool(self._chunks)

    def take_chunk(self) -> list[T] | None:
        """The oldest waiting bubble chunk (None: none); taking it makes room for waiting streams."""
        if not self._chunks:
            return None
        chunk = self._chunks.popleft()
        with self._room:
            self._pending -= len(chunk)
            self._room.notify_all()
        return chunk

    def waiting_events(self) -> int:
        return sum(len(chunk) for chunk in list(self._chunks))

    def close(self) -> None:
        """Refuse new calls, fail queued ones, count waiting bubble events as dropped, free waiting streams."""
        with self._call_lock, self._room:
            self._closed.set()
        stopping = ManagerUnavailable("the manager is stopping")
        for item in self._items:
            if isinstance(item, tuple) and not item[1].done():
                item[1].set_exception(stopping)
        self._items.clear()
        with self._room:
            self.dropped += sum(len(chunk) for chunk in self._chunks)
            self._chunks.clear()
            self._pending = 0
            self._room.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def release(self) -> None:
        """Close the eventfd; only once nothing can post any more (gRPC threads and scrapes may post until
        the server has stopped, and a closed descriptor number could be reused by another file meanwhile)."""
        fd, self._wake_fd = self._wake_fd, -1
        if fd >= 0:
            os.close(fd)
