"""Fault injection against a real manager daemon on cpu:0: what each fault costs, in figures.

Every case starts a fresh ``freeride manager`` process with its own state directory, a healthy
*witness* task (a 1 ms counter that checkpoints every 0.2 s) and a trainer stand-in that reports
bubbles through a real :class:`~freeride.training.reporter.BubbleReporter` (100 ms bubbles, 10 ms gaps),
injects one fault, and records:

* ``survived``: the manager answers health (SERVING) and List after the fault;
* witness steps when the fault was detected and after 20 more bubbles (progress must go on);
* fault -> record (ms): from the fault (the faulty task writes the wall-clock time just before it
  misbehaves, ``tests/sample_tasks.py``) to the failure record's time, or the case's own
  equivalent, stated in its note;
* the slowest single reporter call during the case (us): the trainer's cost of the fault;
* tasks lost (submitted but missing from List) and acknowledged checkpoints lost (a task whose
  recorded checkpoint step went backwards).

Run: ``python -m bench.bench_faults [--out bench/results/cpu]``. The state-directory-full and
read-only cases mount a small tmpfs and are skipped where that is not allowed (not root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from freeride._wire.client import BubbleStream, ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import FreerideError, ManagerUnavailable
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart, TaskInfo, TaskSpec
from freeride.training.reporter import BubbleReporter

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = REPO / "tests"  # the misbehaving tasks of the end-to-end tests
MS = 1_000_000
BUBBLE_MS = 100.0
GAP_MS = 10.0
AFTER_BUBBLES = 20


# ====================================================================== harness


def health(endpoint: Endpoint) -> str:
    try:
        return health_status(endpoint, timeout_s=1)
    except ManagerUnavailable:
        return "DOWN"


def wait(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class Daemon:
    """One ``freeride manager`` process on cpu:0."""

    def __init__(self, state: Path, *options: str) -> None:
        self.state = state
        self.options = options
        self.sock = Path(f"/tmp/fr-bench-faults-{os.getpid()}.sock")
        self.endpoint = Endpoint("unix", str(self.sock))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and wait until SERVING; return how long that took (s)."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freeride.cli", "manager", "--device", "cpu:0", "--endpoint", f"unix:{self.sock}",
             "--state-dir", str(self.state), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        proc = self.proc
        wait(lambda: proc.poll() is not None or health(self.endpoint) == "SERVING", 60, "the manager to serve")
        if proc.poll() is not None:
            raise RuntimeError(f"the manager exited with {proc.returncode}")
        return time.monotonic() - started

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Trainer:
    """A training loop that reports its bubbles through a real reporter and times every call."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.reporter = BubbleReporter("cpu:0", 0, 0, endpoint=endpoint, backoff_initial_s=0.02, backoff_max_s=0.2)
        self.iteration = 0
        self.worst_ns = 0
        self.open_iteration = -1

    def _timed(self, call: Callable[[], None]) -> None:
        t0 = time.perf_counter_ns()
        call()
        self.worst_ns = max(self.worst_ns, time.perf_counter_ns() - t0)

    def start(self, predicted_ms: float) -> int:
        it = self.iteration
        self.iteration += 1
        self._timed(lambda: self.reporter.bubble_start(it, 0, "bench", int(predicted_ms * MS), 8 * 2**30))
        self.open_iteration = it
        return it

    def end(self) -> None:
        it = self.open_iteration
        self._timed(lambda: self.reporter.bubble_end(it, 0))

    def bubbles(self, count: int) -> None:
        for _ in range(count):
            self.start(BUBBLE_MS)
            time.sleep(BUBBLE_MS / 1000)
            self.end()
            time.sleep(GAP_MS / 1000)

    def until(self, predicate: Callable[[], object], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s of bubbles waiting for {what}")
            self.bubbles(1)

    def close(self) -> None:
        self.reporter.close()


@dataclass
class Result:
    case: str
    category: str
    injected: str
    survived: bool = False
    outcome: str = ""
    witness_at_fault: int = 0
    witness_after: int = 0
    fault_to_record_ms: float | None = None
    max_enqueue_us: float = 0.0
    tasks_lost: int = 0
    checkpoints_lost: int = 0
    note: str = ""
    error: str = ""


@dataclass
class Case:
    """The running pieces of one case: a daemon, a trainer, a client, the tasks submitted."""

    daemon: Daemon
    trainer: Trainer
    client: ControlClient
    submitted: list[str] = field(default_factory=list)
    acknowledged: dict[str, int] = field(default_factory=dict)

    def submit(self, target: str, **kw: Any) -> TaskInfo:
        spec = TaskSpec(target=target, working_dir=str(TASKS_DIR), memory_bytes=kw.pop("memory_bytes", 2**28), **kw)
        info = self.client.submit(spec)
        self.submitted.append(info.task_id)
        return info

    def witness(self) -> TaskInfo:
        return self.submit("sample_tasks:Counter", args={"step_ms": 1.0}, name="witness", checkpoint_interval_s=0.2)

    def steps(self, task_id: str) -> int:
        return self.client.get(task_id).steps

    def note_checkpoints(self) -> None:
        for info in self.client.list():
            self.acknowledged[info.task_id] = max(self.acknowledged.get(info.task_id, -1), info.checkpoint_step)

    def reconnect(self) -> None:
        self.client.close()
        self.client = ControlClient(self.daemon.endpoint)

    def close_out(self, result: Result) -> None:
        """Fill the figures every case shares: survival, lost tasks and checkpoints, enqueue cost."""
        try:
            listed = {t.task_id: t for t in self.client.list()}
            result.survived = health(self.daemon.endpoint) == "SERVING"
        except FreerideError:
            listed, result.survived = {}, False
        result.tasks_lost = len([t for t in self.submitted if t not in listed])
        result.checkpoints_lost = len([t for t, step in self.acknowledged.items()
                                       if t in listed and listed[t].checkpoint_step < step])
        result.max_enqueue_us = round(self.trainer.worst_ns / 1000, 1)


@contextlib.contextmanager
def case(tmp: Path, name: str, *options: str) -> Iterator[Case]:
    daemon = Daemon(tmp / name / "state", *options)
    daemon.start()
    trainer = Trainer(daemon.endpoint)
    client = ControlClient(daemon.endpoint)
    running = Case(daemon, trainer, client)
    try:
        yield running
    finally:
        running.client.close()
        trainer.close()
        daemon.stop()


def fault_at(c: Case, task_id: str) -> float:
    path = c.daemon.state / "tasks" / task_id / "work" / "fault_at"
    return float(path.read_text()) if path.exists() else 0.0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ====================================================================== side-task faults


@dataclass(frozen=True)
class TaskFault:
    name: str
    target: str
    injected: str
    args: dict[str, Any] = field(default_factory=dict)
    survives: bool = False
    memory_mib: int = 512
    options: tuple[str, ...] = ()
    spec: dict[str, Any] = field(default_factory=dict)


TASK_FAULTS = [
    TaskFault("segfault", "sample_tasks:Segfaulter", "SIGSEGV in step 2"),
    TaskFault("raises in setup", "sample_tasks:SetupCrasher", "RuntimeError in setup()"),
    TaskFault("raises in step", "sample_tasks:Crasher", "ValueError in step 5", {"crash_at": 5}),
    TaskFault("busy loop ignoring deadlines", "sample_tasks:Hanger", "step 2 never returns", {"hang_at": 2},
              options=("--step-timeout-s", "1")),
    TaskFault("allocates past its cap", "sample_tasks:MemoryHog", "256 MiB in one step, cap 200 MiB",
              {"mib_per_step": 256}, memory_mib=200),
    TaskFault("closes its channel", "sample_tasks:ChannelCloser", "closes fds 3-255 in step 1, keeps running"),
    TaskFault("unserialisable checkpoint", "sample_tasks:UnpicklableState", "state_dict() holds a lock",
              spec={"checkpoint_interval_s": 0.05}),
    TaskFault("crashes with a child running", "sample_tasks:SpawnThenCrash", "child in setup, raises in step 5",
              {"crash_at": 5}),
    TaskFault("spawns a child", "sample_tasks:Spawner", "child process sleeping beside the task", survives=True),
]


def run_task_fault(tmp: Path, fault: TaskFault) -> Result:
    result = Result(fault.name, "side task", fault.injected)
    with case(tmp, fault.name.replace(" ", "-"), *fault.options) as c:
        faulty = c.submit(fault.target, args=fault.args, name="faulty", memory_bytes=fault.memory_mib * 2**20,
                          **fault.spec)
        witness = c.witness()

        def happened() -> bool:
            info = c.client.get(faulty.task_id)
            return info.steps >= 5 if fault.survives else info.state == "FAILED"

        c.trainer.until(lambda: happened() and c.steps(witness.task_id) > 0, 120, f"{fault.name} to happen")
        c.note_checkpoints()
        info = c.client.get(faulty.task_id)
        result.witness_at_fault = c.steps(witness.task_id)
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        child_file = c.daemon.state / "tasks" / faulty.task_id / "work" / "child.pid"
        child = int(child_file.read_text()) if child_file.exists() else 0
        if fault.survives:
            result.outcome = f"kept running ({c.steps(faulty.task_id)} steps)"
            if child:
                c.client.cancel(faulty.task_id)
                wait(lambda: not alive(child), 10, "the child to die with its cancelled task")
                result.note = "child alive while the task ran; killed with it on cancel"
        else:
            failure = info.failure
            assert failure is not None
            result.outcome = f"FAILED {failure.kind}: {failure.message[:70]}"
            marked = fault_at(c, faulty.task_id)
            if marked:
                result.fault_to_record_ms = round((failure.at_unix_s - marked) * 1000, 1)
            if child:
                wait(lambda: not alive(child), 10, "the child to die with its task")
                result.note = "its child was killed with it"
            if fault.name == "busy loop ignoring deadlines":
                result.note = "frozen at each bubble end; failed after 1 s of granted time (--step-timeout-s 1)"
        c.close_out(result)
    return result


# ====================================================================== trainer faults


def run_trainer_disconnect(tmp: Path) -> Result:
    result = Result("trainer disconnects mid-bubble", "trainer", "bubble start, then the trainer exits (no end)")
    with case(tmp, "disconnect") as c:
        witness = c.witness()
        c.trainer.until(lambda: c.steps(witness.task_id) > 0, 60, "the witness to step")
        c.note_checkpoints()
        result.witness_at_fault = c.steps(witness.task_id)
        dying = BubbleReporter("cpu:0", 0, 0, endpoint=c.daemon.endpoint)
        wait(lambda: dying.counters().connected, 10, "the second trainer to connect")
        predicted_ms = 300.0
        start_mono = time.monotonic_ns()
        dying.bubble_start(0, 0, "bench", int(predicted_ms * MS), 8 * 2**30)
        wait(lambda: c.client.get(witness.task_id).state == "RUNNING", 10, "the witness to run in the bubble")
        dying.close()  # the trainer exits: the stream ends, the bubble's end never comes
        wait(lambda: c.client.get(witness.task_id).state in ("PARKED", "FROZEN"), 10, "the witness to stop")
        stopped = time.monotonic_ns()
        state = c.client.get(witness.task_id).state
        result.fault_to_record_ms = round((stopped - (start_mono + int(predicted_ms * MS))) / MS, 1)
        result.outcome = f"witness {state} by the predicted end"
        result.note = ("fault -> record: predicted end -> witness seen stopped (polled every 10 ms; negative: it "
                       "parked itself before the predicted end, as its deadline says)")
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        c.close_out(result)
    return result


def run_out_of_order(tmp: Path) -> Result:
    result = Result("events out of order", "trainer", "end before start; old iterations after new ones")
    with case(tmp, "out-of-order") as c:
        witness = c.witness()
        c.trainer.until(lambda: c.steps(witness.task_id) > 0, 60, "the witness to step")
        c.note_checkpoints()
        result.witness_at_fault = c.steps(witness.task_id)
        # The reporter's own events first: two streams are not ordered with each other.
        wait(lambda: c.client.stats().events_received >= c.trainer.reporter.sent, 10, "the reporter's events")
        before = c.client.stats()

        def events() -> Iterator[BubbleEvent]:
            now = time.monotonic_ns()
            yield BubbleEnd(0, 0, 100, 0, now)  # an end before its start
            yield BubbleStart(0, 0, 100, 0, "stale", now - 900 * MS, 20 * MS, -1)  # long over: no grant
            yield BubbleEnd(0, 0, 100, 0, now - 880 * MS)
            yield BubbleStart(0, 0, 101, 0, "open", now, 200 * MS, -1)
            yield BubbleStart(0, 0, 99, 0, "stale", now - 500 * MS, 20 * MS, -1)  # older than the open one
            yield BubbleEnd(0, 0, 99, 0, now - 490 * MS)
            time.sleep(0.2)
            yield BubbleEnd(0, 0, 101, 0, time.monotonic_ns())

        accepted, rejected = BubbleStream(c.daemon.endpoint, events()).result(30)
        after = c.client.stats()
        ignored = after.events_rejected - before.events_rejected
        result.outcome = f"{accepted} accepted on the wire; {ignored} ignored by the scheduler and counted as rejected"
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        c.close_out(result)
    return result


# ====================================================================== manager faults


def run_manager_stopped(tmp: Path) -> Result:
    result = Result("manager SIGSTOPped 2 s", "manager", "SIGSTOP for 2 s while the trainer reports")
    with case(tmp, "sigstop") as c:
        witness = c.witness()
        c.trainer.until(lambda: c.steps(witness.task_id) > 0, 60, "the witness to step")
        c.note_checkpoints()
        result.witness_at_fault = c.steps(witness.task_id)
        c.trainer.worst_ns = 0
        c.daemon.signal(signal.SIGSTOP)
        c.trainer.bubbles(int(2000 / (BUBBLE_MS + GAP_MS)))
        c.daemon.signal(signal.SIGCONT)
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        counters = c.trainer.reporter.counters()
        result.outcome = f"reporter: {counters.sent} sent, {counters.dropped} dropped; training never waited"
        c.close_out(result)
    return result


def run_manager_killed(tmp: Path) -> Result:
    result = Result("manager SIGKILLed mid-bubble", "manager", "kill -9 while the witness is RUNNING; restart")
    with case(tmp, "sigkill") as c:
        spawner = c.submit("sample_tasks:Spawner", name="spawner")
        child_file = c.daemon.state / "tasks" / spawner.task_id / "work" / "child.pid"
        c.trainer.until(child_file.exists, 60, "the spawner's child")
        child = int(child_file.read_text())
        witness = c.submit("sample_tasks:Counter", args={"step_ms": 1.0}, name="witness", checkpoint_interval_s=0.05,
                           priority=1)
        c.trainer.until(lambda: c.client.get(witness.task_id).checkpoint_step >= 30, 60, "checkpoints")
        c.trainer.start(5000.0)  # a long bubble, left open
        wait(lambda: c.client.get(witness.task_id).state == "RUNNING", 10, "the witness to run")
        c.note_checkpoints()
        result.witness_at_fault = c.steps(witness.task_id)
        acknowledged = c.acknowledged[witness.task_id]
        killed_at = time.monotonic()
        c.daemon.signal(signal.SIGKILL)
        assert c.daemon.proc is not None
        c.daemon.proc.wait(10)
        c.trainer.end()
        c.daemon.start()
        c.reconnect()
        wait(lambda: len(c.client.list()) == len(c.submitted), 30, "every task to be listed")
        result.fault_to_record_ms = round((time.monotonic() - killed_at) * 1000, 1)
        wait(lambda: not alive(child), 10, "the orphaned child to be killed")
        c.trainer.until(lambda: c.client.get(witness.task_id).progress > acknowledged, 60, "the witness to resume")
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        resumed = c.client.get(witness.task_id)
        result.outcome = (f"restarted; witness resumed from checkpoint {acknowledged} "
                          f"(progress {resumed.progress:.0f}); orphaned child killed")
        result.note = "fault -> record: kill -> new manager SERVING with every task listed"
        c.close_out(result)
    return result


def run_drain(tmp: Path) -> Result:
    result = Result("SIGTERM with a task hung mid-step", "manager", "SIGTERM; --stop-timeout-s 1")
    with case(tmp, "drain", "--stop-timeout-s", "1") as c:
        witness = c.witness()
        c.trainer.until(lambda: c.steps(witness.task_id) >= 10, 60, "the witness to step")
        hanger = c.submit("sample_tasks:Hanger", args={"hang_at": 3}, name="hanger")
        c.trainer.until(lambda: c.client.get(hanger.task_id).state == "FROZEN", 60, "the hanger to hang")
        c.trainer.start(5000.0)
        wait(lambda: c.client.get(hanger.task_id).state == "RUNNING", 10, "the hanger to run")
        result.witness_at_fault = c.steps(witness.task_id)
        c.note_checkpoints()
        statuses: list[str] = []
        proc = c.daemon.proc
        assert proc is not None

        def watch() -> None:
            while proc.poll() is None:
                statuses.append(health(c.daemon.endpoint))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        term_at = time.monotonic()
        c.daemon.signal(signal.SIGTERM)
        watcher.start()
        code = proc.wait(60)
        result.fault_to_record_ms = round((time.monotonic() - term_at) * 1000, 1)
        watcher.join()
        c.trainer.end()
        c.daemon.start()
        c.reconnect()
        listed = {t.task_id: t for t in c.client.list()}
        c.acknowledged[witness.task_id] = max(c.acknowledged[witness.task_id], result.witness_at_fault)
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        result.outcome = (f"exit {code}; health NOT_SERVING while draining: {'NOT_SERVING' in statuses}; "
                          f"witness checkpointed at {listed[witness.task_id].checkpoint_step}, hanger killed, "
                          f"back {listed[hanger.task_id].state}")
        result.note = ("fault -> record: SIGTERM -> manager exited (the hung task is killed at the stop timeout). "
                       "After the restart the hung task comes back, hangs again and, frozen, is granted first at "
                       "every bubble until its step timeout (60 s): the witness waits meanwhile")
        c.close_out(result)
    return result


# ====================================================================== checkpoints and the state directory


def run_corrupt_checkpoint(tmp: Path) -> Result:
    result = Result("checkpoint corrupted on disk", "checkpoint", "newest checkpoint overwritten between runs")
    with case(tmp, "corrupt") as c:
        witness = c.witness()
        c.trainer.until(lambda: c.client.get(witness.task_id).checkpoint_step >= 0 and len(
            list((c.daemon.state / "tasks" / witness.task_id / "checkpoints").glob("ckpt-*.pt"))) >= 2,
            60, "two checkpoints")
        c.daemon.signal(signal.SIGTERM)
        assert c.daemon.proc is not None
        c.daemon.proc.wait(30)
        files = sorted((c.daemon.state / "tasks" / witness.task_id / "checkpoints").glob("ckpt-*.pt"),
                       key=lambda p: int(p.stem.split("-")[1]))
        older = int(files[0].stem.split("-")[1])
        files[-1].write_bytes(b"\x00garbage")
        c.daemon.start()
        c.reconnect()
        result.witness_at_fault = c.steps(witness.task_id)
        log = c.daemon.state / "tasks" / witness.task_id / "worker.log"
        c.trainer.until(lambda: "resumed from" in log.read_text(), 60, "the witness to resume")
        c.trainer.bubbles(AFTER_BUBBLES)
        result.witness_after = c.steps(witness.task_id)
        result.outcome = f"resumed from the previous checkpoint (step {older}) after {files[-1].name} failed to load"
        result.note = "the destroyed file is the fault itself; no acknowledged checkpoint was lost by freeride"
        c.close_out(result)
    return result


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[bool]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    try:
        yield mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def run_state_dir_full(tmp: Path) -> Result:
    result = Result("state directory full", "state directory", "tmpfs of 16 MiB filled up, then freed")
    with tmpfs(tmp / "full-mnt", "size=16m") as ok:
        if not ok:
            result.error = "skipped: cannot mount a tmpfs (needs root)"
            return result
        with case(tmp / "full-mnt", "full") as c:
            witness = c.submit("sample_tasks:Counter", args={"step_ms": 1.0, "log_steps": False}, name="witness",
                               checkpoint_interval_s=0.05)
            c.trainer.until(lambda: c.client.get(witness.task_id).checkpoint_step >= 10, 60, "checkpoints")
            filler = tmp / "full-mnt" / "filler"
            with open(filler, "wb") as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\xff" * 65536)
                    fh.flush()
            c.note_checkpoints()
            result.witness_at_fault = c.steps(witness.task_id)
            try:
                c.submit("sample_tasks:Counter", name="refused")
                refused = "accepted (!)"
            except FreerideError as exc:
                refused = "refused (" + str(exc).split("not writable: ", 1)[-1].split(";")[0] + ")"
            c.trainer.bubbles(AFTER_BUBBLES)
            result.witness_after = c.steps(witness.task_id)
            ck_full = c.client.get(witness.task_id).checkpoint_step
            freed_at = time.monotonic()
            filler.unlink()
            c.trainer.until(lambda: c.client.get(witness.task_id).checkpoint_step > ck_full, 60, "a new checkpoint")
            result.fault_to_record_ms = round((time.monotonic() - freed_at) * 1000, 1)
            c.submit("sample_tasks:Counter", name="accepted", priority=-1)
            c.note_checkpoints()
            c.daemon.signal(signal.SIGKILL)
            assert c.daemon.proc is not None
            c.daemon.proc.wait(10)
            c.daemon.start()
            c.reconnect()
            result.outcome = f"training served; Submit {refused}; checkpoints retried"
            result.note = ("fault -> record: space back -> next checkpoint recorded; tasks/checkpoints "
                           "counted after a kill -9 and restart")
            c.close_out(result)
    return result


def run_state_dir_read_only(tmp: Path) -> Result:
    result = Result("state directory read-only", "state directory", "manager started on a read-only mount")
    with tmpfs(tmp / "ro-mnt", "ro,size=1m") as ok:
        if not ok:
            result.error = "skipped: cannot mount a tmpfs (needs root)"
            return result
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "freeride.cli", "manager", "--device", "cpu:0", "--endpoint",
             f"unix:/tmp/fr-bench-ro-{os.getpid()}.sock", "--state-dir", str(tmp / "ro-mnt" / "state")],
            capture_output=True, text=True, timeout=60)
        result.fault_to_record_ms = round((time.monotonic() - started) * 1000, 1)
        result.survived = proc.returncode == 2
        message = proc.stderr.strip().removeprefix("freeride: error: ").replace(str(tmp / "ro-mnt"), "<ro>")
        result.outcome = f"exit {proc.returncode}: {message}"
        result.note = "refusing to start is the intended outcome; fault -> record: start -> exit"
    return result


