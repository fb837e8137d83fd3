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

On a ``cpu:N`` device the loop also arms the trainer's stop of the grant's worker (:meth:`EndPath.arm_stop`, the
end board's stop record: :mod:`freeride._boards`) before the grant goes out: the trainer itself stops a worker
still holding its bubble at the end (in a step, or between steps, not yet parked), the one process sure to run
then. The end's datagram (or wire message) comes after
that stop, and :meth:`EndPath.local_end` / :meth:`EndPath.stopped_end` read when it was, so that the core books a
freeze at that time (:attr:`~freeride._manager.core.TrainerEndSeen.stopped_ns`). The record is disarmed when
the grant is over (:meth:`EndPath.reported`, :meth:`EndPath.grant_over`, also as a Stop goes out) and before the
worker is reaped (:meth:`EndPath.forget_pid`): a pid the trainer reads there is the manager's unreaped child.

``end_to_worker`` times an end received (the servicer's stamp) -> the word set, recorded by servicer
threads and the loop thread alike, under a lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from freeride._boards import EndBoard, WorkerBoard
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


log = logging.getLogger("freeride.manager")


@dataclass(frozen=True)
class _ArmedStop:
    task_id: str
    grant_id: int
    bubble_key: tuple[int, int, int, int]
    start_ns: int
    pid: int

    @property
    def rank(self) -> int:
        return self.bubble_key[1]


class EndPath:
    def __init__(self, now_ns: Callable[[], int], end_board_path: Path | None = None,
                 stopped: Callable[[str, int], None] = lambda task_id, at_ns: None) -> None:
        self.now_ns = now_ns
        #: Told of each stop the trainer made (task id, when), as soon as it is read: the worker is stopped,
        #: whatever the core makes of it (:meth:`freeride._manager.supervisor.Supervisor.stopped_by_trainer`).
        self._stopped = stopped
        self._lock = threading.Lock()
        self._end_to_worker = LatencyHistogram()
        #: Published by the loop thread at each grant that follows real ends, read by servicer threads.
        self._hot: _HotGrant | None = None
        #: The end board, mapped at the first stop armed (the daemon makes it after the loop is built); None
        #: with no board, or one that cannot be mapped or has no stop records (then no stop is armed).
        self._board_path = end_board_path
        self._board: EndBoard | None = None
        #: The grant whose worker the trainer stops at its end (the loop's thread only): one at a time, as grants.
        self._armed: _ArmedStop | None = None
        #: Workers the trainer stopped at its end.
        self.trainer_stops = 0

    # ------------------------------------------------------------ the loop's thread

    def granted(self, task_id: str, grant_id: int, bubble_key: tuple[int, int, int, int], start_ns: int,
                board: WorkerBoard | None) -> None:
        """A grant that follows the trainer's real ends went out: its bubble's end may end it."""
        if board is not None:
            self._hot = _HotGrant(task_id, grant_id, bubble_key, start_ns, board)

    def arm_stop(self, task_id: str, grant_id: int, bubble_key: tuple[int, int, int, int], start_ns: int,
                 pid: int, group: int = 0) -> None:
        """A grant of ``bubble_key`` (started at ``start_ns``) to the worker ``pid`` goes out: the trainer stops that
        worker at its end unless it parked first (a step still running, or one about to begin or to be reported),
        and with it a command task's command, in the process group ``group`` (0: none)."""
        board = self._stop_board()
        if board is None or not pid:
            return
        if self._armed is not None:  # the last grant's, where nothing took it back (a claim in it is read)
            self._disarm(self._armed)
        board.arm_stop(bubble_key[1], start_ns, pid, group=group)
        self._armed = _ArmedStop(task_id, grant_id, bubble_key, start_ns, pid)

    def _stop_board(self) -> EndBoard | None:
        if self._board is None and self._board_path is not None:
            path, self._board_path = self._board_path, None  # one try
            try:
                board = EndBoard.open(path, writable=True)
            except (OSError, ValueError) as exc:
                log.debug("no end board at %s to arm the trainer's stops: %s", path, exc)
                return None
            if board.stops:
                self._board = board
            else:
                board.close()
        return self._board

    def _disarm(self, armed: _ArmedStop) -> int:
        """Take the record back; when the trainer stopped the worker (even as this runs: it claims the stop
        before it stops, and looks again after the claim), when it did, else 0."""
        self._armed = None
        board = self._board
        if board is None:
            return 0
        try:
            at_ns = board.disarm_stop(armed.rank, armed.pid)
        except ValueError:  # closed at shutdown
            return 0
        if not at_ns:
            return 0
        self.trainer_stops += 1
        self._stopped(armed.task_id, at_ns)
        return at_ns

    def _trainer_stop(self, event: BubbleEnd) -> tuple[_ArmedStop, int] | None:
        """Whether the trainer stopped the armed grant's worker at ``event`` (its bubble's end): that grant and
        when; the record is spent then."""
        armed = self._armed
        if armed is None or event.key != armed.bubble_key:
            return None
        at_ns = self._disarm(armed)
        return (armed, at_ns) if at_ns else None

    def stopped_end(self, event: BubbleEnd) -> list[C.TrainerEndSeen]:
        """An end said as seen only where the trainer stopped the armed grant's worker at it, so that the core books
        that freeze: an end from the wire (a trainer whose local messages failed still wrote the board), or a local
        one whose grant was reported already (the trainer may have stopped the worker as it parked)."""
        stop = self._trainer_stop(event)
        if stop is None:
            return []
        armed, at_ns = stop
        return [self._seen_stopped(armed, event.end_ns, at_ns)]

    def stopped_before_freeze(self) -> list[C.TrainerEndSeen]:
        """Before the core freezes a step on its own timer: whether the trainer stopped the armed grant's worker at
        its end already, the end's message not read yet (a manager that waited for a core: on the 2-core VM,
        ends read 2-17 ms late at p99 and worst, their freezes booked then, as overruns of that length, and each
        widened the task's margin). Said seen as :meth:`stopped_end` says it, with the end the trainer wrote on
        its board (or the stop's time, where that record was overwritten by a later bubble's end already)."""
        armed = self._armed
        board = self._board
        if armed is None or board is None:
            return []
        try:
            if not board.stop_claim(armed.rank, armed.pid):
                return []
            end_ns = board.ended_ns(armed.rank, armed.start_ns)
        except ValueError:  # closed at shutdown
            return []
        at_ns = self._disarm(armed)
        return [self._seen_stopped(armed, end_ns if end_ns > 1 else at_ns, at_ns)] if at_ns else []

    def _seen_stopped(self, armed: _ArmedStop, end_ns: int, at_ns: int) -> C.TrainerEndSeen:
        """The armed grant's end, seen with the trainer's stop at ``at_ns`` (and when the step it stopped began)."""
        hot = self._hot
        began = self._began(hot.board) if hot is not None and hot.grant_id == armed.grant_id else 0
        return C.TrainerEndSeen(armed.task_id, armed.grant_id, end_ns, began, stopped_ns=at_ns)

    @staticmethod
    def _began(board: WorkerBoard) -> int:
        """When the worker's step now running began, from its board (0: none, or the board is closed)."""
        try:
            return board.step_began_ns()
        except ValueError:  # closed meanwhile: the step's start is unknown
            return 0

    def local_end(self, event: BubbleEnd, received_ns: int) -> list[C.TrainerEndSeen]:
        """A local trainer's end, read by the loop from its datagram (:mod:`freeride._local_events`): for the
        published grant's bubble, set the worker's word (for a worker that could not map the trainer's
        board) and say the end was seen, so that the core freezes a step still running at the trainer's
        own end + grace (at once, when the trainer stopped it: ``stopped_ns``)."""
        hot = self._hot
        if hot is None or event.key != hot.bubble_key or event.end_ns < hot.start_ns:
            return self.stopped_end(event)
        stop = self._trainer_stop(event)
        try:
            if hot.board.end_grant(hot.grant_id, event.end_ns):
                self._record(self.now_ns() - received_ns)
        except ValueError:  # the worker was reaped and its board closed meanwhile
            pass
        began = self._began(hot.board)
        seen = [C.TrainerEndSeen(hot.task_id, hot.grant_id, event.end_ns, began)]
        if stop is not None:
            armed, at_ns = stop
            if armed.grant_id == hot.grant_id:
                seen = [C.TrainerEndSeen(hot.task_id, hot.grant_id, event.end_ns, began, stopped_ns=at_ns)]
            else:
                seen.append(C.TrainerEndSeen(armed.task_id, armed.grant_id, event.end_ns, stopped_ns=at_ns))
        return seen

    def reported(self, grant_id: int) -> None:
        """The worker reported the grant's steps: its bubble is no longer held, an end for it times nothing."""
        hot = self._hot
        if hot is not None and hot.grant_id == grant_id:
            self._hot = None
        armed = self._armed
        if armed is not None and armed.grant_id == grant_id:
            self._disarm(armed)

    def grant_over(self, task_id: str) -> None:
        """``task_id``'s worker was frozen, or is told to stop: no stop is left for the trainer to make in its grant
        (a stop it made already is read, and the worker held for its next message)."""
        armed = self._armed
        if armed is not None and armed.task_id == task_id:
            self._disarm(armed)

    def command_group(self, pid: int, group: int) -> None:
        """The worker ``pid`` started its command task's command in the process group ``group``: a stop armed for
        that worker (the grant that runs its setup, which starts the command) stops the command too."""
        armed, board = self._armed, self._board
        if armed is not None and armed.pid == pid and board is not None:
            try:
                board.set_group(armed.rank, group)
            except ValueError:  # closed at shutdown
                pass

    def forget_pid(self, pid: int) -> None:
        """The worker ``pid`` is about to be reaped: no trainer may signal that pid from now on."""
        armed = self._armed
        if armed is not None and armed.pid == pid:
            self._disarm(armed)

    def close(self) -> None:
        if self._armed is not None:
            self._disarm(self._armed)
        if self._board is not None:
            self._board.close()
            self._board = None

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
