"""Fault injection, end to end: each fault beside a healthy witness task, on a real manager.

For every fault a side task, a trainer or the state directory can commit, the manager must keep
serving, the witness must keep making progress, the reporter must never block, nothing submitted
or checkpointed may be lost, and the user must get a clear failure record. Timings are never
asserted; ``bench/bench_faults.py`` measures them.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import MS, BubbleFeeder, ManagerHarness, cpu_devices, holds_for, read_steps, wait_for
from daemons import alive, health, socket_path, start_daemon

from freeride._manager.core import CoreConfig
from freeride._manager.daemon import Manager
from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint
from freeride.errors import RequestRejected
from freeride.messages import BubbleEnd, BubbleStart, TaskInfo, TaskSpec
from freeride.training.reporter import BubbleReporter

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

pytestmark = pytest.mark.e2e

TESTS_DIR = Path(__file__).resolve().parents[1]
#: Bubbles for phases that need a task to make progress. On a loaded machine a worker (nice 19) can
#: measure a 1 ms step at tens of ms, and a step that fits no bubble waits for a re-probe.
LONG_MS = 100.0


def work_dir(h: ManagerHarness, task_id: str) -> Path:
    return h.manager.loop.task_dir(task_id) / "work"


# ====================================================================== side-task faults


@dataclass(frozen=True)
class Fault:
    """One way a side task misbehaves, and what the user must see afterwards."""

    name: str
    target: str
    args: dict[str, Any] = field(default_factory=dict)
    kind: str = ""  # the failure kind; "" for a fault the task survives
    says: str = ""  # text the failure's message or traceback must contain
    memory_mib: int = 512
    core: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    step: int | None = None  # the step its failure record must name, where the fault fixes it
    #: What its failure's log tail must hold (where it hung: the worker's stack report, its function's name).
    tail: tuple[str, ...] = ()


FAULTS = [
    Fault("segfault", "sample_tasks:Segfaulter", kind="SIGNAL", says="SIGSEGV", step=2),
    Fault("raises-in-setup", "sample_tasks:SetupCrasher", kind="EXCEPTION", says="cannot set up"),
    Fault("raises-in-step", "sample_tasks:Crasher", {"crash_at": 5}, kind="EXCEPTION", says="boom at step 5",
          step=5),
    Fault("busy-loop-ignoring-deadlines", "sample_tasks:Hanger", {"hang_at": 2}, kind="STEP_TIMEOUT",
          says="without finishing", core={"step_timeout_ns": 400 * MS}, step=2,
          tail=("a step (after 2 steps) has run", "where its threads are", "sample_tasks.py", ", in step")),
    # Stranger trial: a hang in state_dict() was failed as a hang in setup() (its first checkpoint came before any
    # step) or in a step.
    # (A failure decided at a freeze names what the board said at the freeze before: a longer timeout leaves
    # several freezes inside the hang even where a loaded machine starves the worker at first.)
    Fault("hangs-in-its-checkpoint", "sample_tasks:CheckpointHanger", kind="STEP_TIMEOUT",
          says="a checkpoint (state_dict() and its write)", core={"step_timeout_ns": 1500 * MS},
          spec={"checkpoint_interval_s": 0.05},
          tail=("a checkpoint (state_dict() and its write) has run", "where its threads are", ", in state_dict")),
    Fault("allocates-past-its-cap", "sample_tasks:MemoryHog", {"mib_per_step": 256}, kind="MEMORY_LIMIT",
          says="over its cap of 200", memory_mib=200),
    # Issue 13: a task killed over its cap in its third step was said to have died in step 0.
    Fault("allocates-past-its-cap-in-step-2", "sample_tasks:MemoryHog", {"mib_per_step": 256, "hold_at": 2},
          kind="MEMORY_LIMIT", says="over its cap of 200", memory_mib=200, step=2),
    Fault("closes-its-channel", "sample_tasks:ChannelCloser", kind="PROTOCOL", says="closed its channel", step=1),
    # Issue 22: a malformed worker message is a PROTOCOL failure of its task, never the loop's.
    *(Fault(f"sends-{name}", "sample_tasks:ChannelWriter", {"payload": payload}, kind="PROTOCOL", says=says, step=1)
      for name, payload, says in [
          ("garbage", "not json {", "malformed message"),
          # It took the loop down: the parser's RecursionError was not caught.
          ("nesting-past-the-parsers-depth", "[" * 20_000, "RecursionError"),
          ("a-wrong-type", '{"t":"checkpoint","step":"one","path":"x","progress":1.0}', "'step': expected an integer"),
          ("a-message-without-a-field", '{"t":"finished","progress":1.0}', "'total_steps' is missing"),
          ("an-unknown-message", '{"t":"reboot"}', "unknown message type 'reboot'"),
          ("a-managers-message", '{"t":"grant","g":1,"deadline_ns":1,"margin_ns":0}', "not one this peer may send"),
          # A stranger's NaN progress reached the store, which refused it and took the manager down.
          ("a-nan", '{"t":"finished","total_steps":1,"progress":NaN}', "NaN is not a number"),
      ]),
    Fault("reports-a-nan-progress", "sample_tasks:NaNProgress", kind="EXCEPTION",
          says="progress() returned nan: it must be a finite number"),
    Fault("unserialisable-checkpoint", "sample_tasks:UnpicklableState", kind="CHECKPOINT", says="cannot pickle",
          spec={"checkpoint_interval_s": 0.05}),
    Fault("crashes-with-a-child-running", "sample_tasks:SpawnThenCrash", {"crash_at": 5}, kind="EXCEPTION",
          says="crashed with a child running"),
    Fault("spawns-a-child", "sample_tasks:Spawner"),
]


def test_a_task_whose_own_thread_runs_while_parked_is_stopped_between_grants_and_still_runs_in_them(
    make_manager: Callable[..., ManagerHarness],
) -> None:
    # Stranger trial: a task whose setup() started a spinning thread was PARKED, "waiting for a bubble", while its
    # worker took 27% of the core beside the trainer (20 s of CPU against 0.99 s harvested), and nothing said so.
    from freeride._task_process import process_cpu_ns

    h = make_manager()
    task = h.submit("sample_tasks:ThreadSpinner", args={"step_ms": 1.0}, name="spinner")
    feeder = h.feeder()
    feeder.run_until(lambda: h.client.get(task.task_id).steps >= 3, length_ms=LONG_MS, gap_ms=10, timeout_s=60)
    pid = h.client.get(task.task_id).pid

    def parked_cpu_ms() -> float:  # the worker's CPU time over 0.5 s, parked with no bubble coming
        # A step the last bubble's end caught (any step, on a loaded machine) stays FROZEN until a grant thaws it:
        # bubbles come until the task parked at one's end (CI saw it FROZEN for the whole wait).
        feeder.run_until(lambda: h.client.get(task.task_id).state == "PARKED", length_ms=LONG_MS, gap_ms=10,
                         timeout_s=60)
        before = process_cpu_ns(pid) or 0
        time.sleep(0.5)  # a measurement window, not a synchronisation
        return ((process_cpu_ns(pid) or 0) - before) / 1e6

    # The manager reads parked workers' CPU every 0.5 s: within a few readings it is stopped while parked.
    wait_for(lambda: parked_cpu_ms() < 20, 30, what="the parked worker stopped")
    steps = h.client.get(task.task_id).steps
    feeder.run_until(lambda: h.client.get(task.task_id).steps > steps + 2, length_ms=LONG_MS, gap_ms=10,
                     timeout_s=60)  # granted, it runs: a grant continues it
    assert parked_cpu_ms() < 20  # and parked again, stopped again
    feeder.close()
    h.client.cancel(task.task_id)
    wait_for(lambda: h.client.get(task.task_id).state == "CANCELLED", 30, what="a stopped worker obeys a cancel")


def test_a_drain_after_training_lets_a_long_checkpoint_finish_however_much_cpu_it_takes_parked(
    make_manager: Callable[..., ManagerHarness],
) -> None:
    # Stranger trial: stopping a manager after training (the end of `launch`) killed a task of a 200 MiB state:
    # its drain checkpoint, written while parked, read as threads of its own running between steps, so its
    # worker was stopped "whenever it parks", mid-checkpoint, and killed at the stop timeout, its work since the
    # last checkpoint lost (4 times in 6).
    h = make_manager()
    task = h.submit("sample_tasks:BusyCheckpoint", args={"checkpoint_ms": 1500.0})
    feeder = h.feeder()
    feeder.run_until(lambda: h.client.get(task.task_id).steps >= 3 and h.client.get(task.task_id).state == "PARKED",
                     length_ms=LONG_MS, gap_ms=10, timeout_s=60)
    feeder.close()  # training is over
    steps = h.client.get(task.task_id).steps
    drained = h.client.drain(timeout_s=60)
    assert (drained.killed, drained.checkpointed) == (0, 1), drained
    info = h.client.get(task.task_id)
    assert info.figures.checkpoint_step >= steps


#: A task that goes on: parked, in a grant, or frozen mid-step by the last bubble's end until its next grant
#: (a step that overran, which a loaded machine makes of any step; CI saw the Spawner frozen there).
ALIVE = ("PARKED", "RUNNING", "FROZEN")


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_is_contained_and_a_witness_task_keeps_running(
    make_manager: Callable[..., ManagerHarness], fault: Fault
) -> None:
    h = make_manager(**fault.core)
    faulty = h.submit(fault.target, memory_mib=fault.memory_mib, args=fault.args, name="faulty", **fault.spec)
    witness = h.submit("sample_tasks:Counter", args={"step_ms": 1.0}, name="witness")
    feeder = h.feeder()

    def fault_happened() -> bool:
        info = h.client.get(faulty.task_id)
        if fault.kind:
            return info.state == "FAILED"
        return info.steps >= 5  # a survivable fault: the task goes on stepping

    feeder.run_until(lambda: fault_happened() and h.client.get(witness.task_id).steps > 0, length_ms=LONG_MS,
                     gap_ms=10, timeout_s=60)
    before = h.client.get(witness.task_id).steps
    feeder.run_until(lambda: h.client.get(witness.task_id).steps > before, length_ms=LONG_MS, gap_ms=10,
                     timeout_s=60)
    accepted, rejected = feeder.close()

    assert (accepted, rejected) == (2 * len(feeder.sent), 0)
    assert health(h.endpoint) == "SERVING"
    tasks = {t.task_id: t for t in h.client.list()}
    assert set(tasks) == {faulty.task_id, witness.task_id}, "a submitted task went missing"
    assert tasks[witness.task_id].failure is None
    assert tasks[witness.task_id].state in ALIVE
    info = tasks[faulty.task_id]
    if fault.kind:
        _assert_clear_failure(info, fault)
    else:
        assert info.state in ALIVE and info.failure is None
    child_pid_file = work_dir(h, faulty.task_id) / "child.pid"
    if child_pid_file.exists():
        child = int(child_pid_file.read_text())
        if not fault.kind:
            assert alive(child), "a task's child must live as long as the task"
            h.client.cancel(faulty.task_id)
        wait_for(lambda: not alive(child), 10)  # the child dies with the task, however it ends


def _assert_clear_failure(info: TaskInfo, fault: Fault) -> None:
    failure = info.failure
    assert info.state == "FAILED" and failure is not None
    assert failure.kind == fault.kind, failure
    assert fault.says in failure.message + failure.traceback, failure
    assert failure.at_unix_s > 0
    if fault.kind in ("SIGNAL", "EXCEPTION", "CHECKPOINT"):
        assert failure.step >= 0  # which step it died in
    if fault.step is not None:
        assert failure.step == fault.step, failure
    for part in fault.tail:
        assert part in failure.log_tail, (part, failure.log_tail)


# ====================================================================== trainer faults


@pytest.mark.parametrize("target,stopped", [
    ("sample_tasks:Counter", ("PARKED", "FROZEN")),  # parks itself at the deadline, or is frozen if late
    ("sample_tasks:Hanger", ("FROZEN",)),
])
def test_trainer_that_disconnects_mid_bubble_leaves_no_task_running_past_the_predicted_end(
    harness: ManagerHarness, target: str, stopped: tuple[str, ...]
) -> None:
    hanger = "Hanger" in target
    task = harness.submit(target, args={"hang_at": 2} if hanger else {})
    harness.wait_state(task.task_id, "PARKED")
    feeder = harness.feeder()
    start = time.monotonic_ns()
    # Each task must be seen stepping inside the bubble before the trainer dies, also on a loaded machine (at
    # nice 19, setup and two steps took more than 150 ms once, and a counter granted 150 ms ran no step): a
    # long bubble, and the Hanger's hang or the counter's first step seen first.
    predicted = 2000 * MS
    predicted_end = start + predicted
    feeder.send(BubbleStart(0, 0, 0, 0, "test", start, predicted, 8 * 2**30))
    if hanger:
        wait_for((work_dir(harness, task.task_id) / "fault_at").exists, 10, what="the Hanger to enter its hang")
    else:
        wait_for(lambda: read_steps(work_dir(harness, task.task_id)) != [], 10, what="a step in the bubble")
    feeder.stream.close()  # the trainer dies: this bubble's end never comes
    feeder.send(None)  # type: ignore[arg-type]  # releases the stream's request iterator

    harness.wait_state(task.task_id, *stopped, timeout_s=30)
    if "PARKED" in stopped:
        steps = read_steps(work_dir(harness, task.task_id))
        assert steps and all(step_start <= predicted_end for step_start, _ in steps)
        holds_for(lambda: len(read_steps(work_dir(harness, task.task_id))) == len(steps), 0.2,
                  "no step starts after the predicted end of a bubble whose end never came")
        # A trainer that comes back is served as before.
        again = harness.feeder()
        again.run_until(lambda: len(read_steps(work_dir(harness, task.task_id))) > len(steps), length_ms=LONG_MS)
        again.close()
    assert health(harness.endpoint) == "SERVING"


def test_out_of_order_bubble_events_are_counted_and_grant_nothing(harness: ManagerHarness) -> None:
    # Never granted yet, the task's step time is unknown: the first bubble in time gets it a probe grant.
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    harness.wait_state(task.task_id, "PARKED")
    feeder = harness.feeder()
    now = time.monotonic_ns()
    stale = [
        BubbleEnd(0, 0, 100, 0, now),  # an end before its start arrived
        BubbleStart(0, 0, 100, 0, "test", now - 900 * MS, 20 * MS, -1),  # its start, long over: no grant
        BubbleEnd(0, 0, 100, 0, now - 880 * MS),
        BubbleStart(0, 0, 50, 0, "test", now - 2000 * MS, 20 * MS, -1),  # an old iteration after a newer one
        BubbleEnd(0, 0, 50, 0, now - 1980 * MS),
    ]
    for event in stale:
        feeder.send(event)
    wait_for(lambda: harness.client.stats().events_received >= len(stale), 10)
    # Only the end that came before its start is out of order: late bubbles are measured, not used.
    stats = harness.client.stats()
    assert (stats.events_ignored, stats.events_rejected) == (1, 0)

    def untouched() -> bool:
        info = harness.client.get(task.task_id)
        return (info.state, info.steps) == ("PARKED", 0)

    holds_for(untouched, 0.2, "the task stays PARKED with no step: a bubble in the past is never granted")

    # Within an open bubble, a late start of an older iteration and the end of another change nothing.
    start = time.monotonic_ns()
    feeder.send(BubbleStart(0, 0, 200, 0, "test", start, 2000 * MS, -1))
    wait_for(lambda: harness.client.get(task.task_id).state == "RUNNING", 10)
    feeder.send(BubbleStart(0, 0, 199, 0, "test", start - 30 * MS, 40 * MS, -1))
    feeder.send(BubbleEnd(0, 0, 199, 0, start - MS))
    wait_for(lambda: harness.client.stats().events_received >= len(stale) + 3, 10)
    assert harness.client.get(task.task_id).state == "RUNNING", "a stale event parked the open bubble's worker"
    # The open bubble (2 s predicted) keeps its grant: its worker gets to step before the end comes.
    wait_for(lambda: read_steps(work_dir(harness, task.task_id)), 10)
    feeder.send(BubbleEnd(0, 0, 200, 0, time.monotonic_ns()))
    accepted, rejected = feeder.close()
    assert (accepted, rejected) == (len(stale) + 4, 0)  # well-formed: accepted on the wire, ignored by the core
    stats = harness.client.stats()
    assert (stats.events_ignored, stats.events_rejected) == (3, 0)
    harness.wait_state(task.task_id, "PARKED", "FROZEN")  # parked at the end, or frozen if it answered late
    assert read_steps(work_dir(harness, task.task_id)), "the open bubble's grant ran no step"
    assert health(harness.endpoint) == "SERVING"


class TrainingLoop:
    """A training loop's reporter calls, each timed: one bubble (start, 2 ms wait, end) per iteration."""

    def __init__(self, reporter: BubbleReporter) -> None:
        self.reporter = reporter
        self.calls = 0

    def run(self, iterations: int) -> int:
        """Run ``iterations``; return the slowest single call in nanoseconds."""
        worst = 0
        for _ in range(iterations):
            it = self.calls // 2
            t0 = time.perf_counter_ns()
            self.reporter.bubble_start(it, 0, "test", 2 * MS, 8 * 2**30)
            t1 = time.perf_counter_ns()
            time.sleep(0.002)
            t2 = time.perf_counter_ns()
            self.reporter.bubble_end(it, 0)
            t3 = time.perf_counter_ns()
            self.calls += 2
            worst = max(worst, t1 - t0, t3 - t2)
            time.sleep(0.001)
        return worst

    def until(self, predicate: Callable[[], object], timeout_s: float = 30.0) -> None:
        """Keep training until the manager shows ``predicate``."""
        wait_for(lambda: self.run(10) >= 0 and predicate(), timeout_s)


