"""Shared-memory words between the processes of one host: what must arrive before a message could.

Two boards, each a small file mapped into every process that uses it, read and written with one
memory access, no system call:

* :class:`WorkerBoard`, one per worker (``<task dir>/board``), made by the manager before it spawns the
  worker. Word 0, the **step**: the worker publishes the index of each step before running it, so a
  worker killed by a signal (or by the manager, over its memory cap or past its step timeout) still
  says which step it was in. Word 1, the **ended grant**: the manager writes the id of a grant whose
  bubble has ended at the moment it decides to park the worker, before the park message; the worker
  reads it before each step and starts none for a grant at or below it. Grant ids only grow, so a
  grant for a newer bubble is never taken for an ended one, and a late write for an old grant is
  harmless. Word 2: that bubble's real end (the trainer's ``CLOCK_MONOTONIC`` ns; 0 when unknown),
  which the worker reports, so that the manager knows the bubble is over even if the worker's report
  overtakes the end on its way to the scheduler. Word 3, **steps done**: how many steps this worker
  process has finished, published after each; the manager reads it when it freezes the worker, to tell
  a step that hangs after others from a setup or first step that is long by nature. Word 4, **doing**:
  whether the worker is writing a checkpoint (``state_dict()``), set as it begins one and cleared once it is
  written (the step loop stores nothing there), so that a hang in a task's ``state_dict()`` is named as one.
  Words 5 and 6, **stopped at** and **stood still**: the manager writes the time it stops the worker
  (SIGSTOP) just before it does, and when it continues it (SIGCONT), just before that, adds the time since to
  the total of word 6 and clears word 5. The worker reads the total at a step's start and end, and so knows
  how long the step stood still, however many stops it met (two SIGCONTs pending at once are one signal).
  Word 7, **step began**: when the step now running began (``CLOCK_MONOTONIC`` ns; 0 between steps), written
  by the worker with word 0 and cleared with word 3, so that the manager, told of a bubble's end, can tell a
  step that will end within the grace from one that will not and is frozen at the end instead.
* :class:`EndBoard`, one per manager on a unix socket (``<socket>.ends``, in the socket's owner-only
  directory), written by the trainer: when a rank's bubble ends, its reporter writes the bubble's
  start time (its identity) and its end time into the record of that rank, from the training thread,
  before the end is even queued for the wire. A worker granted that bubble reads the record before
  each step and stops at once: the end reaches it in about a microsecond instead of the ~0.3 ms (p99
  ~0.6 ms, more under load) that the reporter, gRPC and the manager's loop take. A record naming a later
  bubble of the rank says so too (:meth:`EndBoard.ended_by_ns`): a grant that reached its worker late has
  its bubble's end even once the trainer's record has moved on. The manager still
  learns every end (statistics, parks), as a datagram from a trainer on its host
  (:mod:`freeride._local_events`) or over the wire; the board only lets a worker stop before the manager
  knows. The reference policy's emulation never reads it (it ignores real ends).
  A trainer that is another user, or on another host, reaches the manager over TCP and has no board:
  its ends travel over the wire only.

  After the end records, one **stop record** per rank (:meth:`EndBoard.arm_stop`): the trainer stops, at its
  own end, a side-task worker still holding that bubble, on a device whose worker shares the trainer's core
  (``cpu:N``). There the trainer's compute takes the core back at the end and a worker at nice 19 hardly runs:
  a step in flight cannot end within the grace, and waiting for the manager to freeze it held it unfrozen past
  the end for as long as the manager waited for a core (p99 1.3-5.6 ms on the 2-core VM; the trainer is the one
  process certain to run at that moment). So is a worker between two steps, or about to report its park:
  starved as well, it held the bubble until frozen. Four words: the **bubble** it is armed for (its start
  time, the identity: written last by the manager at a grant, and 0 when the grant is over); the worker's
  **pid** (the manager's child, cleared before it is reaped, so the pid cannot name another process while it is
  here; a manager killed with -9 leaves it, and its worker dies with it, but only that bubble's end reads it:
  the system would have to hand the pid out again, to a new process group, within that bubble); **holding**
  (set by the manager at the grant and by the worker at each step it begins in that bubble, cleared by the
  worker as it reports its park: right before, where the bubble's end is known, and right after, where its
  deadline parked it with the end still to come, so that a worker starved between its decision and its report
  is stopped at the end too; a worker that parked is left be); and **stopped at** (the trainer's
  claim, written just before it stops the worker's process group with SIGSTOP, :meth:`EndBoard.stop_at_end`).
  The manager reads that last word as it takes the record back with the end (:meth:`EndBoard.disarm_stop`) and
  books a freeze at that time (its own SIGSTOP is then a no-op), or, for a worker it had already seen park,
  continues it before its next message. A stop that lands as a step ends leaves a worker stopped between steps,
  which a freeze already could. The board ends with the manager's pid namespace: a trainer in another one (a
  container of its own sharing the socket's volume) stops nothing, as the pids written there would name other
  processes of its own.

  Then the **quiet slots**: per rank (by ``rank % END_BOARD_RANKS``) one byte per slot index below
  :data:`QUIET_SLOTS`, written by the manager (non-zero: no resident side task could use a bubble of that slot
  now, :mod:`freeride._manager.quiet`) and read by the trainer at each bubble's start, which then holds that
  bubble's events back (:mod:`freeride.training.reporter`). A byte is its own word: a slot reads old or new.

  Then, per rank one word: the **command group** of the grant armed in that rank's stop record, written before
  the record's identity (0: none). A command task's command runs in a process group of its own
  (:mod:`freeride.command`); the trainer stops it with the worker, else a slice in flight ran on until the
  manager froze it. A board without it (an older manager's) stops the worker alone.

  Last, per rank one word: the **trainer's thread**, the id of the thread that computes and waits, written by a
  ``cpu:N`` trainer at its first bubble (:meth:`EndBoard.set_trainer_thread`). A worker granted that rank's
  bubble reads that thread's state before each step (:class:`ThreadState`): while it is runnable, the rank waits
  for the core the worker holds (its data came, though the trainer, without its core, has not said so yet; or its
  host work of the gap is not done), and the worker starts no step. A board without it (an older manager's, or
  another pid namespace's) says none.

Words are 8-byte aligned little-endian integers. An aligned 8-byte store or load is a single access on
the hosts freeride runs on (x86-64, arm64), so a reader sees an old or a new value, never a torn one.
Each record's identity word is written last and read first; a stale companion word (an end time)
could only skew a measurement, never a decision.

Files are written whole when made (``pwrite`` of zeros, not ``ftruncate``): a sparse page would be
allocated on the first store, and a full disk then answers with SIGBUS instead of an error here. For the
same reason a board is never reset in place: a restarted manager renames a fresh one over it (``_make``),
and a trainer still mapping the old one writes there, harmlessly, until it reconnects.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import tempfile
import time
from pathlib import Path

_WORD = struct.Struct("<q")
_RECORD = struct.Struct("<qq")

_STOP = struct.Struct("<qqqq")  # bubble start (identity), pid, holding, stopped at

#: Records in an end board: one per rank, by ``rank % END_BOARD_RANKS`` (a device hosts a few ranks at most).
END_BOARD_RANKS = 64
#: The end records alone: a board this short (an older manager's) has no stop records.
END_RECORDS_BYTES = END_BOARD_RANKS * _RECORD.size
#: After the stop records, the manager's pid namespace (device and inode of ``/proc/self/ns/pid``).
_NAMESPACE_OFFSET = END_RECORDS_BYTES + END_BOARD_RANKS * _STOP.size
_NAMESPACE = struct.Struct("<qq")
#: The end and stop records and the namespace: a board this short (an older manager's) has no quiet slots.
STOP_RECORDS_END = _NAMESPACE_OFFSET + _NAMESPACE.size
#: The quiet slots: per rank (by ``rank % END_BOARD_RANKS``) one byte per slot index, for indices below this.
QUIET_SLOTS = 1024
#: The quiet slots' end: a board this short (an older manager's) has no command groups.
QUIET_SLOTS_END = STOP_RECORDS_END + END_BOARD_RANKS * QUIET_SLOTS
#: Then, per rank one word: the process group of the command task armed in that rank's stop record (0: none).
GROUPS_END = QUIET_SLOTS_END + END_BOARD_RANKS * _WORD.size
#: Last, per rank one word: the id of the trainer's thread that waits (0: not said), written by a ``cpu:N`` trainer.
END_BOARD_BYTES = GROUPS_END + END_BOARD_RANKS * _WORD.size

WORKER_BOARD_BYTES = 64

_STEP, _ENDED_GRANT, _ENDED_AT, _DONE, _DOING, _STOPPED_AT, _STOOD_STILL, _STEP_BEGAN = 0, 8, 16, 24, 32, 40, 48, 56
#: What the worker is doing (word 4): setting up (or nothing yet), a step, a checkpoint's ``state_dict()``.
DOING_SETUP, DOING_STEP, DOING_CHECKPOINT = 0, 1, 2


def _make(path: Path, size: int, initial: bytes = b"") -> None:
    """Create (or replace) ``path`` with ``size`` bytes written: ``initial`` then zeros; owner-only.

    Made aside and renamed into place, never truncated where it lies: a process may still map the old
    file (a trainer's reporter keeps the board of a manager that was killed until it reconnects; an
    orphaned worker keeps its board), and a store to a mapped page that a truncate took away is a
    SIGBUS, which no ``except`` catches. The old file lives on, unlinked, for whoever maps it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
    try:
        try:
            os.pwrite(fd, initial.ljust(size, b"\0"), 0)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _map(path: Path, size: int, writable: bool, least: int | None = None) -> mmap.mmap:
    """Map ``size`` bytes of ``path`` (or all of it when it is shorter but holds ``least``)."""
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        have = os.fstat(fd).st_size
        if have < (size if least is None else least):
            raise OSError(f"{path} is shorter than a board ({size} bytes)")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, min(size, have), mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


