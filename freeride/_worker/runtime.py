"""The worker runtime: runs one side task inside the grants its manager sends.

Lifecycle of a worker process (one per task, in its own session, started by the manager):

1. Arrange to die with the manager (``PR_SET_PDEATHSIG``, and end-of-file on the channel), and for what the task
   starts in its process group to die with the worker (:func:`kill_group_when_gone`).
2. Read ``init``; prepare the device (core pinning and low priority on CPU; on CUDA the context,
   one cap for context, torch and CuPy, low priority and few threads: see
   :mod:`freeride.devices.cuda_worker`); import and construct the task. Report ``ready`` (with the CUDA
   context's size, and the footprint the cap does not cover: on a CPU core the resident set of
   the interpreter and the task's libraries, on a GPU that resident set as the host baseline), or
   ``failed`` and exit.
3. Wait for a ``grant`` (deadline, margin). The first grant runs ``setup`` (and restores the last
   checkpoint); then, while ``now + p95 step time + margin <= deadline``, run ``step()``. A grant that
   follows the trainer's ends carries its slot's recent lengths: once the bubble outlives the deadline
   with no end known, the deadline becomes what those lengths say is left
   (:func:`freeride._estimator.surviving_end_ns`: the longest for a step within the grace, else the
   low percentile of the longer ones), so a bubble longer than predicted is not left idle.
   **A step is timed in device time**: on CUDA ``step()`` returns once its kernels are queued, so
   the runtime waits for the device (:meth:`WorkerDevice.synchronize`) before it stops the step's
   clock and decides on the next one; the time is then what the GPU spent, and no step is admitted
   on the strength of a launch time. Between steps, read the channel without blocking: a ``park``
   for this grant (the real bubble end came early) stops the loop after the current step. And right
   before each step, read the boards (:mod:`freeride._boards`; two memory loads): the manager's
   ended-grant word, which it sets before it sends a park, and the trainer's end of this grant's
   bubble, which the trainer writes before its end even reaches the wire. Either stops the loop, so
   no step starts after an end the worker could know of. Then report ``parked`` with the step
   durations, then (``usage``, apart, so that measuring never delays the park) the device memory the
   worker holds, and go back to waiting. No task code runs outside
   grants. A step, setup or checkpoint that runs long has its threads' stacks written to the log
   (:mod:`freeride._worker.stacks`), so that the failure of a hung step says where it hung: its thread wakes
   twice a second at the default step timeout, between grants too (~0.1 ms of CPU a wake on the 2-core VM).
4. Checkpoint when the interval has passed (inside a grant, when its last duration fits) and on
   ``stop``; checkpoints are written to a temporary file, fsynced and renamed, so a reader only
   ever sees whole files, and the last two are kept. A checkpoint the disk refuses (full,
   read-only) is reported to the manager and tried again an interval later: the last written one
   still stands. One that cannot be serialised is the task's bug: the task fails with CHECKPOINT.
5. Exit 0 when the task is done or stopped; on an exception, report ``failed`` with the traceback
   and the step, and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from freeride import _checkpoints
from freeride._boards import DOING_CHECKPOINT, DOING_STEP, EndBoard, ThreadState, WorkerBoard
from freeride._channel import (
    MANAGER_MESSAGES,
    Bye,
    Channel,
    ChannelClosed,
    Checkpointed,
    CheckpointFailed,
    Failed,
    Finished,
    Grant,
    Init,
    Park,
    Parked,
    ProcessGroup,
    ProtocolError,
    Ready,
    Stop,
    Usage,
)
from freeride._estimator import StepEstimator, surviving_end_ns, within_grace
from freeride._task_process import prepare_process, watch_group
from freeride._worker.stacks import CHECKPOINT, SETUP, STEP, StackWatch
from freeride._worker.timing import PAPER_SLEEP_AFTER_STEP_S, ThawCounter, paper_step_fits
from freeride.devices import WorkerDevice, WorkerSetupError, worker_device
from freeride.errors import ConfigError
from freeride.task import SideTask, TaskContext, finite_progress
from freeride.units import format_steps

log = logging.getLogger("freeride.worker")

_PR_SET_PDEATHSIG = 1
#: Step durations carried by one ``parked`` report (the estimator only needs recent ones).
MAX_REPORTED_DURATIONS = 64
#: A checkpoint this many intervals overdue is written even if its estimated time fits no grant:
#: one slow write (a loaded disk) would otherwise keep every later checkpoint out for good.
CHECKPOINT_OVERDUE_INTERVALS = 2
#: How often, in wall time, a worker on a CPU core reads its own resident set between steps
#: (:meth:`WorkerRuntime._check_resident`): a read costs a few microseconds, under 1% of the steps' time.
RESIDENT_CHECK_NS = 1_000_000
#: How long a worker sleeps where the trainer's thread it shares a core with is runnable, before it looks again
#: (:meth:`WorkerRuntime._rank_wants_core`): the rank then has the core, and the worker a step's chance soon after
#: the rank blocks again in the same bubble.
RANK_YIELD_S = 50e-6
EXIT_FAILED = 1
EXIT_SETUP_FAILED = 2
#: What task code may raise that becomes the task's failure record. SystemExit and KeyboardInterrupt
#: too: a task (or a module it imports) that calls ``sys.exit(7)`` must not end the worker without a
#: record, nor make its exit code look like the runtime's.
_TASK_ERRORS = (Exception, SystemExit, KeyboardInterrupt)


#: The phase of a failure to read any checkpoint back (:meth:`WorkerRuntime._restore`).
RESTORING = "restoring a checkpoint"


class _TaskError(Exception):
    """Wraps an exception raised by task code, with where it happened."""

    def __init__(self, kind: str, phase: str, exc: BaseException) -> None:
        super().__init__(f"{phase}: {type(exc).__name__}: {exc}")
        self.kind = kind
        self.phase = phase
        self.exc = exc
        self.tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    return name in ("OutOfMemoryError", "OutOfMemoryError_") or "out of memory" in str(exc).lower()


def _failure_kind(exc: BaseException) -> str:
    """MEMORY_LIMIT for running out of memory; CONFIG for what the user can fix (a ConfigError: a missing or
    malformed input file, a size that cannot fit the cap), which the CLI shows as one line; else EXCEPTION."""
    if _is_oom(exc):
        return "MEMORY_LIMIT"
    return "CONFIG" if isinstance(exc, ConfigError) else "EXCEPTION"


#: The write end of :func:`kill_group_when_gone`'s watch, held open for the worker's whole life.
_GROUP_WATCH: int | None = None


def kill_group_when_gone() -> None:
    """Have the processes of this worker's group (what its task started) killed once the worker is gone.

    The manager kills a worker's group when it reaps the worker; a manager killed with -9 cannot, and the worker
    dies with it (its death signal) while the task's children live on: :func:`freeride._task_process.watch_group`
    kills the group however the worker dies. Only a worker that leads its own group (as the manager starts it):
    elsewhere the group is someone else's. (A command task's own group is watched by the task:
    :class:`freeride.command.CommandTask`.)"""
    global _GROUP_WATCH
    pgid = os.getpgid(0)
    if _GROUP_WATCH is not None or pgid != os.getpid():
        return
    try:
        write_end = watch_group(pgid)
    except OSError as exc:
        log.warning("no watch on this worker's process group (%s): what the task starts may outlive a manager "
                    "killed with -9", exc)
        return
    _GROUP_WATCH = write_end


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the channel's EOF still ends us
        pass
    if parent_pid and os.getppid() != parent_pid:
        # The manager died between fork and prctl: there is nobody to work for.
        os._exit(0)


@dataclass(slots=True)
class _GrantSteps:
    """What ran in one grant, until its report (:meth:`WorkerRuntime._send_parked`)."""

    #: The last ``MAX_REPORTED_DURATIONS`` steps' running times and starts.
    durations: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    #: Their costs: each duration less what the step waited for the device (``WorkerDevice.waited_ns``).
    costs: list[int] = field(default_factory=list)
    count: int = 0  # every step, listed or not
    #: Every step's cost, listed or not: what the grant harvested (its steps' time, less their waits for the
    #: device). The listed durations alone counted only a grant's last 64 steps, and wall time a worker at
    #: nice 19 spent with the trainer on its core.
    worked_ns: int = 0
    warmup: bool = False  # the first listed step is the process's first (no step-time sample)
    #: "bubble start -> first step": the first step's start; 1: not measured (after setup, or after the rest
    #: of an earlier grant's step); 0: no step yet.
    first_ns: int = 0
    last_end_ns: int = 0
    #: The process's CPU time when the last step began (the manager's bound on what ran past an end).
    last_start_cpu_ns: int = 0
    #: The trainer's end of this bubble, read on a board (0: none).
    seen_end_ns: int = 0

    def add(self, start_ns: int, ran_ns: int, end_ns: int, cpu_start_ns: int, cost_ns: int) -> None:
        self.worked_ns += cost_ns
        self.durations.append(ran_ns)
        self.starts.append(start_ns)
        self.costs.append(cost_ns)
        self.last_start_cpu_ns = cpu_start_ns
        if len(self.durations) > MAX_REPORTED_DURATIONS:
            del self.durations[0]
            del self.starts[0]
            del self.costs[0]
            self.warmup = False  # the warm-up step was the one dropped
        self.last_end_ns = end_ns


class WorkerRuntime:
    def __init__(self, channel: Channel, init: Init) -> None:
        self.chan = channel
        self.init = init
        self.task_id = init.task_id
        self.limit = init.memory_limit_bytes
        self.work_dir = Path(init.work_dir)
        self.checkpoint_dir = Path(init.checkpoint_dir)
        self.resume_path = init.resume_path
        self.checkpoint_interval_ns = int((init.checkpoint_interval_s or 30.0) * 1e9)
        hint_ns = int(init.step_time_hint_ms * 1e6)
        #: ``paper``: the reference system's rule (see :func:`paper_step_fits`) and its 5 ms sleep
        #: after every step, for the bench's side-by-side comparison; else this project's rule.
        self.paper = init.admission == "paper"
        self.estimator = StepEstimator(hint_ns=hint_ns, quantile=0.5 if self.paper else 0.95)
        #: The first step of a process is a warm-up (lazy initialisation, first allocations, cold
        #: caches: a small LSTM's first step takes 25x its others on CPU). It counts as work but is no
        #: sample of the step time: a p95 over a few samples would be that one step for a long while,
        #: and a task whose estimate fits no bubble waits for a re-probe (200 bubbles).
        self._warmup_pending = True
        self.checkpoint_estimator = StepEstimator(window=8, quantile=1.0)
        self.device: WorkerDevice = worker_device(init.device)
        self.task: SideTask | None = None
        self.setup_done = False
        self.steps = 0
        self.last_checkpoint_ns = time.monotonic_ns()
        #: Steps of the last checkpoint (restored or written). 0 before any: what setup makes is no work to keep
        #: (a restart sets up again before it restores), and a first grant's checkpoint of step 0 only cost its
        #: bubble a ``state_dict()``.
        self.checkpointed_steps = 0
        #: The step and ended-grant words the manager shares with this worker (:mod:`freeride._boards`).
        self._board: WorkerBoard | None = None
        if init.board_file:
            try:
                self._board = WorkerBoard.attach(Path(init.board_file))
            except OSError as exc:  # ends then arrive by the channel only; a failure says less about the step
                log.warning("[task=%s] no board (%s)", self.task_id, exc)
        #: Where the trainer writes its bubble ends, when it runs on this host as this user.
        self._end_board: EndBoard | None = None
        #: The state of the trainer's thread whose bubbles this worker is granted (``cpu:N``: the end board says it).
        self._rank_thread: ThreadState | None = None
        #: Whether this worker says on the end board that it holds a bubble (from its first step to its park: the
        #: trainer stops it at the end where the manager armed that, :mod:`freeride._boards`); not on a board it could
        #: only read.
        self._says_holding = False
        if init.end_board:
            try:
                self._end_board = EndBoard.open(Path(init.end_board), writable=True)
                self._says_holding = self._end_board.stops
            except OSError:
                try:
                    self._end_board = EndBoard.open(Path(init.end_board), writable=False)
                except OSError as exc:
                    log.warning("[task=%s] no end board (%s): bubble ends arrive from the manager only",
                                self.task_id, exc)
        self.thaws = ThawCounter()
        if self._board is not None:  # the manager dates each stop there: a frozen step's time is then exact
            self.thaws.stood_still = self._board.stood_still_ns
        #: Writes where the threads are to the log while a step, setup or checkpoint runs long (its marks:
        #: ``watch.started``, set before the phase and cleared after it).
        self.watch = StackWatch(self.task_id, self.thaws.stood_still_ns, lambda: self.steps,
                                first_report_ns=int(init.stack_report_ms * 1e6))
        #: The current grant's steps: a failure report counts them (no park follows a failure); None once reported.
        self._grant_steps: _GrantSteps | None = None
        self._steps_in_process = 0
        #: Where the cap is the host's (a CPU core): the resident set it may reach (the baseline sent with
        #: ``ready`` plus the cap), checked between steps (:meth:`_check_resident`); None: not checked here.
        self._resident_cap: int | None = None
        self._resident_checked_ns = 0

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        self.thaws.install()
        try:
            self._prepare()
        except _TaskError as err:
            self._report_failure(err)
            return EXIT_SETUP_FAILED
        # Started after the process was pinned and lowered (on Linux a thread keeps the affinity and niceness it
        # was made with): its wakes go where the task's steps go.
        self.watch.start()
        try:
            return self._serve()
        finally:
            self.watch.close()

    def _serve(self) -> int:
        baseline = self.device.baseline_bytes()
        self.chan.send(Ready(pid=os.getpid(), progress_unit=self._progress_unit(),
                             context_bytes=self.device.context_bytes, baseline_bytes=baseline,
                             host_baseline_bytes=self.device.host_baseline_bytes()))
        if self.limit > 0 and baseline > 0 and self.device.resident_bytes() is not None:
            self._resident_cap = baseline + self.limit
        try:
            while True:
                msg = self.chan.recv()
                if isinstance(msg, Grant):
                    if self._run_grant(msg):
                        return 0
                elif isinstance(msg, Stop):
                    self._stop(msg.checkpoint)
                    return 0
                # a park outside a grant is stale: the grant already ended on its deadline
        except ChannelClosed:
            log.info("[task=%s] manager went away; exiting", self.task_id)
            self._close_task()
            return 0
        except ProtocolError as exc:  # the manager's bug, not the task's: say so and stop
            self._report_failure(_TaskError("PROTOCOL", "reading the manager's message", exc))
            self._close_task()
            return EXIT_FAILED
        except _TaskError as err:
            self._report_failure(err)
            self._close_task()
            return EXIT_FAILED

    def _prepare(self) -> None:
        command = self.init.command
        try:
            prepare_process(self.device, self.limit, command=bool(command))
        except WorkerSetupError as exc:  # the cap cannot hold the task's device context
            raise _TaskError(exc.kind, "preparing the device", exc) from exc
        except Exception as exc:
            raise _TaskError("CONFIG", "preparing the device", exc) from exc
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            args = dict(self.init.args)
            if command:
                from freeride.command import CommandTask

                self.task = CommandTask(argv=list(command), **args)
            else:
                from freeride._loading import load_task_class

                cls = load_task_class(self.init.target, self.init.working_dir)
                self.task = cls(**args)
        except _TASK_ERRORS as exc:
            # Arguments that do not fit or that the constructor refuses are the user's to fix (CONFIG);
            # anything else a constructor raises is a bug of the task's, with a traceback to read.
            kind = "IMPORT" if type(exc).__name__ == "TaskLoadError" else (
                "CONFIG" if isinstance(exc, (ConfigError, TypeError)) else "EXCEPTION")
            raise _TaskError(kind, "loading the task", exc) from exc

    def _progress_unit(self) -> str:
        return str(getattr(self.task, "progress_unit", "steps"))

    def _progress(self) -> float:
        """The task's ``progress()`` as a finite number (None: the steps done); anything else fails the task.

        A NaN went into the manager's store, which refused it, and took the manager of every task on the
        device down with it (the channel now refuses one too)."""
        assert self.task is not None
        try:
            return finite_progress(self.task.progress(), self.steps)
        except _TASK_ERRORS as exc:
            raise _TaskError("EXCEPTION", "progress()", exc) from exc

    # ------------------------------------------------------------------ grants

    def _ended(self, grant_id: int, bubble: tuple[int, int] | None) -> tuple[str, int] | None:
        """Whether the bubble of this grant has ended, by the boards: ``("park", end_ns)`` when the manager
        said so, ``("ended", end_ns)`` when the trainer did (``bubble``: its rank and start time; None
        when the grant does not follow the trainer's ends; ``end_ns`` a later bubble's start where the trainer's
        record has moved on: :meth:`EndBoard.ended_by_ns`), else None. Two memory loads, no syscall:
        checked right before each step, so that no step starts after an end the worker could know of.
        """
        if self._board is not None and self._board.ended_grant() >= grant_id:
            return ("park", self._board.ended_at_ns())
        if bubble is not None and self._end_board is not None:
            end_ns = self._end_board.ended_by_ns(*bubble)
            if end_ns:
                return ("ended", end_ns)
        return None

    def _rank_wants_core(self, rank: int) -> bool:
        """Whether ``rank``'s thread that computes and waits is runnable (a ``cpu:N`` trainer says it on the end board):
        it shares this worker's core, so a runnable rank waits for the core this worker holds, its data come (or its
        host work of the gap not done), and no step should start. Measured why (``bench.bench_schedules``, 1F1B,
        spin:50, two CPU ranks): with each bubble's end stamped where the data came, in 1,120 of 1,596 grants of the
        first rank the worker began steps after it, and its last step ended 0.41 ms (p50), 3.5 ms (p99) past it:
        the rank waited that long for its core while the worker, at nice 19, kept it."""
        board = self._end_board
        if board is None:
            return False
        tid = board.trainer_thread(rank)
        if not tid:
            return False
        state = self._rank_thread
        if state is None or state.tid != tid:
            if state is not None:
                state.close()
            state = self._rank_thread = ThreadState(tid)
        return state.runnable()

    @staticmethod
    def _bubble_of(grant: Grant) -> tuple[int, int] | None:
        """(rank, start time) of a grant's bubble, when the grant follows the trainer's own ends."""
        if not grant.trainer_ends:
            return None
        return grant.rank, grant.bubble_start_ns

    @staticmethod
    def _survival_of(grant: Grant) -> tuple[int, ...]:
        """The slot's lengths a grant's deadline may be extended by, sorted (none unless it follows the trainer's
        ends: a worker that cannot learn the real end keeps to its deadline)."""
        return tuple(sorted(grant.survival_ns)) if grant.trainer_ends else ()

    def _run_grant(self, grant: Grant) -> bool:
        """Step inside one grant (and any that supersede it); True when the task finished."""
        assert self.task is not None
        grant_id = grant.grant_id
        deadline = grant.deadline_ns
        margin = grant.margin_ns
        bubble = self._bubble_of(grant)
        survival = self._survival_of(grant)
        grace = grant.grace_ns
        if grant.probe:
            # The manager suspects a stale estimate: forget it and run at least one step.
            self.estimator = StepEstimator(hint_ns=0)
        set_up_now = not self.setup_done
        if set_up_now:
            self._setup()
        self._maybe_checkpoint(deadline, margin)
        record = _GrantSteps()
        self._grant_steps = record
        reason = "deadline"
        while True:
            if self._done():
                self._send_parked(grant_id, record, "done", bubble)
                self.chan.send(Finished(total_steps=self.steps, progress=self._progress()))
                self._close_task()
                return True
            msg = self.chan.recv_nowait()
            stop_now = False
            while msg is not None:
                if isinstance(msg, Park) and msg.grant_id == grant_id:
                    reason = "park"
                    stop_now = True
                elif isinstance(msg, Grant):  # a newer grant supersedes this one (thawed after a freeze)
                    if record.count:
                        # The steps of the grant a freeze ended, reported on their own (the manager takes
                        # them as statistics): under the new grant they would count as its steps, in its
                        # bubble, and the frozen grant's as none.
                        self._send_parked(grant_id, record, "frozen")
                        record = _GrantSteps(first_ns=record.first_ns)
                        self._grant_steps = record
                    grant_id = msg.grant_id
                    deadline = msg.deadline_ns
                    margin = msg.margin_ns
                    bubble = self._bubble_of(msg)
                    survival = self._survival_of(msg)
                    grace = msg.grace_ns
                    reason = "deadline"
                    stop_now = False
                    # After a step of the earlier grant, this one's first step comes after the rest of
                    # that step: its latency (bubble start -> first step) is not measured (0 and 1 both
                    # mean "none"; 0 before any step: the next step measures it).
                    record.first_ns = min(record.first_ns, 1)
                elif isinstance(msg, Stop):
                    self._send_parked(grant_id, record, "stop", bubble)
                    self._stop(msg.checkpoint)
                    return True
                msg = self.chan.recv_nowait()
            if stop_now:
                break
            # The end before the deadline: a worker that takes its grant late, past both, stopped because the
            # bubble ended. Reported as "deadline", the manager counted no park latency for it, kept no end
            # for its overrun and could backfill a bubble that was over.
            ended = self._ended(grant_id, bubble)
            if ended is not None:
                reason, record.seen_end_ns = ended
                break
            if bubble is not None and self._rank_wants_core(bubble[0]):
                # The rank waits for this core: give it the core, and look again (the end on its board, the
                # deadline, the rank blocked again in the same bubble) after a short sleep.
                time.sleep(RANK_YIELD_S)
                continue
            now = time.monotonic_ns()
            est = self.estimator.estimate_ns()
            if self.paper:
                if not paper_step_fits(est, deadline - now):
                    break
            elif now + (est or 0) + margin > deadline:
                # The bubble outlived the deadline and no end is known: size the step to what its slot's
                # lengths say is left (``surviving_end_ns``), or stop when that does not fit it either.
                if bubble is None or not survival:
                    break
                extended = surviving_end_ns(bubble[1], survival, now, within_grace(est, grace))
                if now + (est or 0) + margin > extended:
                    break
                deadline = extended
            if self._board is not None:
                self._board.publish_step(self.steps, now)
            if bubble is not None and self._says_holding:  # (the manager said so at the grant; a thaw's may not have)
                self._end_board.set_holding(bubble[0], True)  # type: ignore[union-attr]
            thaws, stood_before = self.thaws.mark(), self.thaws.stood_still_ns()
            step_deadline = deadline
            waited_start = self.device.waited_ns()
            cpu_start = time.process_time_ns()
            self.watch.started = (now, stood_before, est or 0, STEP)
            try:
                self.task.step()
                # Device time: the step is over when the device has done its work, not when its
                # kernels are queued (a fault in them surfaces here too, as this step's).
                self.device.synchronize()
            except _TASK_ERRORS as exc:
                raise _TaskError(_failure_kind(exc), f"a step, after {format_steps(self.steps)}", exc) from exc
            end = time.monotonic_ns()
            self.watch.started = None
            self.steps += 1
            record.count += 1
            self._steps_in_process += 1
            if self._resident_cap is not None and end - self._resident_checked_ns >= RESIDENT_CHECK_NS:
                self._check_resident(end)
            if self._board is not None:
                self._board.publish_done(self._steps_in_process)
            frozen = self.thaws.changed_since(thaws)
            ran = end - now
            cpu: int | None = None  # its CPU time, read once and only where a bound needs it
            if frozen:
                # Frozen after its bubble's real end, which comes before the predicted deadline when
                # the bubble ends early: bound the run by that end, or every early end would count
                # the frozen time up to the deadline as step time (a p95 that fits no bubble).
                known = self._ended(grant_id, bubble)
                if known is not None and known[1] > 0:
                    step_deadline = min(step_deadline, known[1])
                cpu = time.process_time_ns() - cpu_start
                ran = self.thaws.ran_ns(now, end, stood_before, step_deadline, cpu)
            else:
                known = self._ended(grant_id, bubble)
                if known is not None and now < known[1] < end:
                    # The bubble ended while this step ran: from then on the trainer had the device back
                    # (on a CPU core this worker, at nice 19, hardly ran). Its time is what it ran in the
                    # bubble or its CPU time, whichever is more: timed to its end, each step that met an end
                    # raised the estimate until the short bubbles fitted no step.
                    ran = min(ran, max(time.process_time_ns() - cpu_start, known[1] - now))
            # Its cost: what it ran, less what it waited for the device meanwhile (a core another thread had:
            # ``WorkerDevice.waited_ns``). The span keeps ``ran``: it says where the step was.
            cost = ran
            if waited_start is not None:
                waited_end = self.device.waited_ns()
                if waited_end is not None:
                    waited = waited_end - waited_start
                    cost = min(ran, max(0, end - now - waited))
                    if cpu is not None and self.thaws.stood_still is not None:  # frozen
                        # ``ran`` is the wall time less the stops as the manager dated them. A worker stopped while
                        # it waited for its core stops only once it gets one, so those waits and the stops overlap:
                        # ``ran`` less the waits undercounts by that overlap, never by compute (its CPU time).
                        cost = min(cost, max(cpu, ran - waited))
            if self._warmup_pending:
                self._warmup_pending = False
                record.warmup = True
            else:
                self.estimator.add(cost)
            record.add(now, ran, end, cpu_start, cost)
            # A grant that ran setup first, or began inside an earlier grant and was frozen, does
            # not measure "bubble start -> first step".
            record.first_ns = record.first_ns or (1 if set_up_now or frozen else now)
            if self.paper:
                time.sleep(PAPER_SLEEP_AFTER_STEP_S)
        self._send_parked(grant_id, record, reason, bubble)
        return False

    def _check_resident(self, now_ns: int) -> None:
        """Tell the manager at once of a resident set over the cap (it fails the task MEMORY_LIMIT, as its watchdog
        would). The watchdog polls every 50 ms, in which a task that grows fast doubled its cap (a stranger's: 82 MiB
        at a 40 MiB cap, 2 MiB a step); read here, once a millisecond of steps at most (``RESIDENT_CHECK_NS``), the
        overshoot is what the task allocates in that millisecond and the manager's answer. Told once."""
        self._resident_checked_ns = now_ns
        cap = self._resident_cap
        resident = self.device.resident_bytes()
        if cap is not None and resident is not None and resident > cap:
            self._resident_cap = None
            self.chan.send(Usage(device_bytes=resident))

    def _done(self) -> bool:
        assert self.task is not None
        try:
            return bool(self.task.done())
        except _TASK_ERRORS as exc:
            raise _TaskError("EXCEPTION", "done()", exc) from exc

    def _send_parked(self, grant_id: int, record: _GrantSteps, reason: str,
                     bubble: tuple[int, int] | None = None) -> None:
        """Report a grant's steps. Parking in ``bubble`` (its rank and start), it says on the end board that it holds
        that bubble no more, so that the trainer leaves it be at the end (:mod:`freeride._boards`): before the
        report where the end is known (it has come: a stop now would only cost a continue), after it where the
        deadline parks the worker ahead of the end. A worker starved at nice 19 between that decision and its
        report (77 us of work in a 4 ms hold, on a 2-core VM) held the bubble past the end until the manager froze
        it; still holding it, it is stopped by the trainer at the end, like a step."""
        self._grant_steps = None  # reported here: a later failure must not count them again
        held = bubble if self._says_holding else None
        if held is not None and reason != "deadline":
            self._end_board.set_holding(held[0], False)  # type: ignore[union-attr]
        self.chan.send(Parked(
            grant_id=grant_id,
            steps=record.count,
            durations_ns=tuple(record.durations),
            starts_ns=tuple(record.starts),
            warmup_steps=int(record.warmup),
            first_step_ns=record.first_ns if record.first_ns > 1 else 0,
            last_end_ns=record.last_end_ns,
            parked_ns=time.monotonic_ns(),
            reason=reason,
            # "ended": the trainer's end of this bubble, read on the end board before the manager
            # knew of it (the manager then neither parks nor backfills this bubble).
            end_ns=record.seen_end_ns,
            progress=self._progress(),
            total_steps=self.steps,
            last_start_cpu_ns=record.last_start_cpu_ns,
            costs_ns=tuple(record.costs) if record.costs != record.durations else (),
            worked_ns=record.worked_ns,
        ))
        if held is not None and reason == "deadline":
            self._end_board.let_go(*held)  # type: ignore[union-attr]
        if reason != "frozen":
            self._report_usage()

    def _report_usage(self) -> None:
        """What the device holds for this worker, as the worker itself measures it (the manager's figure where
        NVML cannot see the worker's process: containers), sent after the park it follows. On CUDA measuring
        asks NVML for the GPU's processes, a driver call that can take a millisecond: inside the report it
        delayed every park, and a worker not parked half a millisecond past the bubble's end is frozen. Not
        after a frozen grant's late report, which the next grant's first step waits for: that grant's own
        park measures."""
        used = self.device.used_bytes()
        if used:
            self.chan.send(Usage(device_bytes=used))

    # ------------------------------------------------------------------ setup and checkpoints

    def _setup(self) -> None:
        assert self.task is not None
        ctx = TaskContext(
            device=self.device.torch_device,
            device_name=str(self.device.name),
            memory_limit_bytes=self.limit,
            task_id=self.task_id,
            work_dir=self.work_dir,
            logger=logging.getLogger(f"freeride.task.{self.task_id}"),
        )
        self.watch.started = (time.monotonic_ns(), self.thaws.stood_still_ns(), 0, SETUP)
        try:
            self.task.setup(ctx)
            self.device.synchronize()
        except _TASK_ERRORS as exc:
            raise _TaskError(_failure_kind(exc), "setup", exc) from exc
        self.setup_done = True
        proc = getattr(self.task, "proc", None)
        if proc is not None and type(self.task).__name__ == "CommandTask":
            # The command runs in its own process group: the manager freezes and kills it too.
            self.chan.send(ProcessGroup(pgid=proc.pid))
        self._restore()
        self.watch.started = None

    def _restore(self) -> None:
        """Load the newest readable checkpoint, the acknowledged one first."""
        assert self.task is not None
        candidates: list[Path] = []
        if self.resume_path:
            candidates.append(Path(self.resume_path))
        candidates += [p for p in _checkpoints.checkpoint_files(self.checkpoint_dir) if p not in candidates]
        if not candidates:
            return
        errors = []
        for path in candidates:
            try:
                blob = _checkpoints.load(path)
                state = blob["state"]
            except FileNotFoundError:
                continue
            except _TASK_ERRORS as exc:  # a torn or corrupt file: try the one before it
                errors.append(f"{path.name}: {type(exc).__name__}: {exc}")
                log.warning("[task=%s] cannot read %s: %s", self.task_id, path, exc)
                continue
            # A whole file that the task's load_state_dict() refuses is the task's bug (a stranger's KeyError
            # read "no checkpoint is readable", with no frame of its code, and fell back to an older file):
            # its own failure, with its traceback, and no older checkpoint is tried on a half-loaded task.
            try:
                self.task.load_state_dict(state)
            except _TASK_ERRORS as exc:
                raise _TaskError(_failure_kind(exc), f"load_state_dict() of {path.name}", exc) from exc
            self.steps = int(blob.get("steps", 0))
            self.checkpointed_steps = self.steps
            log.info("[task=%s] resumed from %s at step %d", self.task_id, path.name, self.steps)
            return
        if errors:
            raise _TaskError(
                "CHECKPOINT", RESTORING,
                RuntimeError("no checkpoint is readable: " + "; ".join(errors) + ". The task cannot resume: put a "
                             f"good checkpoint back in {self.checkpoint_dir}, or cancel it and submit it again to "
                             "start over"))

    def _maybe_checkpoint(self, deadline: int, margin: int) -> None:
        now = time.monotonic_ns()
        if now - self.last_checkpoint_ns < self.checkpoint_interval_ns or self.steps == self.checkpointed_steps:
            return
        est = self.checkpoint_estimator.estimate_ns()
        if est is not None and now + est + margin > deadline:
            if now - self.last_checkpoint_ns < CHECKPOINT_OVERDUE_INTERVALS * self.checkpoint_interval_ns:
                return
            self.checkpoint_estimator = StepEstimator(window=8, quantile=1.0)  # re-learn it from this write
        if self._checkpoint():
            self.checkpoint_estimator.add(time.monotonic_ns() - now)

    def _checkpoint(self) -> bool:
        """Write a checkpoint of the current step; False if the disk refused it (reported, retried later).
        The board says so meanwhile: a hang here is the checkpoint's, not a step's. A task that keeps no state
        (``SideTask.checkpoints`` false: a command) writes none: its empty checkpoint said "resumed from
        ckpt-310.pt" of a program that starts again from its beginning."""
        if self.task is not None and not type(self.task).checkpoints:
            self.checkpointed_steps = self.steps  # nothing to write, and nothing to write later
            self.last_checkpoint_ns = time.monotonic_ns()
            return True
        board = self._board
        if board is None:
            return self._write_checkpoint()
        board.publish_doing(DOING_CHECKPOINT)
        try:
            return self._write_checkpoint()
        finally:
            board.publish_doing(DOING_STEP)  # until the next checkpoint: its steps need no store of their own

    def _write_checkpoint(self) -> bool:
        assert self.task is not None
        self.watch.started = (time.monotonic_ns(), self.thaws.stood_still_ns(), 0, CHECKPOINT)
        try:
            return self._write_checkpoint_now()
        finally:
            self.watch.started = None

    def _write_checkpoint_now(self) -> bool:
        assert self.task is not None
        try:
            state = self.task.state_dict()
        except _TASK_ERRORS as exc:
            raise _TaskError("EXCEPTION", "state_dict()", exc) from exc
        try:
            path = _checkpoints.write(self.checkpoint_dir, self.task_id, self.steps, state)
        except _checkpoints.DiskRefused as exc:
            # The disk, not the task: full, read-only or failing. The previous checkpoint stands;
            # try again an interval from now rather than at every grant.
            self.last_checkpoint_ns = time.monotonic_ns()
            log.warning("[task=%s] checkpoint at step %d not written: %s", self.task_id, self.steps, exc)
            self.chan.send(CheckpointFailed(step=self.steps, error=str(exc)))
            return False
        except _TASK_ERRORS as exc:  # the state does not serialise (a lambda, a lock, an open file)
            raise _TaskError("CHECKPOINT", f"saving the checkpoint of step {self.steps}", exc) from exc
        self.last_checkpoint_ns = time.monotonic_ns()
        self.checkpointed_steps = self.steps
        self.chan.send(Checkpointed(step=self.steps, path=str(path), progress=self._progress()))
        return True

    def _stop(self, checkpoint: bool) -> None:
        if checkpoint and self.setup_done and self.steps != self.checkpointed_steps:
            self._checkpoint()
        self._close_task()

    def _close_task(self) -> None:
        if self.task is not None:
            try:
                self.task.close()
            except _TASK_ERRORS:
                log.exception("[task=%s] close() raised", self.task_id)

    def _report_failure(self, err: _TaskError) -> None:
        """Say why the task failed, with the work of the grant it failed in (no ``parked`` follows)."""
        log.error("[task=%s] %s\n%s", self.task_id, err, err.tb)
        progress = float(self.steps)
        if self.task is not None and self.setup_done:
            with contextlib.suppress(Exception):  # a broken task's progress() is no reason to lose the record
                progress = self._progress()
        steps = self._grant_steps
        try:
            self.chan.send(Failed(
                kind=err.kind,
                message=str(err)[:2000],
                traceback=err.tb[-8000:],
                # No step of its own: a restore fails before the first step (it read "at step: 0" of a task
                # whose progress was 1985).
                step=-1 if err.phase == RESTORING else self.steps,
                total_steps=self.steps,
                progress=progress,
                durations_ns=tuple(steps.durations) if steps is not None else (),
                worked_ns=steps.worked_ns if steps is not None else 0,
            ))
        except ChannelClosed:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freeride._worker")
    parser.add_argument("--fd", type=int, required=True, help="the channel socket inherited from the manager")
    parser.add_argument("--parent-pid", type=int, default=0)
    ns = parser.parse_args(argv)
    _die_with_parent(ns.parent_pid)
    kill_group_when_gone()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    channel = Channel(socket.socket(fileno=ns.fd), accepts=MANAGER_MESSAGES)
    try:
        init = channel.recv()
    except ChannelClosed:
        return 0
    except ProtocolError as exc:
        log.error("expected an init message: %s", exc)
        return EXIT_SETUP_FAILED
    if not isinstance(init, Init):
        log.error("expected an init message, got %r", init)
        return EXIT_SETUP_FAILED
    code = WorkerRuntime(channel, init).run()
    # Say goodbye so the manager reads the coming end-of-file as an exit, not as a worker that
    # dropped its channel; then skip interpreter teardown (torch's can take a second at nice 19).
    with contextlib.suppress(ChannelClosed):
        channel.send(Bye(code=code))
    with contextlib.suppress(OSError):  # a full disk under worker.log must not change the exit code
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