def test_reporter_never_blocks_while_the_manager_is_stopped_killed_or_restarted(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    sock = socket_path("reporter")
    state = tmp_path / "state"
    daemon = start_daemon(sock, state)
    endpoint = Endpoint("unix", str(sock))
    reporter = BubbleReporter(DEVICE, 0, 0, endpoint=endpoint, backoff_initial_s=0.02, backoff_max_s=0.2)
    training = TrainingLoop(reporter)
    try:
        with ControlClient(endpoint) as client:
            training.until(lambda: client.stats().bubbles > 0)
            # A stopped manager reads nothing: gRPC's buffers fill, then the reporter's queue. Were
            # any call to wait on the manager, this loop could not end before the SIGCONT below.
            daemon.send_signal(signal.SIGSTOP)
            stopped_ns = training.run(300)
            daemon.send_signal(signal.SIGCONT)
            received = client.stats().bubbles
            training.until(lambda: client.stats().bubbles > received)
            daemon.kill()
            daemon.wait(10)
            killed_ns = training.run(200)
        daemon = start_daemon(sock, state)
        with ControlClient(endpoint) as client:
            training.until(lambda: client.stats().bubbles > 0)
        counters = reporter.counters()
        assert counters.reconnects >= 1
        assert counters.enqueued <= training.calls <= counters.enqueued + counters.dropped
        record_property("max_enqueue_us_manager_stopped", stopped_ns / 1000)
        record_property("max_enqueue_us_manager_killed", killed_ns / 1000)
    finally:
        reporter.close()
        daemon.send_signal(signal.SIGCONT)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


# ====================================================================== corrupt checkpoints


def _manager_on(state: Path, sock: Path) -> Manager:
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(sock)), state_dir=state, core=CoreConfig(),
                      memory_poll_ms=20.0)
    manager.start()
    return manager