# ====================================================================== report


CASES: list[tuple[str, Callable[[Path], Result]]] = [
    *((f.name, lambda tmp, f=f: run_task_fault(tmp, f)) for f in TASK_FAULTS),
    ("trainer disconnects mid-bubble", run_trainer_disconnect),
    ("events out of order", run_out_of_order),
    ("manager SIGSTOPped", run_manager_stopped),
    ("manager SIGKILLed mid-bubble", run_manager_killed),
    ("SIGTERM drain", run_drain),
    ("checkpoint corrupted on disk", run_corrupt_checkpoint),
    ("state directory full", run_state_dir_full),
    ("state directory read-only", run_state_dir_read_only),
]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(results: list[Result], machine: dict[str, Any], command: str) -> str:
    ran = [r for r in results if not r.error]
    survived = sum(r.survived for r in ran)
    lines = [
        "# Fault injection (one manager daemon on cpu:0, real worker processes, real reporter)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, "
        f"grpcio {machine['versions']['grpcio']}. Command: `{command}`. The machine was shared with other "
        "work (other agents' builds and tests) while measuring: times are indicative, not tuned figures.",
        "",
        f"**{len(ran)} faults injected, {survived} survived** (manager still serving, or refusing to start "
        f"where that is the intended outcome); **tasks lost: {sum(r.tasks_lost for r in ran)}, acknowledged "
        f"checkpoints lost: {sum(r.checkpoints_lost for r in ran)}**.",
        "",
        "Each case: a fresh manager, a witness task (1 ms steps, checkpoint every 0.2 s), 100 ms bubbles "
        "reported through a real `BubbleReporter`. Witness steps: when the fault was detected -> after "
        f"{AFTER_BUBBLES} more bubbles. Max enqueue: the slowest single `bubble_start`/`bubble_end` call of the case.",
        "",
        "| fault | kind | injected | survived | outcome | witness steps | fault -> record (ms) | max enqueue (us) "
        "| tasks lost | ckpts lost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.case} | {r.category} | {r.injected} | - | {r.error} | - | - | - | - | - |")
            continue
        outcome = r.outcome.replace("|", "/")
        lines.append(
            f"| {r.case} | {r.category} | {r.injected} | {'yes' if r.survived else 'NO'} | {outcome} "
            f"| {r.witness_at_fault} -> {r.witness_after} | {_ms(r.fault_to_record_ms)} | {r.max_enqueue_us:.0f} "
            f"| {r.tasks_lost} | {r.checkpoints_lost} |"
        )
    notes = [f"- {r.case}: {r.note}" for r in results if r.note]
    if notes:
        lines += ["", "Notes:", *notes]
    lines += [
        "",
        "Fault -> record for side-task faults: the task writes the wall-clock time just before it misbehaves; "
        "the record's time is stamped by the manager when it decides the failure. It includes the worker's "
        "exit, the channel and pidfd wake-ups and, for memory, the allocation itself and the 50 ms watchdog "
        "poll. Max enqueue is wall time of one call in the bench process, preemption on the shared cores "
        "included; a call never waits on the manager (the SIGSTOP and SIGKILL cases).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    ns = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    tmp = Path(tempfile.mkdtemp(prefix="fr-bench-faults-"))
    results: list[Result] = []
    for name, run in CASES:
        if ns.only and ns.only not in name:
            continue
        print(f"-- {name}", flush=True)
        try:
            result = run(tmp)
        except Exception as exc:  # a case that cannot complete is a finding: record it, go on
            result = Result(name, "?", "?", error=f"ERROR {type(exc).__name__}: {exc}")
        results.append(result)
        print(f"   {asdict(result)}", flush=True)
    machine = machine_info()
    command = " ".join(["python -m bench.bench_faults", *sys.argv[1:]])
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "faults.json").write_text(json.dumps(
        {"machine": machine, "command": command, "shared_machine": True, "bubble_ms": BUBBLE_MS,
         "gap_ms": GAP_MS, "after_bubbles": AFTER_BUBBLES, "results": [asdict(r) for r in results]},
        indent=2) + "\n")
    table = markdown(results, machine, command)
    (ns.out / "faults.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
