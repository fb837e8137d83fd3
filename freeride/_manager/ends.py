"""The end fast path: a bubble's end reaches the worker that holds the bubble before it reaches the core.

The loop publishes the grant a trainer's end may end (:meth:`EndPath.granted`, under a policy that
parks at real ends), and the trainer stream's servicer thread sets that worker's ended-grant word
(:class:`freeride._boards.WorkerBoard`) the moment it decodes the end (:meth:`EndPath.trainer_events`),
before the end even waits in the inbox: the loop's turn (a thread hand-off, the GIL, a busy loop)
would otherwise stand between the manager receiving an end and the worker learning of it. When the
core parks the worker, the loop sets the word again (:meth:`EndPath.parked`; a no-op then) before it
sends the park message. The path decides nothing the core would not: an end with the published
grant's bubble key, at or after its start, is what makes the core park it. A stale publication is
harmless: grant ids only grow, and saying that an ended bubble ended changes nothing.

A trainer on the manager's host sends its events as datagrams that the loop reads itself
(:mod:`freeride._local_events`); the loop hands each end here first (:meth:`EndPath.local_end`): an end
of the published grant's bubble sets the worker's word (for a worker that could not map the trainer's
board) and becomes a :class:`~freeride._manager.core.TrainerEndSeen`, with which the core freezes a step
still running at the trainer's end + grace, not grace after the end reached the loop (at the end itself, a step
that the worker's board says began too late to end within the grace).

``end_to_worker`` times an end received (the servicer's stamp) -> the word set, recorded by servicer
threads and the loop thread alike, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from freeride._boards import WorkerBoard
from freeride._manager import core as C
from freeride._manager.histogram import LatencyHistogram
from freeride.messages import BubbleEnd, Percentiles, TrainerEvent


@dataclass(frozen=True)
class _HotGrant:
    task_id: str
    grant_id: int
    bubble_key: tuple[int, int, int, int]
    start_ns: int
    board: WorkerBoard


class EndPath:
    def __init__(self, now_ns: Callable[[], int]) -> None:
        self.now_ns = now_ns
        self._lock = threading.Lock()
        self._end_to_worker = LatencyHistogram()
        #: Published by the loop thread at each grant that follows real ends, read by servicer threads.
        self._hot: _HotGrant | None = None

    # ------------------------------------------------------------ the loop's thread

    def granted(self, task_id: str, grant_id: int, bubble_key: tuple[int, int, int, int], start_ns: int,
                board: WorkerBoard | None) -> None:
        """A grant that follows the trainer's real ends went out: its bubble's end may end it."""
        if board is not None:
            self._hot = _HotGrant(task_id, grant_id, bubble_key, start_ns, board)

    def local_end(self, event: BubbleEnd, received_ns: int) -> list[C.TrainerEndSeen]:
        """A local trainer's end, read by the loop from its datagram (:mod:`freeride._local_events`): for the
        published grant's bubble, set the worker's word (for a worker that could not map the trainer's
        board) and say the end was seen, so that the core freezes a step still running at the trainer's
        own end + grace."""
        hot = self._hot
        if hot is None or event.key != hot.bubble_key or event.end_ns < hot.start_ns:
            return []
        try:
            if hot.board.end_grant(hot.grant_id, event.end_ns):
                self._record(self.now_ns() - received_ns)
        except ValueError:  # the worker was reaped and its board closed meanwhile
            pass
        try:
            began = hot.board.step_began_ns()
        except ValueError:  # closed meanwhile: the step's start is unknown
            began = 0
        return [C.TrainerEndSeen(hot.task_id, hot.grant_id, event.end_ns, began)]

    def reported(self, grant_id: int) -> None:
        """The worker reported the grant's steps: its bubble is no longer held, an end for it times nothing."""
        hot = self._hot
        if hot is not None and hot.grant_id == grant_id:
            self._hot = None

    def parked(self, board: WorkerBoard | None, grant_id: int, end_ns: int, end_received_ns: int) -> None:
        """The core parks the worker: set its word first (it reads it before every step, whether or not it
        has read its channel, or the channel was full); the park message only wakes a worker that waits."""
        if board is not None and board.end_grant(grant_id, end_ns) and end_received_ns:
            self._record(self.now_ns() - end_received_ns)

    # ------------------------------------------------------------ a trainer stream's thread

    def trainer_events(self, events: Sequence[TrainerEvent], received_ns: int) -> None:
        """Set the ended-grant word of the worker that holds a bubble as soon as its end arrives."""
        hot = self._hot
        if hot is None:
            return
        for event in events:
            if isinstance(event, BubbleEnd) and event.key == hot.bubble_key and event.end_ns >= hot.start_ns:
                try:
                    if hot.board.end_grant(hot.grant_id, event.end_ns):
                        self._record(self.now_ns() - received_ns)
                except ValueError:  # the worker was reaped and its board closed meanwhile
                    pass
                return

    # ------------------------------------------------------------ any thread

    def _record(self, latency_ns: int) -> None:
        with self._lock:
            self._end_to_worker.record(latency_ns)

    def end_to_worker_ms(self) -> Percentiles:
        with self._lock:
            return self._end_to_worker.percentiles()
