"""End-to-end (issue 23): a trainer on the manager's host sends its events as datagrams straight to the
loop (:mod:`freeride._local_events`), and a step running at the trainer's real end is frozen at that end
+ grace, not grace after the end reached the manager. A real daemon, a real ``BubbleReporter`` and a real
worker whose steps take 50 ms; the wire's servicer is watched to show that nothing crossed it."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import ManagerHarness, now_ns, wait_for

from freeride._boards import read_step
from freeride._manager.trace import read_trace
from freeride._task_process import process_state
from freeride.messages import TrainerEvent
from freeride.training.reporter import BubbleReporter

pytestmark = pytest.mark.e2e
MS = 1_000_000
S = 1_000 * MS


class WatchedWire:
    """Counts the events that reach the manager over the wire (a trainer stream's servicer thread)."""

    def __init__(self, post: Callable[[Sequence[TrainerEvent], int, str], int]) -> None:
        self._post = post
        self.posted = 0

    def __call__(self, events: Sequence[TrainerEvent], received_ns: int, job: str = "") -> int:
        self.posted += len(events)
        return self._post(events, received_ns, job)


def _connect(harness: ManagerHarness) -> tuple[BubbleReporter, WatchedWire]:
    wire = WatchedWire(harness.manager.loop.post_bubbles)
    harness.manager.loop.post_bubbles = wire  # type: ignore[method-assign]
    reporter = BubbleReporter(str(harness.manager.device), stage=0, rank=0, endpoint=harness.endpoint,
                              backoff_initial_s=0.01)
    wait_for(lambda: reporter.counters().connected and reporter._local is not None, 10,
             what="the reporter to connect and open the local event socket")
    return reporter, wire


def test_a_long_step_running_at_an_early_end_is_frozen_at_the_trainers_end_plus_grace_with_nothing_on_the_wire(
    make_manager: Callable[..., ManagerHarness], tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    # A grace of 5 s: a freeze counted from the end's arrival would come >= 5 s after it; one counted from
    # the trainer's own end, which the test puts 10 s in the past, comes as soon as the end is read. The
    # manager's own freeze: the trainer does not stop the step (test_a_step_running_at_the_end_is_stopped_...).
    harness = make_manager(trace_path=trace, grace_ns=5 * S, trainer_stops=False)
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 50.0})
    harness.wait_state(task.task_id, "PARKED")
    reporter, wire = _connect(harness)
    try:
        t0 = now_ns()
        # Predicted at 60 s: without the trainer's end, nothing would freeze the step for a minute.
        reporter.bubble_start(0, 0, "test", predicted_ns=60 * S, start_ns=t0 - 20 * S)
        board = harness.manager.loop.task_dir(task.task_id) / "board"
        wait_for(lambda: read_step(board) >= 0, 30, what="the worker to begin a step")
        reporter.bubble_end(0, 0, end_ns=t0 - 10 * S)  # steps of 50 ms back to back: one is running now
        harness.wait_state(task.task_id, "FROZEN", timeout_s=20)
        wait_for(lambda: harness.client.stats().bubble_time_s > 0, 10, what="the end to be measured")
        stats = harness.client.stats()
        assert stats.overruns == 1 and stats.events_rejected == 0
        # The next bubble thaws it and grants it again.
        reporter.bubble_start(1, 0, "test", predicted_ns=60 * S)
        harness.wait_state(task.task_id, "RUNNING", timeout_s=20)
        reporter.bubble_end(1, 0)
        harness.wait_state(task.task_id, "PARKED", "FROZEN", timeout_s=20)
        counters = reporter.counters()
        assert wire.posted == 0 and counters.messages == 0, "an event crossed the wire"
        assert counters.local == 4 and counters.local_fallbacks == 0
    finally:
        reporter.close()
    wait_for(lambda: {"end_seen", "freeze", "frozen"} <= {r.get("reason", r["ev"]) for r in read_trace(trace)}, 10,
             what="the trace to carry the end seen, the freeze and the frozen grant's steps")
    records = read_trace(trace)
    seen = next(r for r in records if r["ev"] == "end_seen")
    freeze = next(r for r in records if r["ev"] == "freeze")
    assert seen["end_ns"] == t0 - 10 * S
    assert 0 <= freeze["at_ns"] - seen["at_ns"] < 5 * S, "the freeze was counted from the end's arrival"
    assert "by" not in freeze, "the trainer stopped the step although the manager said it should not"
    assert harness.client.stats().trainer_stops == 0
    # The worker's CPU time when its frozen step began, and when the manager froze it: what bounds the
    # part of that step past the end (freeride.harvest).
    frozen = next(r for r in records if r["ev"] == "steps" and r["reason"] == "frozen")
    assert 0 < frozen["start_cpu_ns"] <= freeze["cpu_ns"]