class WorkerBoard:
    """A worker's step and ended-grant words (see the module docstring)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mm = mapping

    @classmethod
    def create(cls, path: Path) -> WorkerBoard:
        """The manager's side: a fresh board (step -1, no grant ended), mapped."""
        _make(path, WORKER_BOARD_BYTES, _WORD.pack(-1))
        return cls(_map(path, WORKER_BOARD_BYTES, writable=True))

    @classmethod
    def attach(cls, path: Path) -> WorkerBoard:
        """The worker's side: the board its manager made."""
        return cls(_map(path, WORKER_BOARD_BYTES, writable=True))

    def publish_step(self, step: int, began_ns: int = 0) -> None:
        """The step the worker begins (its index), and when (``CLOCK_MONOTONIC`` ns; 0: not said)."""
        _WORD.pack_into(self._mm, _STEP_BEGAN, began_ns)
        _WORD.pack_into(self._mm, _STEP, step)

    def step(self) -> int:
        return int(_WORD.unpack_from(self._mm, _STEP)[0])

    def publish_done(self, steps: int) -> None:
        """Steps this worker process has finished (the worker, after each); no step runs now."""
        _WORD.pack_into(self._mm, _STEP_BEGAN, 0)
        _WORD.pack_into(self._mm, _DONE, steps)

    def step_began_ns(self) -> int:
        """When the step now running began (0: none runs, or the worker did not say)."""
        return int(_WORD.unpack_from(self._mm, _STEP_BEGAN)[0])

    def steps_done(self) -> int:
        return int(_WORD.unpack_from(self._mm, _DONE)[0])

    def publish_doing(self, doing: int) -> None:
        """:data:`DOING_CHECKPOINT` as the worker begins a checkpoint, :data:`DOING_STEP` once it is written
        (checkpoints come after a step; the step loop stores nothing here)."""
        _WORD.pack_into(self._mm, _DOING, doing)

    def doing(self) -> int:
        return int(_WORD.unpack_from(self._mm, _DOING)[0])

    def note_stop(self, at_ns: int, continued: bool) -> None:
        """The manager (its loop's thread, the one writer), right before it stops (``continued`` False) or
        continues the worker, at ``at_ns`` (``CLOCK_MONOTONIC``): a continue adds the time since the stop to the
        total the worker stood still."""
        if not continued:
            _WORD.pack_into(self._mm, _STOPPED_AT, at_ns)
            return
        stopped = int(_WORD.unpack_from(self._mm, _STOPPED_AT)[0])
        if 0 < stopped <= at_ns:
            total = int(_WORD.unpack_from(self._mm, _STOOD_STILL)[0])
            _WORD.pack_into(self._mm, _STOOD_STILL, total + at_ns - stopped)
        _WORD.pack_into(self._mm, _STOPPED_AT, 0)

    def stopped_at_ns(self) -> int:
        """When the worker was stopped, while it is (0: it is not, as far as its stops were dated)."""
        return int(_WORD.unpack_from(self._mm, _STOPPED_AT)[0])

    def stood_still_ns(self) -> int:
        """How long, in all, the manager has kept the worker stopped, up to its last continue."""
        return int(_WORD.unpack_from(self._mm, _STOOD_STILL)[0])

    def end_grant(self, grant_id: int, end_ns: int) -> bool:
        """Say that ``grant_id``'s bubble ended at ``end_ns`` (the end first: the grant id is what the
        worker acts on). False when that grant (or a newer one) was said to have ended already.

        Two threads of a manager may call it for one grant (a servicer thread as the end arrives, the
        loop as it parks the worker): both write the same values, so the order does not matter.
        """
        if grant_id <= self.ended_grant():
            return False
        _WORD.pack_into(self._mm, _ENDED_AT, end_ns)
        _WORD.pack_into(self._mm, _ENDED_GRANT, grant_id)
        return True

    def ended_grant(self) -> int:
        return int(_WORD.unpack_from(self._mm, _ENDED_GRANT)[0])

    def ended_at_ns(self) -> int:
        """The real end of the last ended grant's bubble (0: unknown)."""
        return int(_WORD.unpack_from(self._mm, _ENDED_AT)[0])

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):  # still exported, or closed already
            pass


