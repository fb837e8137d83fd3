"""Worker supervision: starting workers, talking to them, stopping them and reaping them.

A worker is ``python -m freeride._worker`` in a new session (so one ``killpg`` reaches the worker
and whatever it spawned), with one end of a SEQPACKET socketpair (:mod:`freeride._channel`),
``PR_SET_PDEATHSIG`` and the channel's end-of-file tying its life to the manager's. Its output goes
to a pipe that is drained into ``<task dir>/worker.log``, bounded in size and rotated
(:mod:`freeride._manager.worker_log`); its tail becomes part of a failure record. A worker's process
group dies with it (whatever it spawned is killed when it is reaped), and processes that a killed
manager's workers left behind are killed by the next manager (:mod:`freeride._manager.orphans`).

The supervisor registers each worker's channel, output pipe and pidfd with the loop's selector; the
callbacks it registers return core events (a worker's decoded messages, its failures and its exit),
which the loop feeds to the core: the supervisor decides nothing. Stopping a process has one way:
signals go to its process group (and a command task's own group), SIGKILL followed by SIGCONT so
that a frozen process dies too.

A message that does not decode, and one the manager must refuse (a checkpoint outside the task's
directory, a process group the worker could not have made), is a PROTOCOL failure of that task: its
worker is killed, the loop goes on. A full channel (a worker busy in a long step, or frozen) drops
the stale grant or park rather than blocking the loop; the freeze timer and the stop timeout cover
what a dropped message would have done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freeride import _channel as W
from freeride._boards import DOING_CHECKPOINT, WorkerBoard
from freeride._channel import Channel, ChannelClosed, ChannelFull, ProtocolError, socketpair
from freeride._manager import core as C
from freeride._manager import orphans
from freeride._manager.paths import TaskPaths
from freeride._manager.worker_log import CHUNK_BYTES, WorkerLog, read_tail_bytes
from freeride._task_process import (
    process_cpu_ns,
    process_dying,
    process_state,
    sched_times,
    schedstat,
    worker_environment,
)
from freeride.devices import Device
from freeride.devices.cpu import ProcField
from freeride.messages import FailureRecord

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4096
#: A worker that closed its channel and is dying (:func:`process_dying`) gets up to this many more end-of-file graces
#: to exit: a crash is then reported as its signal, not as a protocol failure. Found on a loaded 2-core machine: a
#: segfaulting worker at nice 19 was still in its exit 500 ms after its channel closed.
MAX_DYING_GRACES = 20
#: A worker that ran less than this from its grant to its freeze did not run in that grant (the few microseconds
#: it takes to handle a continue): it slept through it, or had no core.
IDLE_GRANT_RUN_NS = 50_000


@dataclass(frozen=True)
class StepsReported:
    """A worker reported the steps of a grant (its ``parked``): for the trace and the end fast path;
    the core gets the :class:`~freeride._manager.core.WorkerParked` that follows it."""

    task_id: str
    parked: W.Parked


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker is started with."""

    eof_grace_ms: float = 500.0
    worker_log_max_bytes: int = 8 * 2**20
    worker_log_backups: int = 1
    #: The trainer's end board, read by workers; None: ends reach workers through the manager only.
    end_board_path: Path | None = None
    #: The scheduling policy's name: ``paper`` workers use the reference system's admission rule.
    admission: str = "freeride"
    default_checkpoint_interval_s: float = 30.0
    #: When a worker writes where its threads are, in a phase that runs long (``Init.stack_report_ms``).
    stack_report_ms: float = 2000.0