def test_a_step_running_at_the_end_is_stopped_by_the_trainer_itself_and_frozen_as_of_that_stop(
    make_manager: Callable[..., ManagerHarness], tmp_path: Path,
) -> None:
    # cpu:N: the trainer's training thread stops the worker at its end (the end board's stop record). A grace of
    # 5 s: the manager's own freeze would come 5 s after the end; the trainer's comes within the end call.
    from freeride._boards import WorkerBoard

    trace = tmp_path / "trace.jsonl"
    harness = make_manager(trace_path=trace, grace_ns=5 * S)
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 50.0})
    harness.wait_state(task.task_id, "PARKED")
    reporter, wire = _connect(harness)
    pid = harness.client.get(task.task_id).pid
    board = WorkerBoard.attach(harness.manager.loop.task_dir(task.task_id) / "board")
    try:
        reporter.bubble_start(0, 0, "test", predicted_ns=60 * S)
        wait_for(lambda: board.step_began_ns() > 0, 30, what="the worker to begin a step")
        before = now_ns()
        reporter.bubble_end(0, 0)  # a 50 ms step is running
        after = now_ns()
        assert process_state(pid) in ("T", "t") or wait_for(lambda: process_state(pid) == "T", 1, what="the stop")
        frozen = harness.wait_state(task.task_id, "FROZEN", timeout_s=4)  # well before end + grace
        assert frozen.state == "FROZEN"
        # The time it stood still counts from the trainer's stop (its board), whenever the manager read the end.
        assert before <= board.stopped_at_ns() <= after
        # The next bubble thaws the step: it runs again, finishes, and goes on under the new grant.
        done, stopped, still = board.steps_done(), board.stopped_at_ns(), board.stood_still_ns()
        thawed_after = now_ns()
        reporter.bubble_start(1, 0, "test", predicted_ns=60 * S)
        harness.wait_state(task.task_id, "RUNNING", timeout_s=20)
        assert board.stood_still_ns() - still >= thawed_after - stopped  # the thaw added the time since the stop
        wait_for(lambda: board.steps_done() > done + 1, 30, what="the thawed step and the next to finish")
        reporter.bubble_end(1, 0)
        harness.wait_state(task.task_id, "PARKED", "FROZEN", timeout_s=4)
        stats = harness.client.stats()
        assert stats.overruns >= 1 and stats.trainer_stops >= 1 and wire.posted == 0
    finally:
        reporter.close()
        board.close()
    wait_for(lambda: {"freeze", "frozen"} <= {r.get("reason", r["ev"]) for r in read_trace(trace)}, 10,
             what="the trace to carry the freeze and the frozen grant's steps")
    records = read_trace(trace)
    freeze = next(r for r in records if r["ev"] == "freeze")
    assert freeze.get("by") == "trainer" and before <= freeze["at_ns"] <= after


def test_a_command_tasks_command_in_its_slice_is_stopped_by_the_trainer_with_the_worker(
    make_manager: Callable[..., ManagerHarness],
) -> None:
    # A command task's command runs in a process group of its own: the trainer stopped the worker alone, and a
    # slice in flight ran on until the manager froze the group. The grant names the group on the end board.
    import struct
    import sys

    import psutil

    from freeride._boards import QUIET_SLOTS_END
    from freeride._manager import core as C

    harness = make_manager(grace_ns=5 * S)
    # The manager's own freezes are left out: a command found stopped was stopped by the trainer.
    harness.manager.loop._apply_by_type[C.Freeze] = lambda action: []
    task = harness.client.submit(__import__("freeride").TaskSpec(
        command=(sys.executable, "-c", "while True: pass"), args={"slice_ms": 1000.0}, memory_bytes=512 * 2**20))
    harness.wait_state(task.task_id, "PARKED")
    pid = harness.client.get(task.task_id).pid

    def running_command() -> int:
        """The command's pid once it runs in a slice (it starts in the first grant, stopped; 0 until then)."""
        found = [c.pid for c in psutil.Process(pid).children() if "while True: pass" in c.cmdline()]
        return found[0] if found and process_state(found[0]) == "R" else 0

    reporter, _ = _connect(harness)
    try:
        reporter.bubble_start(0, 0, "test", predicted_ns=60 * S)
        command = int(wait_for(running_command, 30, what="the command to run in a slice"))  # type: ignore[call-overload]
        assert harness.manager.end_board is not None
        with open(harness.manager.end_board, "rb") as fh:
            fh.seek(QUIET_SLOTS_END)  # rank 0's command group: named in the grant that started the command
            assert struct.unpack("<q", fh.read(8))[0] == command
        reporter.bubble_end(0, 0)
        wait_for(lambda: process_state(pid) == "T" and process_state(command) == "T", 5,
                 what="the worker and the command stopped by the trainer")
        assert harness.wait_state(task.task_id, "FROZEN", timeout_s=4).state == "FROZEN"  # booked as of that stop
    finally:
        reporter.close()