def read_step(path: Path) -> int:
    """The step a worker last began, from its board file (also after the worker is gone); -1 if none."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(_WORD.size)
    except OSError:
        return -1
    return int(_WORD.unpack(data)[0]) if len(data) == _WORD.size else -1


def end_board_path(socket_path: str) -> Path:
    """Where the manager listening on the unix socket ``socket_path`` keeps its end board."""
    return Path(socket_path + ".ends")


def pid_namespace() -> tuple[int, int]:
    """This process's pid namespace, as (device, inode) of ``/proc/self/ns/pid``; (0, 0) where it cannot be read."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return 0, 0
    return st.st_dev, st.st_ino


class EndBoard:
    """The trainer-written record of each rank's last ended bubble (see the module docstring)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mm = mapping
        #: Whether this process may use the stop records: the board has them (not an older manager's), and the
        #: manager that made it sees pids as this process does. A trainer in a container of its own (a pod's
        #: sidecar manager sharing only the socket's volume) has other pids: a pid the manager writes would name
        #: another process there, so it stops nothing.
        here = pid_namespace()
        self.stops = (len(mapping) >= STOP_RECORDS_END and here != (0, 0)
                      and _NAMESPACE.unpack_from(mapping, _NAMESPACE_OFFSET) == here)
        #: Whether the board has the quiet slots (not an older manager's).
        self.has_quiet = len(mapping) >= QUIET_SLOTS_END
        self.has_groups = len(mapping) >= GROUPS_END
        #: Whether the board has the trainers' threads (not an older manager's), in this pid namespace.
        self.has_threads = self.stops and len(mapping) >= END_BOARD_BYTES

    @staticmethod
    def create(path: Path) -> None:
        """The manager's side: make (or reset) the board before anyone maps it, saying its pid namespace."""
        _make(path, END_BOARD_BYTES, bytes(_NAMESPACE_OFFSET) + _NAMESPACE.pack(*pid_namespace()))

    @classmethod
    def open(cls, path: Path, writable: bool) -> EndBoard:
        """The trainer, the manager and workers map it writable (a worker that cannot, read-only: it then sets
        no holding word). Raises OSError when there is none."""
        return cls(_map(path, END_BOARD_BYTES, writable, least=END_RECORDS_BYTES))

    def record_end(self, rank: int, start_ns: int, end_ns: int) -> None:
        """The bubble of ``rank`` that started at ``start_ns`` ended at ``end_ns``."""
        offset = (rank % END_BOARD_RANKS) * _RECORD.size
        _WORD.pack_into(self._mm, offset + 8, end_ns)
        _WORD.pack_into(self._mm, offset, start_ns)  # the identity last

    def ended_ns(self, rank: int, start_ns: int) -> int:
        """When the bubble of ``rank`` that started at ``start_ns`` ended, or 0 if it has not (yet)."""
        offset = (rank % END_BOARD_RANKS) * _RECORD.size
        if int(_WORD.unpack_from(self._mm, offset)[0]) != start_ns:
            return 0
        return int(_WORD.unpack_from(self._mm, offset + 8)[0]) or 1

    def ended_by_ns(self, rank: int, start_ns: int) -> int:
        """The worker's read: when the bubble of ``rank`` that started at ``start_ns`` ended, or, where the record
        names a later bubble of that rank (whose end the trainer wrote since: a rank's bubbles come one after the
        other), that later bubble's start, before which this one ended; 0 while neither is there.

        A grant can reach its worker after its bubble's end (the manager granted before the end reached it, and
        the worker, at nice 19 on the rank's core, ran only later): on the 2-core VM 5-9% of a second rank's
        grants. A worker that ran once the record had moved on to the next bubble read no end, and stepped to
        the grant's deadline, outside any bubble, until frozen (held 1.6-3.0 ms past the end). Two ranks that share
        a record (``END_BOARD_RANKS`` apart on one device) may park each other's grants early: lost time, never
        an overrun."""
        offset = (rank % END_BOARD_RANKS) * _RECORD.size
        identity = int(_WORD.unpack_from(self._mm, offset)[0])
        if identity == start_ns:
            return int(_WORD.unpack_from(self._mm, offset + 8)[0]) or 1
        return identity if identity > start_ns else 0

    # ---------------------------------------------------------------- stop records

    @staticmethod
    def _stop_offset(rank: int) -> int:
        return END_RECORDS_BYTES + (rank % END_BOARD_RANKS) * _STOP.size

    def arm_stop(self, rank: int, start_ns: int, pid: int, holding: bool = True, group: int = 0) -> None:
        """The manager, at a grant of ``rank``'s bubble that started at ``start_ns`` to the worker ``pid``: the
        trainer stops that worker at the end unless it parked first (``holding`` False: only once it begins a
        step; a test's), and with it the process group ``group`` of a command task's command (0: none; the
        command runs in a group of its own, :mod:`freeride.command`)."""
        offset = self._stop_offset(rank)
        _WORD.pack_into(self._mm, offset, 0)  # the identity first: no trainer acts on a half-written record
        _STOP.pack_into(self._mm, offset, 0, pid, int(holding), 0)
        if self.has_groups:
            _WORD.pack_into(self._mm, self._group_offset(rank), group)
        _WORD.pack_into(self._mm, offset, start_ns)

    def set_group(self, rank: int, group: int) -> None:
        """The manager: the command group of the worker armed in ``rank``'s stop record, learnt after the grant
        went out (the grant that runs a command task's setup starts its command). A trainer reads it at the end."""
        if self.has_groups:
            _WORD.pack_into(self._mm, self._group_offset(rank), group)

    @staticmethod
    def _group_offset(rank: int) -> int:
        return QUIET_SLOTS_END + (rank % END_BOARD_RANKS) * _WORD.size

    def disarm_stop(self, rank: int, pid: int) -> int:
        """The manager: the grant armed for the worker ``pid`` in ``rank``'s record is over (the bubble ended, the
        worker parked, froze or is about to be reaped). When the trainer stopped it (its claim, read after the
        record is cleared: a trainer stopping it meanwhile claimed the stop before it looked at the record a
        second time), when it did; else 0. A record armed for another worker since is left alone (0)."""
        offset = self._stop_offset(rank)
        if int(_WORD.unpack_from(self._mm, offset + 8)[0]) != pid:
            return 0
        _WORD.pack_into(self._mm, offset, 0)
        return int(_WORD.unpack_from(self._mm, offset + 24)[0])

    def stop_claim(self, rank: int, pid: int) -> int:
        """The manager: when the trainer stopped the worker ``pid`` armed in ``rank``'s record (0: it has not, or the
        record is not armed for it), leaving the record as it is."""
        offset = self._stop_offset(rank)
        if not int(_WORD.unpack_from(self._mm, offset)[0]) or int(_WORD.unpack_from(self._mm, offset + 8)[0]) != pid:
            return 0
        return int(_WORD.unpack_from(self._mm, offset + 24)[0])

    def set_holding(self, rank: int, holding: bool) -> None:
        """The worker, as it begins a step in a bubble of ``rank`` (True), and before it reports its park there
        where the bubble's end is known (False): whether it holds that bubble (:meth:`let_go` after a park)."""
        _WORD.pack_into(self._mm, self._stop_offset(rank) + 16, int(holding))

    def let_go(self, rank: int, start_ns: int) -> None:
        """The worker, once it reported its park in ``rank``'s bubble that started at ``start_ns``: it holds that
        bubble no more. Cleared only while the record still names that bubble: a worker slow to get here (starved on a
        shared core) leaves a later grant's record, armed meanwhile, as the manager wrote it."""
        offset = self._stop_offset(rank)
        if int(_WORD.unpack_from(self._mm, offset)[0]) == start_ns:
            _WORD.pack_into(self._mm, offset + 16, 0)

    def stop_at_end(self, rank: int, start_ns: int) -> int:
        """The trainer, at the end of ``rank``'s bubble that started at ``start_ns``: stop the step that runs in it,
        where the manager armed this record for it; the pid stopped (0: none). The stop is claimed (its time
        written) before it is made, and made only if the record is still armed then, so that a manager taking
        the record back meanwhile reads the claim (a claim without a stop costs a worker that was not stopped a
        SIGCONT). A worker gone, or not this user's, is not stopped (the manager freezes what runs on)."""
        offset = self._stop_offset(rank)
        if int(_WORD.unpack_from(self._mm, offset)[0]) != start_ns:
            return 0
        _, pid, holding, _ = _STOP.unpack_from(self._mm, offset)
        if not pid or not holding:
            return 0
        group = int(_WORD.unpack_from(self._mm, self._group_offset(rank))[0]) if self.has_groups else 0
        _WORD.pack_into(self._mm, offset + 24, time.monotonic_ns())
        if int(_WORD.unpack_from(self._mm, offset)[0]) != start_ns:
            return 0
        try:
            os.killpg(pid, signal.SIGSTOP)
        except OSError:
            return 0
        if group > 1:  # a command task's command, in its slice (a slice's own stop, or the manager's, is then a no-op)
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGSTOP)
        return int(pid)

    # ---------------------------------------------------------------- trainers' threads

    def set_trainer_thread(self, rank: int, tid: int) -> None:
        """The trainer of a ``cpu:N`` device: ``tid`` is the thread of ``rank`` that computes and waits (the one that
        reports its bubbles), pinned to the device's core."""
        if self.has_threads:
            _WORD.pack_into(self._mm, GROUPS_END + (rank % END_BOARD_RANKS) * _WORD.size, tid)

    def trainer_thread(self, rank: int) -> int:
        """A worker: the thread of ``rank`` that computes and waits, as its trainer said it (0: not said)."""
        if not self.has_threads:
            return 0
        return int(_WORD.unpack_from(self._mm, GROUPS_END + (rank % END_BOARD_RANKS) * _WORD.size)[0])

    # ---------------------------------------------------------------- quiet slots

    def quiet(self, rank: int, slot: int) -> bool:
        """The trainer, at a bubble's start: whether the manager said that no side task could use a bubble of this
        slot of ``rank`` now (its events may wait, :mod:`freeride.training.reporter`). False where the board has no
        quiet slots or the slot's index is past them."""
        if not 0 <= slot < QUIET_SLOTS or not self.has_quiet:
            return False
        return self._mm[STOP_RECORDS_END + (rank % END_BOARD_RANKS) * QUIET_SLOTS + slot] != 0

    def set_quiet(self, rank: int, slots: bytes) -> None:
        """The manager: ``rank``'s quiet slots, one byte a slot index from 0 (non-zero: quiet; those past
        ``slots``, up to :data:`QUIET_SLOTS`, are not). Each byte is its own word: a trainer reading as they are
        written sees each slot's old or new state."""
        if not self.has_quiet:
            return
        offset = STOP_RECORDS_END + (rank % END_BOARD_RANKS) * QUIET_SLOTS
        self._mm[offset:offset + QUIET_SLOTS] = slots[:QUIET_SLOTS].ljust(QUIET_SLOTS, b"\0")

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass


class ThreadState:
    """Whether a thread is runnable (``R``: running, or waiting for a core) from ``/proc/<tid>/stat``, one ``pread`` of
    a descriptor kept open (~2 us). A thread gone, or one this process may not read, reads as not runnable."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        try:
            self._fd: int | None = os.open(f"/proc/{tid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def runnable(self) -> bool:
        if self._fd is None:
            return False
        try:
            data = os.pread(self._fd, 256, 0)
        except OSError:  # gone
            self.close()
            return False
        close = data.rfind(b")")  # the name, in parentheses, may hold anything
        return close >= 0 and data[close + 2:close + 3] == b"R"

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