def _corrupt(path: Path) -> None:
    path.write_bytes(b"\x00garbage, not a checkpoint")


@pytest.mark.parametrize("corrupt", ["newest", "all"])
def test_corrupt_checkpoint_on_disk_falls_back_to_the_previous_one_or_fails_saying_so(
    tmp_path: Path, corrupt: str
) -> None:
    state = tmp_path / "state"
    sock = socket_path(f"ckpt-{corrupt}")
    manager = _manager_on(state, sock)
    try:
        with ControlClient(manager.endpoint) as client:
            task = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=2**28,
                                          working_dir=str(TESTS_DIR), checkpoint_interval_s=0.02))
            feeder = BubbleFeeder(manager.endpoint)
            written = state / "tasks" / task.task_id / "checkpoints"
            # Two checkpoints on disk before the drain (whose own is written only after steps since the last):
            # none is written before the first step, so the first grants may leave one.
            feeder.run_until(lambda: client.get(task.task_id).checkpoint_step >= 20
                             and len(list(written.glob("ckpt-*.pt"))) >= 2, length_ms=LONG_MS)
            feeder.close()
    finally:
        manager.stop(drain=True)
    checkpoints = sorted((state / "tasks" / task.task_id / "checkpoints").glob("ckpt-*.pt"),
                         key=lambda p: int(p.stem.split("-")[1]))
    assert len(checkpoints) == 2
    older_step = int(checkpoints[0].stem.split("-")[1])
    for path in checkpoints if corrupt == "all" else checkpoints[-1:]:
        _corrupt(path)

    manager = _manager_on(state, sock)
    try:
        with ControlClient(manager.endpoint) as client:
            feeder = BubbleFeeder(manager.endpoint)
            log_path = state / "tasks" / task.task_id / "worker.log"
            if corrupt == "newest":
                feeder.run_until(lambda: "resumed from" in log_path.read_text(), length_ms=LONG_MS)
                feeder.close()
                log = log_path.read_text()
                assert f"cannot read {checkpoints[-1]}" in log
                assert f"resumed from {checkpoints[0].name} at step {older_step}" in log
                assert client.get(task.task_id).progress >= older_step
            else:
                feeder.run_until(lambda: client.get(task.task_id).state == "FAILED", length_ms=LONG_MS)
                feeder.close()
                failure = client.get(task.task_id).failure
                assert failure is not None and failure.kind == "CHECKPOINT"
                assert "no checkpoint is readable" in failure.message
                assert all(p.name in failure.message for p in checkpoints)
                # Stranger trial: it did not say what to do, and read "at step: 0" of a task whose progress was 1985.
                assert "cancel it and submit it again to start over" in failure.message
                assert failure.step == -1
    finally:
        manager.stop()