def test_a_worker_told_to_stop_in_its_bubble_is_not_stopped_by_the_trainer_at_that_bubbles_end(
    make_manager: Callable[..., ManagerHarness],
) -> None:
    # A drain beside a running job: the trainer's stop armed for the grant stopped the worker, still in its step, at
    # the bubble's end; the drain's message had gone out before, so nothing continued it, and the drain killed it
    # past the stop timeout (a stranger's, and a CI run's), its work since the last checkpoint lost.
    import threading

    from freeride._boards import WorkerBoard

    harness = make_manager(stop_timeout_ns=4 * S)
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 1500.0})
    harness.wait_state(task.task_id, "PARKED")
    reporter, _ = _connect(harness)
    pid = harness.client.get(task.task_id).pid
    board = WorkerBoard.attach(harness.manager.loop.task_dir(task.task_id) / "board")
    drained: list[Any] = []
    try:
        reporter.bubble_start(0, 0, "test", predicted_ns=60 * S)
        wait_for(lambda: board.step_began_ns() > 0, 30, what="the worker to begin a step")
        drain = threading.Thread(target=lambda: drained.append(harness.client.drain(timeout_s=20)), daemon=True)
        drain.start()
        wait_for(lambda: harness.client.stats().draining, 10, what="the drain to begin")
        reporter.bubble_end(0, 0)  # the end of the bubble it holds, its 1.5 s step still running
        assert process_state(pid) != "T"
        drain.join(20)
    finally:
        reporter.close()
        board.close()
    assert drained and (drained[0].checkpointed, drained[0].killed) == (1, 0), drained


def test_a_worker_that_dies_while_its_bubbles_end_is_armed_fails_alone_and_the_manager_serves_on(
    harness: ManagerHarness,
) -> None:
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 50.0})
    harness.wait_state(task.task_id, "PARKED")
    reporter, wire = _connect(harness)
    try:
        reporter.bubble_start(0, 0, "test", predicted_ns=60_000 * MS)
        board = harness.manager.loop.task_dir(task.task_id) / "board"
        wait_for(lambda: read_step(board) >= 0, 30, what="the worker to begin a step")
        info = harness.client.get(task.task_id)
        assert info.pid
        os.kill(info.pid, signal.SIGKILL)
        reporter.bubble_end(0, 0)  # its end comes for a grant whose worker is dying or gone
        failed = harness.wait_state(task.task_id, "FAILED", timeout_s=20)
        assert failed.failure is not None and failed.failure.kind == "SIGNAL"
        wait_for(lambda: harness.client.stats().bubble_time_s > 0, 10, what="the end to be measured")
        other = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
        harness.wait_state(other.task_id, "PARKED")
        reporter.bubble_start(1, 0, "test", predicted_ns=200 * MS)
        harness.wait_state(other.task_id, "RUNNING", timeout_s=20)
        reporter.bubble_end(1, 0)
        harness.wait_state(other.task_id, "PARKED", "FROZEN", timeout_s=20)  # frozen if a step ran at the end
        assert harness.client.stats().events_rejected == 0 and wire.posted == 0
    finally:
        reporter.close()


def test_a_local_datagram_that_is_no_event_is_counted_as_rejected_and_the_trainers_next_events_go_through(
    harness: ManagerHarness,
) -> None:
    import socket

    from freeride._local_events import encode, local_events_path
    from freeride.messages import BubbleEnd, BubbleStart

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(local_events_path(harness.endpoint.address)))
    try:
        start = now_ns()
        sock.send(b"\x01 not an event")
        sock.send(encode(BubbleStart(0, 0, 0, 0, "test", start, 5 * MS)))
        sock.send(encode(BubbleEnd(0, 0, 0, 0, start - 1)))  # a valid event, which the core refuses: before its start
        sock.send(encode(BubbleEnd(0, 0, 0, 0, start + MS)))
        wait_for(lambda: harness.client.stats().bubble_time_s > 0, 10, what="the valid events to be handled")
        stats = harness.client.stats()
        assert (stats.events_received, stats.events_rejected, stats.events_ignored) == (3, 1, 1)
    finally:
        sock.close()