@dataclass
class WorkerHandle:
    task_id: str
    proc: subprocess.Popen[bytes]
    channel: Channel
    pidfd: int
    log: WorkerLog
    log_fd: int  # the read end of the worker's output pipe; -1 once closed
    board: WorkerBoard | None  # its step and ended-grant words (None: the state directory refused it)
    sched: ProcField  # its schedstat (:func:`schedstat`), read at each grant and freeze; closed when it is reaped
    extra_pgids: list[int] = field(default_factory=list)
    closed: bool = False
    goodbye: bool = False  # the worker announced its exit: end-of-file is expected
    killed: bool = False  # this manager sent it SIGKILL: end-of-file is expected, its exit may lag
    eof_at_ns: int = 0
    #: Graces it was given past the first because it was dying (:data:`MAX_DYING_GRACES`).
    dying_graces: int = 0
    #: Its main thread's run time and run delay when its current grant began (-1: not read; ``granted``), and
    #: the run delays that grew inside its grants so far (what a freeze reports as its run delay).
    run_at_grant_ns: int = -1
    delay_at_grant_ns: int = -1
    grant_waits_ns: int = 0
    #: When the trainer stopped it at a bubble's end (:meth:`Supervisor.stopped_by_trainer`), until it is continued;
    #: 0: not so stopped. A freeze of it then dates nothing: the stop was dated at the trainer's time.
    trainer_stopped_ns: int = 0
    #: This manager stopped it (SIGSTOP: a freeze, a hold while parked) and has not continued it since.
    stopped: bool = False


