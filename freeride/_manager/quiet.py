"""The quiet slots on the trainer's end board: which of the followed rank's slots no resident task could use now.

A trainer on the manager's host sends each event as it happens (:mod:`freeride._local_events`), and each one
wakes the manager's loop, on a core that may compute a rank (the 2-core test machine's always do): about
0.1-0.15 ms of the manager's CPU an event, read at once. Where a task's step fits some of a schedule's waits
and not others (a 2.5 ms step beside an interleaved trainer's 0.03-11 ms waits), most of those wake-ups decide
nothing. So the loop publishes, after each turn, :meth:`SchedulerCore.quiet_slots` on the end board
(:meth:`freeride._boards.EndBoard.set_quiet`), and the trainer's reporter holds a quiet slot's start and end
back, sending them, marked as late, with its next event of a slot that is not quiet, or once they have waited
``freeride.training.reporter.QUIET_HOLD_NS``. The manager still learns every bubble (statistics, a slot's
reach, the re-probe count): late, and not timed as a delay.

What it may cost: a bubble of a quiet slot that turns out longer than any of its slot's last 16 is not offered
(its slot is loud again once its length is read); a frozen, starting or probing task, one being stopped or
one whose re-probe is next makes every slot loud, as does a change of the followed rank or ranks that share
the device (the old rank's slots are cleared first, so a trainer never reads another rank's state).
"""

from __future__ import annotations

import logging
from pathlib import Path

from freeride._boards import EndBoard

log = logging.getLogger(__name__)


class QuietSlots:
    """The loop's writer of the quiet slots (one per manager with an end board)."""

    def __init__(self, board_path: Path | None) -> None:
        self._path = board_path
        self._board: EndBoard | None = None
        self._failed = board_path is None
        self._published: tuple[int, bytes] | None = None

    def publish(self, state: tuple[int, bytes] | None) -> None:
        """Write ``state`` (:meth:`SchedulerCore.quiet_slots`: the rank and its slots' flags; None: none quiet)
        where it differs from what the board holds."""
        if state == self._published or self._failed:
            return
        board = self._open()
        if board is None:
            return
        last = self._published
        if last is not None and (state is None or state[0] != last[0]):
            board.set_quiet(last[0], b"")  # the old rank's slots loud first
        if state is not None:
            board.set_quiet(state[0], state[1])
        self._published = state

    def _open(self) -> EndBoard | None:
        if self._board is None and self._path is not None:
            try:
                self._board = EndBoard.open(self._path, writable=True)
            except (OSError, ValueError) as exc:
                log.info("no quiet slots on %s (every event is sent as it happens): %s", self._path, exc)
                self._failed = True
                return None
            if not self._board.has_quiet:
                self._failed = True
                return None
        return self._board

    def close(self) -> None:
        """Every slot loud again (a trainer holding events back for this manager sends them as they come)."""
        if self._published is not None and self._board is not None:
            self._board.set_quiet(self._published[0], b"")
            self._published = None
        if self._board is not None:
            self._board.close()
            self._board = None