def test_a_trainer_sending_garbage_at_its_event_rate_is_counted_in_full_and_logged_in_a_line_or_two(
    harness: ManagerHarness, caplog: pytest.LogCaptureFixture,
) -> None:
    # Each rejected local message was a warning: a trainer sending garbage at its event rate flooded the log.
    import logging
    import socket

    from freeride._local_events import encode, local_events_path
    from freeride.messages import BubbleEnd, BubbleStart

    caplog.set_level(logging.WARNING, logger="freeride._manager.loop")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(local_events_path(harness.endpoint.address)))
    try:
        for _ in range(300):
            sock.send(b"\x01 not an event")
        start = now_ns()
        sock.send(encode(BubbleStart(0, 0, 0, 0, "test", start, 5 * MS)))
        sock.send(encode(BubbleEnd(0, 0, 0, 0, start + MS)))
        wait_for(lambda: harness.client.stats().bubble_time_s > 0, 10, what="the valid events to be handled")
        assert harness.client.stats().events_rejected == 300
        lines = [r for r in caplog.records if "local trainer message" in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    finally:
        sock.close()


def test_a_manager_kept_awake_between_events_grants_and_parks_every_bubble_of_a_local_trainer(
    make_manager: Callable[..., ManagerHarness], caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="freeride._manager.loop")
    harness = make_manager(event_spin_ns=100 * MS)  # the most --event-spin-us takes: awake through the test
    wait_for(lambda: "awake 100000 us after each trainer event" in caplog.text, 10, what="the loop to say it spins")
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    harness.wait_state(task.task_id, "PARKED")
    reporter, wire = _connect(harness)
    try:
        for it in range(5):
            reporter.bubble_start(it, 0, "test", predicted_ns=60 * S)
            harness.wait_state(task.task_id, "RUNNING", timeout_s=20)
            reporter.bubble_end(it, 0)
            harness.wait_state(task.task_id, "PARKED", "FROZEN", timeout_s=20)
        wait_for(lambda: harness.client.stats().events_received == 10, 10, what="every event to be handled")
        stats = harness.client.stats()
        assert (stats.events_rejected, stats.events_ignored) == (0, 0)
        assert wire.posted == 0 and reporter.counters().local == 10
    finally:
        reporter.close()


def test_a_manager_started_awake_between_events_says_so_where_it_says_it_listens(tmp_path: Path) -> None:
    # A stranger found the spin, which spends a core, said only in the log at -v.
    from daemons import socket_path, start_daemon, stop_daemon

    daemon = start_daemon(socket_path("spin"), tmp_path / "state", "--event-spin-us", "3000")
    stop_daemon(daemon)
    err = daemon.stderr.read().decode() if daemon.stderr else ""
    assert "listening on" in err and "; awake 3000 us after each trainer event;" in err, err


def test_a_manager_without_a_task_reads_a_local_trainer_late_and_grants_at_once_when_one_comes(
    make_manager: Callable[..., ManagerHarness],
) -> None:
    # With no side task resident nothing is decided on a trainer's event: the loop reads them every 10 ms, so a
    # send wakes no one (a stranger's trainer ran +17% slower beside managers with no task). A task that comes is
    # granted the next bubble as before.
    harness = make_manager()
    reporter, wire = _connect(harness)
    try:
        reporter.bubble_start(0, 0, "test", predicted_ns=5 * MS)
        reporter.bubble_end(0, 0)
        wait_for(lambda: harness.client.stats().bubbles == 1, 10, what="the events read late")
        assert harness.manager.loop._local_eager is False
        assert harness.client.stats().event_delay_ms.count == 0  # read late on purpose: not timed
        task = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
        harness.wait_state(task.task_id, "PARKED")
        wait_for(lambda: harness.manager.loop._local_eager, 10, what="the loop to read events at once again")
        reporter.bubble_start(1, 0, "test", predicted_ns=60 * S)
        harness.wait_state(task.task_id, "RUNNING", timeout_s=20)
        board = harness.manager.loop.task_dir(task.task_id) / "board"
        wait_for(lambda: read_step(board) >= 1, 30, what="the worker to step in the grant")
        reporter.bubble_end(1, 0)
        harness.wait_state(task.task_id, "PARKED", "FROZEN", timeout_s=20)
        wait_for(lambda: harness.client.stats().bubbles == 2, 10)
        stats = harness.client.stats()
        assert stats.event_delay_ms.count == 2 and stats.events_rejected == 0
        assert wire.posted == 0 and reporter.counters().local_fallbacks == 0
    finally:
        reporter.close()