class Supervisor:
    """The workers of one manager. ``watch(task_id, pids)`` / ``forget(task_id)`` tell the device poller
    which processes' memory to sample."""

    def __init__(self, device: Device, settings: WorkerSettings, paths: TaskPaths, selector: selectors.BaseSelector,
                 watch: Callable[[str, list[int]], None], forget: Callable[[str], None],
                 now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.device = device
        self.settings = settings
        self.paths = paths
        self._selector = selector
        self._watch = watch
        self._forget = forget
        self.now_ns = now_ns
        self.workers: dict[str, WorkerHandle] = {}
        #: Grants and parks dropped because a worker's channel was full.
        self.messages_dropped = 0
        #: Tasks whose workers are stopped (SIGSTOP) whenever they park: their own threads ran between grants
        #: (:meth:`hold_while_parked`); and those stopped now, parked, continued before any message.
        self._stop_when_parked: set[str] = set()
        self._held_parked: set[str] = set()
        #: Called with a worker's pid right before it is reaped (the end path takes back a stop armed for it).
        self.before_reap: Callable[[int], None] = lambda pid: None
        #: Called with a worker's pid and its command task's process group as the worker says it (the end path
        #: names it in a stop armed for that worker already: the first grant starts the command).
        self.on_command_group: Callable[[int, int], None] = lambda pid, pgid: None

    # ------------------------------------------------------------ what the loop asks

    def board(self, task_id: str) -> WorkerBoard | None:
        handle = self.workers.get(task_id)
        return handle.board if handle is not None else None

    def pid(self, task_id: str) -> int:
        handle = self.workers.get(task_id)
        return handle.proc.pid if handle is not None else 0

    def command_group(self, task_id: str) -> int:
        """The process group of a command task's command (0: none, or not yet said): stopped with the worker."""
        handle = self.workers.get(task_id)
        return handle.extra_pgids[0] if handle is not None and handle.extra_pgids else 0

    def send(self, task_id: str, message: W.ManagerMessage) -> list[Any]:
        """Send a message; a full channel drops it (counted). A closed one returns the events of what the
        worker sent before it closed it, and starts the end-of-file grace."""
        handle = self.workers.get(task_id)
        if handle is None or handle.closed:
            return []
        if task_id in self._held_parked:  # stopped while parked: it must run to read this (and to drain its channel)
            self._held_parked.discard(task_id)
            self._signal(handle, signal.SIGCONT)
        try:
            handle.channel.send(message)
        except ChannelFull:
            # The worker is busy (a long step or setup) or frozen: a grant or park it cannot read
            # now is stale by the time it could. The freeze timer and stop timeout still apply.
            self.messages_dropped += 1
            log.debug("[%s task=%s] worker not reading; dropped %s", self.device, task_id, message.TAG)
        except ChannelClosed:
            # The worker went away (it failed, it finished) with its last messages still unread: a
            # failure report must not be lost, or its exit reads as one "without reporting an error".
            events = self._read_channel(handle)
            self._channel_eof(handle)
            return events
        return []

    def signal(self, task_id: str, sig: int) -> None:
        handle = self.workers.get(task_id)
        if handle is not None:
            self._signal(handle, sig)
            if sig == signal.SIGCONT:
                self._held_parked.discard(task_id)

    def hold_while_parked(self, task_id: str) -> None:
        """From now on, stop ``task_id``'s worker (SIGSTOP) whenever it parks, and now: its own threads ran
        between grants, taking the device from training. A message to it (a grant, a stop) continues it."""
        self._stop_when_parked.add(task_id)
        self.parked(task_id)

    def reopen_logs(self) -> None:
        """Each live worker's log opened again at its path (the state directory was made again)."""
        for handle in self.workers.values():
            handle.log.reopen()

    def holds_while_parked(self, task_id: str) -> bool:
        """Whether :meth:`hold_while_parked` was said of ``task_id``'s worker."""
        return task_id in self._stop_when_parked

    def parked(self, task_id: str) -> None:
        """``task_id`` parked: stopped until its next message, where :meth:`hold_while_parked` said so."""
        handle = self.workers.get(task_id)
        if handle is not None and task_id in self._stop_when_parked and task_id not in self._held_parked:
            self._held_parked.add(task_id)
            self._signal(handle, signal.SIGSTOP)

    def stopped_by_trainer(self, task_id: str, at_ns: int) -> None:
        """The trainer stopped ``task_id``'s worker (SIGSTOP) at ``at_ns``, at a bubble's end: dated on its board
        as a stop of this manager's is, and continued before its next message (like a worker held while parked),
        unless the core freezes it first (:meth:`freeze`: its grant then thaws it). Nothing where this manager had
        stopped it already (a freeze dated it)."""
        handle = self.workers.get(task_id)
        if handle is None or handle.trainer_stopped_ns or handle.stopped:
            return
        handle.trainer_stopped_ns = at_ns
        self._held_parked.add(task_id)
        if handle.board is not None:
            with contextlib.suppress(OSError, ValueError, TypeError):
                handle.board.note_stop(at_ns, continued=False)

    def granted(self, task_id: str) -> None:
        """A grant went to the worker (its message sent, a frozen one thawed): its run time and run delay now,
        so that its freeze can tell the waits for its core inside the grant from those outside it (~5 us)."""
        handle = self.workers.get(task_id)
        if handle is not None:
            handle.run_at_grant_ns, handle.delay_at_grant_ns = sched_times(handle.sched)

    def freeze(self, task_id: str) -> list[Any]:
        """SIGSTOP the worker; the steps it finished in the grant it is frozen in, from its board (always
        answered: the core judges a step that used up its timeout on this read, ``WorkerStepsSeen``).

        Its run delay is read before the stop, and only what grew inside its grants is reported (the growth
        since :meth:`granted`, summed over grants): a worker at nice 19 frozen mid-step on a rank's core waits for
        that core until the rank's next bubble before its stop lands, and that wait, outside any grant, was taken
        off its step's granted time, so a step hung in a busy loop beside a rank was never judged (a stranger's
        ran through 10,000 freezes past a 60 s step timeout, first in every bubble). A worker that did not run
        in the grant had no core in it, if it waits for one now (a wait the kernel books only once it ends), or
        slept through it, if it sleeps: read before the stop, which wakes a sleeping worker (runnable until it
        has handled the stop); the state (~60 us) only for a worker that did not run."""
        handle = self.workers.get(task_id)
        if handle is None:
            return []
        pid = handle.proc.pid
        ran, delay = sched_times(handle.sched)
        state = ""
        if handle.run_at_grant_ns >= 0 and 0 <= ran - handle.run_at_grant_ns < IDLE_GRANT_RUN_NS:
            state = process_state(pid)
        starved, asleep = state == "R", state in ("S", "D")
        self._held_parked.discard(task_id)  # frozen: its grant thaws it, not the next message
        self._signal(handle, signal.SIGSTOP)
        if delay >= 0 and handle.delay_at_grant_ns >= 0:
            handle.grant_waits_ns += max(0, delay - handle.delay_at_grant_ns)
        handle.run_at_grant_ns = handle.delay_at_grant_ns = -1  # until the next grant's reading
        waited = handle.grant_waits_ns if delay >= 0 else -1
        if handle.board is None:  # no board to read
            return [C.WorkerStepsSeen(task_id, -1, run_delay_ns=waited, starved=starved, asleep=asleep)]
        # Steps it finished inside the grant it is frozen in have not been reported yet; a step word
        # still at -1 says it has begun none: it is inside setup().
        board = handle.board
        try:
            step = board.step()
            return [C.WorkerStepsSeen(task_id, board.steps_done(), step < 0, board.doing() == DOING_CHECKPOINT,
                                      run_delay_ns=waited, step=step, starved=starved, asleep=asleep)]
        except (OSError, ValueError) as exc:  # a closed mapping: answered all the same, as nothing read
            log.warning("[%s task=%s] its board could not be read at a freeze: %s", self.device, task_id, exc)
            return [C.WorkerStepsSeen(task_id, -1, run_delay_ns=waited, starved=starved, asleep=asleep)]

    def cpu_ns(self, task_id: str) -> int | None:
        """The worker process's CPU time so far (its own threads; not its children's); None without one."""
        handle = self.workers.get(task_id)
        return None if handle is None else process_cpu_ns(handle.proc.pid)

    def kill_all(self) -> None:
        for handle in list(self.workers.values()):
            self._signal(handle, signal.SIGKILL)

    def log_tail(self, task_id: str) -> str:
        handle = self.workers.get(task_id)
        if handle is not None:
            self._read_log(handle, chunks=64)
            return handle.log.tail(LOG_TAIL_BYTES)
        return read_tail_bytes(self.paths.task_dir(task_id) / "worker.log", LOG_TAIL_BYTES).decode(errors="replace")

    def next_timer_ns(self) -> int | None:
        deadlines = [h.eof_at_ns for h in self.workers.values() if h.eof_at_ns]
        return min(deadlines) if deadlines else None

    def poll(self, now: int) -> list[Any]:
        """Kill workers that closed their channel but kept running past the grace."""
        events: list[Any] = []
        for handle in list(self.workers.values()):
            if handle.eof_at_ns and now >= handle.eof_at_ns:
                handle.eof_at_ns = 0
                # Killed here, it closed its channel as it died: its exit (reaped through its pidfd) may come
                # long after on a loaded core (nice 19 runs its exit too). Judged a protocol failure, a task
                # killed while starting in a drain was FAILED instead of going back to wait.
                if handle.proc.poll() is None and not handle.killed:
                    if process_dying(handle.proc.pid) and handle.dying_graces < MAX_DYING_GRACES:
                        # On its way out (a crash, its core): its exit says how it died, however late it comes.
                        handle.dying_graces += 1
                        handle.eof_at_ns = now + int(self.settings.eof_grace_ms * 1e6)
                        continue
                    events.append(self._protocol_failure(handle, "the worker closed its channel but kept running"))
                    self._signal(handle, signal.SIGKILL)
        return events

    # ------------------------------------------------------------ starting

    def spawn(self, action: C.Spawn) -> list[Any]:
        task_id = action.task_id
        task_dir = self.paths.task_dir(task_id)
        checkpoint_dir = self.paths.checkpoint_dir(task_id)
        try:
            # Owner-only: a cluster task's are under the shared --checkpoint-dir (they were 0755, files 0644).
            checkpoint_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            checkpoint_dir.mkdir(mode=0o700, exist_ok=True)
            (task_dir / "work").mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a full or read-only state directory: say so rather than stay STARTING
            return _spawn_failed(task_id, f"cannot prepare the task directory {task_dir}: {exc}")
        board: WorkerBoard | None = None
        try:
            board = WorkerBoard.create(task_dir / "board")
        except OSError as exc:  # the worker then learns of ends by its channel only
            log.warning("[%s task=%s] no board for the worker: %s", self.device, task_id, exc)
        try:
            log_fd, out_fd = os.pipe2(os.O_CLOEXEC)
        except OSError as exc:
            return _spawn_failed(task_id, f"cannot make the worker's output pipe: {exc}")
        worker_log = WorkerLog(task_dir / "worker.log", self.settings.worker_log_max_bytes,
                               self.settings.worker_log_backups)
        parent_sock, child_sock = socketpair()
        env = worker_environment(self.device, action.memory_bytes)
        env[orphans.MARKER_ENV] = str(task_dir)
        spec = action.spec
        cwd = spec.working_dir if spec.working_dir and os.path.isdir(spec.working_dir) else str(task_dir / "work")
        argv = [sys.executable, "-m", "freeride._worker", "--fd", str(child_sock.fileno()),
                "--parent-pid", str(os.getpid())]
        try:
            proc = subprocess.Popen(argv, pass_fds=(child_sock.fileno(),), start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=out_fd, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        except OSError as exc:
            parent_sock.close()
            child_sock.close()
            os.close(log_fd)
            os.close(out_fd)
            worker_log.close()
            if board is not None:
                board.close()
            return _spawn_failed(task_id, f"cannot start the worker: {exc}")
        child_sock.close()
        os.close(out_fd)
        orphans.record(task_dir, proc.pid)
        handle = self.adopt(task_id, proc, parent_sock, log_fd, worker_log, board)
        init = W.Init(
            task_id=task_id, target=spec.target, args=spec.args, command=spec.command, working_dir=spec.working_dir,
            device=str(self.device), memory_limit_bytes=action.memory_bytes, work_dir=str(task_dir / "work"),
            checkpoint_dir=str(checkpoint_dir), resume_path=action.resume_path,
            checkpoint_interval_s=spec.checkpoint_interval_s or self.settings.default_checkpoint_interval_s,
            step_time_hint_ms=spec.step_time_hint_ms, board_file=str(task_dir / "board") if board is not None else "",
            end_board=str(self.settings.end_board_path or ""), admission=self.settings.admission,
            stack_report_ms=self.settings.stack_report_ms,
        )
        try:
            handle.channel.send(init)
        except (ProtocolError, ChannelFull, ChannelClosed) as exc:
            # Validation bounds what a spec carries, so this is a backstop: a worker that never gets
            # its init would hold the task in STARTING for good. Fail the task; its exit completes it.
            self._signal(handle, signal.SIGKILL)
            return [C.WorkerFailed(task_id, FailureRecord(kind="SPAWN", message=f"cannot send the task to its "
                                                          f"worker: {exc}", at_unix_s=time.time()))]
        log.info("[%s task=%s] worker pid %d started", self.device, task_id, proc.pid)
        return []

    def adopt(self, task_id: str, proc: subprocess.Popen[bytes], sock: socket.socket, log_fd: int,
              worker_log: WorkerLog, board: WorkerBoard | None) -> WorkerHandle:
        """Supervise a started worker: its channel's end, the read end of its output pipe, its log, its board."""
        os.set_blocking(log_fd, False)
        sock.setblocking(False)
        channel = Channel(sock)
        handle = WorkerHandle(task_id, proc, channel, os.pidfd_open(proc.pid), worker_log, log_fd, board,
                              schedstat(proc.pid))
        self.workers[task_id] = handle
        self._selector.register(channel.fileno(), selectors.EVENT_READ, lambda: self._read_channel(handle))
        self._selector.register(handle.pidfd, selectors.EVENT_READ, lambda: self._reap(handle))
        self._selector.register(log_fd, selectors.EVENT_READ, lambda: self._read_log(handle))
        self._watch(task_id, [proc.pid])
        return handle

    # ------------------------------------------------------------ the worker's messages

    def _read_channel(self, handle: WorkerHandle) -> list[Any]:
        events: list[Any] = []
        while not handle.closed:
            try:
                msg = handle.channel.recv_nowait()
            except ChannelClosed:
                self._channel_eof(handle)
                break
            except ProtocolError as exc:
                events.append(self._protocol_failure(handle, f"the worker sent a malformed message: {exc}"))
                self._signal(handle, signal.SIGKILL)
                break
            if msg is None:
                break
            try:
                events += self.on_message(handle, msg)
            except ProtocolError as exc:
                events.append(self._protocol_failure(handle, f"the worker sent a malformed {msg.TAG!r}: {exc}"))
                self._signal(handle, signal.SIGKILL)
                break
        return events

    def on_message(self, handle: Any, msg: W.Message) -> list[Any]:
        """What a decoded worker message means: core events, or :class:`ProtocolError` for one the worker
        may not send (``handle`` needs ``task_id``, and ``proc`` and ``extra_pgids`` for a process group)."""
        tid = handle.task_id
        if isinstance(msg, W.Parked):
            return [StepsReported(tid, msg), C.WorkerParked(
                tid, msg.grant_id, msg.steps, msg.durations_ns, msg.first_step_ns, msg.last_end_ns, msg.parked_ns,
                msg.reason, msg.progress, msg.total_steps, warmup_steps=msg.warmup_steps,
                seen_end_ns=msg.end_ns, costs_ns=msg.costs_ns, worked_ns=msg.worked_ns)]
        if isinstance(msg, W.Usage):
            return [C.WorkerUsage(tid, msg.device_bytes)]
        if isinstance(msg, W.Ready):
            return [C.WorkerReady(tid, msg.pid, msg.progress_unit, msg.context_bytes, msg.baseline_bytes,
                                  msg.host_baseline_bytes)]
        if isinstance(msg, W.Checkpointed):
            home = self.paths.checkpoint_home(tid)
            if not Path(msg.path).resolve().is_relative_to(home.resolve()):
                raise ProtocolError(f"checkpoint path {msg.path!r} is outside the task's directory")
            return [C.WorkerCheckpointed(tid, msg.step, msg.path, msg.progress)]
        if isinstance(msg, W.Finished):
            return [C.WorkerFinished(tid, msg.total_steps, msg.progress)]
        if isinstance(msg, W.Failed):
            failure = FailureRecord(kind=msg.kind, message=msg.message, traceback=msg.traceback, step=msg.step,
                                    at_unix_s=time.time())
            return [C.WorkerFailed(tid, failure, msg.durations_ns, msg.progress, msg.total_steps, msg.worked_ns)]
        if isinstance(msg, W.CheckpointFailed):
            # The worker goes on and tries again later; the last acknowledged checkpoint stands.
            log.warning("[%s task=%s] checkpoint at step %s not written: %s", self.device, tid, msg.step, msg.error)
            return []
        if isinstance(msg, W.Bye):
            handle.goodbye = True
            return []
        if isinstance(msg, W.ProcessGroup):
            # The manager will SIGKILL this group: 0 or a negative number would make killpg name the
            # manager's own group or fail with EINVAL on the loop thread, and 1 is init's.
            if msg.pgid <= 1 or msg.pgid == os.getpgrp():
                raise ProtocolError(f"process group {msg.pgid} is not one a command task could have made")
            handle.extra_pgids.append(msg.pgid)
            self._watch(tid, [handle.proc.pid, *handle.extra_pgids])
            self.on_command_group(handle.proc.pid, msg.pgid)
            return []
        # The channel decodes only worker messages: a manager's own is no business of a worker.
        raise ProtocolError(f"a {msg.TAG!r} message is not one a worker may send")

    def _protocol_failure(self, handle: WorkerHandle, message: str) -> C.WorkerFailed:
        return C.WorkerFailed(handle.task_id, FailureRecord(
            kind="PROTOCOL", message=message, step=self.paths.board_step(handle.task_id), at_unix_s=time.time()))

    # ------------------------------------------------------------ output, end-of-file, exit

    def _read_log(self, handle: WorkerHandle, chunks: int = 1) -> list[Any]:
        """Move up to ``chunks`` chunks of the worker's output from its pipe to its log (one per wake-up:
        a task that prints without pause costs each turn of the loop one read and one write)."""
        for _ in range(chunks):
            if handle.log_fd < 0:
                break
            try:
                data = os.read(handle.log_fd, CHUNK_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # every writer is gone
                self._close_log(handle)
                break
            handle.log.write(data)
        return []

    def _close_log(self, handle: WorkerHandle) -> None:
        if handle.log_fd >= 0:
            self._selector.unregister(handle.log_fd)
            os.close(handle.log_fd)
            handle.log_fd = -1
        handle.log.close()

    def _channel_eof(self, handle: WorkerHandle) -> None:
        if handle.closed:
            return
        self.before_reap(handle.proc.pid)  # its poll below reaps a worker that is gone
        handle.closed = True
        self._selector.unregister(handle.channel.fileno())
        handle.channel.close()
        if not handle.goodbye and handle.proc.poll() is None:
            handle.eof_at_ns = self.now_ns() + int(self.settings.eof_grace_ms * 1e6)

    def _reap(self, handle: WorkerHandle) -> list[Any]:
        events = self._read_channel(handle) if not handle.closed else []  # its last words come first
        self._channel_eof(handle)
        # Whatever the task spawned dies with it. The unreaped worker still holds its pid, so the
        # group id cannot have been reused by an unrelated process yet.
        _killpg(handle.proc.pid, signal.SIGKILL)
        self.before_reap(handle.proc.pid)
        returncode = handle.proc.wait()
        # What the worker wrote last (a crash's last words) is still in the pipe: log it before the
        # tail is read. Bounded: a process the task left behind may still be writing.
        self._read_log(handle, chunks=64)
        tail = handle.log.tail(LOG_TAIL_BYTES)
        self._close_log(handle)
        if handle.board is not None:
            handle.board.close()
        orphans.forget(self.paths.task_dir(handle.task_id))
        self._selector.unregister(handle.pidfd)
        os.close(handle.pidfd)
        handle.sched.close()
        self.workers.pop(handle.task_id, None)
        self._stop_when_parked.discard(handle.task_id)
        self._held_parked.discard(handle.task_id)
        self._forget(handle.task_id)
        for pgid in handle.extra_pgids:  # a command task's own group dies with its worker
            _killpg(pgid, signal.SIGKILL)
        sig = -returncode if returncode < 0 else 0
        code = returncode if returncode >= 0 else None
        events.append(C.WorkerExited(handle.task_id, code, sig, tail, self.paths.board_step(handle.task_id)))
        return events

    def close(self) -> None:
        """Kill every worker and wait for it (the manager is stopping)."""
        for handle in list(self.workers.values()):
            self.before_reap(handle.proc.pid)
            self._signal(handle, signal.SIGKILL)
            handle.proc.wait()
            self._read_log(handle, chunks=64)
            self._close_log(handle)
            if handle.board is not None:
                handle.board.close()
            orphans.forget(self.paths.task_dir(handle.task_id))

    def _signal(self, handle: WorkerHandle, sig: int) -> None:
        """Signal the worker's process groups. A stop or continue is dated on its board first: a step it is in
        leaves the time it stood still out of its own (:class:`freeride._worker.timing.ThawCounter`)."""
        if sig == signal.SIGSTOP and handle.trainer_stopped_ns:
            pass  # stopped by the trainer already: dated then (stopped_by_trainer)
        elif sig in (signal.SIGSTOP, signal.SIGCONT) and handle.board is not None:
            with contextlib.suppress(OSError, ValueError, TypeError):  # a closed mapping: the step keeps its bound
                handle.board.note_stop(time.monotonic_ns(), sig == signal.SIGCONT)
        if sig == signal.SIGCONT:
            handle.trainer_stopped_ns = 0
            handle.stopped = False
        elif sig == signal.SIGSTOP:
            handle.stopped = True
        # A command task's own group is stopped with its worker and killed with it, but continued only by its task's
        # slices: between two of them the task stopped it, and a thaw that continued it too let the command run on
        # outside every bubble while its worker parked (runnable in 88% of a stranger's samples).
        for pgid in [handle.proc.pid, *handle.extra_pgids] if sig != signal.SIGCONT else [handle.proc.pid]:
            _killpg(pgid, sig)
        if sig == signal.SIGKILL:  # a frozen process must run to die
            handle.killed = True
            for pgid in [handle.proc.pid, *handle.extra_pgids]:
                _killpg(pgid, signal.SIGCONT)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn_failed(task_id: str, message: str) -> list[Any]:
    return [C.WorkerFailed(task_id, FailureRecord(kind="SPAWN", message=message, at_unix_s=time.time())),
            C.WorkerExited(task_id, exit_code=None, signal=0)]