# ====================================================================== the state directory


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory no process of ours can write: permissions for a user, a read-only mount for root."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"root cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("exists", [True, False], ids=["existing", "to-create"])
def test_read_only_state_directory_stops_the_manager_at_start_with_exit_2(read_only_dir: Path, exists: bool) -> None:
    sock = socket_path("ro")
    state = read_only_dir if exists else read_only_dir / "state"
    result = subprocess.run(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", DEVICE, "--endpoint", f"unix:{sock}",
         "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"state directory {state} is not writable" in lines[0], result.stderr
    assert not sock.exists()


def _durable_state(state: Path, task_id: str) -> str:
    """The task's state as a manager started now would read it from the store."""
    with sqlite3.connect(f"file:{state / 'tasks.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT state FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
    return str(row[0]) if row else ""


def test_store_refusing_writes_keeps_training_served_refuses_submissions_and_recovers(
    make_manager: Callable[..., ManagerHarness],
) -> None:
    h = make_manager()
    witness = h.submit("sample_tasks:Counter", args={"step_ms": 1.0}, name="witness")
    doomed = h.submit("sample_tasks:Counter", args={"step_ms": 1.0}, name="doomed", priority=-1)
    feeder = h.feeder()
    feeder.run_until(lambda: h.client.get(witness.task_id).steps > 0, length_ms=LONG_MS)
    # SQLite's own read-only switch: every write fails as on a read-only or failing disk.
    h.manager.loop.durability.store._db.execute("PRAGMA query_only = ON")
    try:
        with pytest.raises(RequestRejected, match="not writable.*the task was not submitted"):
            h.submit("sample_tasks:Counter", name="refused")
        assert h.client.cancel(doomed.task_id).state == "CANCELLED"  # decided now, recorded later
        before = h.client.get(witness.task_id).steps
        feeder.run_until(lambda: h.client.get(witness.task_id).steps > before, length_ms=LONG_MS, timeout_s=60)
        assert health(h.endpoint) == "SERVING"
        assert _durable_state(h.manager.state_dir, doomed.task_id) != "CANCELLED"
    finally:
        h.manager.loop.durability.store._db.execute("PRAGMA query_only = OFF")
    wait_for(lambda: _durable_state(h.manager.state_dir, doomed.task_id) == "CANCELLED", 10)
    accepted = h.submit("sample_tasks:Counter", name="accepted")
    feeder.close()
    assert {t.task_id for t in h.client.list()} == {witness.task_id, doomed.task_id, accepted.task_id}


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs to fill up (needs root: skipped elsewhere)."""
    path = tmp_path / "small"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """Fill ``directory``'s filesystem. Unbuffered: a buffered file's close flushed what the full disk had
    refused, and raised "No space left on device" out of here (a third of the runs on a loaded machine)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\xff" * 65536)
        except OSError:
            pass
    return filler


def test_full_disk_keeps_training_served_loses_no_checkpoint_and_recovers(small_tmpfs: Path) -> None:
    state = small_tmpfs / "state"
    sock = socket_path("full")
    daemon = start_daemon(sock, state)
    endpoint = Endpoint("unix", str(sock))
    client = ControlClient(endpoint)
    spec = TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0, "log_steps": False}, memory_bytes=2**28,
                    working_dir=str(TESTS_DIR), checkpoint_interval_s=0.05, name="witness")
    try:
        witness = client.submit(spec)
        feeder = BubbleFeeder(endpoint)
        feeder.run_until(lambda: client.get(witness.task_id).checkpoint_step >= 10, length_ms=LONG_MS)
        filler = _fill(small_tmpfs)

        with pytest.raises(RequestRejected, match="not writable: database or disk is full"):
            client.submit(spec)
        before = client.get(witness.task_id)
        feeder.run_until(lambda: client.get(witness.task_id).steps > before.steps, length_ms=LONG_MS, timeout_s=60)
        during = client.get(witness.task_id)
        assert during.failure is None and during.state in ALIVE
        assert health(endpoint) == "SERVING"
        acknowledged = during.checkpoint_step

        filler.unlink()  # space returns
        feeder.run_until(lambda: client.get(witness.task_id).checkpoint_step > acknowledged, length_ms=LONG_MS,
                         timeout_s=60)
        second = client.submit(spec)
        feeder.close()
        acknowledged = client.get(witness.task_id).checkpoint_step

        daemon.kill()  # nothing acknowledged may depend on this manager's memory
        daemon.wait(10)
        daemon = start_daemon(sock, state)
        client.close()
        client = ControlClient(endpoint)
        tasks = {t.task_id: t for t in client.list()}
        assert set(tasks) == {witness.task_id, second.task_id}
        assert tasks[witness.task_id].checkpoint_step >= acknowledged
    finally:
        client.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
