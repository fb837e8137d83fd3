"""Worker supervision on its own: the test plays the worker at the other end of a real channel, with a real
process standing in for it, and checks the core events the supervisor returns (it decides nothing)."""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from freeride import _channel as W
from freeride._boards import DOING_CHECKPOINT, WorkerBoard
from freeride._channel import ProtocolError, socketpair
from freeride._manager import core as C
from freeride._manager.paths import TaskPaths
from freeride._manager.supervisor import StepsReported, Supervisor, WorkerSettings
from freeride._manager.worker_log import WorkerLog
from freeride._task_process import process_state

TID = "counter-1"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


@dataclass
class Rig:
    sup: Supervisor
    selector: selectors.BaseSelector
    worker: socket.socket  # the worker's end of the channel: the test writes what a worker would
    proc: subprocess.Popen[bytes]
    board: WorkerBoard
    clock: FakeClock
    watched: dict[str, list[int]] = field(default_factory=dict)

    def ready(self) -> list[Any]:
        """What the loop's select would hand on: the events of every ready callback, in order."""
        events: list[Any] = []
        for key, _ in self.selector.select(0.05):
            events += key.data()
        return events


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    paths = TaskPaths(tmp_path, None, lambda tid: False)
    task_dir = paths.task_dir(TID)
    task_dir.mkdir(parents=True)
    board = WorkerBoard.create(task_dir / "board")
    selector = selectors.DefaultSelector()
    watched: dict[str, list[int]] = {}
    clock = FakeClock()
    sup = Supervisor("cpu:0", WorkerSettings(eof_grace_ms=100), paths, selector,  # type: ignore[arg-type]
                     watched.__setitem__, lambda tid: watched.pop(tid, None), clock)
    ours, theirs = socketpair()
    log_fd, out_fd = os.pipe2(os.O_CLOEXEC)
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; print('last words'); sys.stdout.flush(); "
                             "time.sleep(60)"], stdout=out_fd, start_new_session=True)
    os.close(out_fd)
    sup.adopt(TID, proc, ours, log_fd, WorkerLog(task_dir / "worker.log", 2**20, 1), board)
    rig = Rig(sup, selector, theirs, proc, board, clock, watched)
    yield rig
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    theirs.close()
    selector.close()


def parked(grant_id: int = 3) -> W.Parked:
    return W.Parked(grant_id, steps=2, durations_ns=(5, 6), first_step_ns=1, last_end_ns=20, parked_ns=21,
                    reason="deadline", progress=2.0, total_steps=9, starts_ns=(1, 10))


def test_worker_messages_become_core_events_in_order(rig: Rig) -> None:
    rig.worker.send(W.encode(W.Ready(pid=rig.proc.pid, progress_unit="edges")))
    rig.worker.send(W.encode(parked()))
    rig.worker.send(W.encode(W.Usage(device_bytes=700 * 2**20)))
    events = rig.ready()
    assert events == [C.WorkerReady(TID, rig.proc.pid, "edges", 0, 0), StepsReported(TID, parked()),
                      C.WorkerParked(TID, 3, 2, (5, 6), 1, 20, 21, "deadline", 2.0, 9),
                      C.WorkerUsage(TID, 700 * 2**20)]
    assert rig.watched == {TID: [rig.proc.pid]}


@pytest.mark.parametrize("data", [b"garbage", b'{"t":"ready","pid":"1"}', b'{"t":"finished","progress":1.0}',
                                  b'{"t":"reboot"}', b'{"t":"stop","checkpoint":true}'])
def test_a_malformed_message_is_a_protocol_failure_naming_the_step_and_the_worker_is_killed(
    rig: Rig, data: bytes
) -> None:
    rig.board.publish_step(4)
    rig.worker.send(data)
    [failed] = rig.ready()
    assert isinstance(failed, C.WorkerFailed) and failed.failure.kind == "PROTOCOL"
    assert failed.failure.step == 4 and "malformed" in failed.failure.message
    assert rig.proc.wait(10) == -signal.SIGKILL


def test_what_only_the_manager_can_judge_is_refused_as_a_protocol_error(rig: Rig, tmp_path: Path) -> None:
    handle = rig.sup.workers[TID]
    with pytest.raises(ProtocolError, match="outside the task's directory"):
        rig.sup.on_message(handle, W.Checkpointed(step=1, path=str(tmp_path / "elsewhere"), progress=1.0))
    with pytest.raises(ProtocolError, match="process group"):
        rig.sup.on_message(handle, W.ProcessGroup(pgid=os.getpgrp()))
    inside = rig.sup.paths.task_dir(TID) / "checkpoints" / "ckpt-1.pt"
    assert rig.sup.on_message(handle, W.Checkpointed(step=1, path=str(inside), progress=1.0)) == [
        C.WorkerCheckpointed(TID, 1, str(inside), 1.0)]


def test_a_channel_closed_without_bye_is_a_protocol_failure_after_the_grace(rig: Rig) -> None:
    rig.worker.close()
    assert rig.ready() == []
    deadline = rig.sup.next_timer_ns()
    assert deadline == rig.clock.now + 100_000_000
    assert rig.sup.poll(deadline - 1) == []
    [failed] = rig.sup.poll(deadline)
    assert isinstance(failed, C.WorkerFailed) and "closed its channel" in failed.failure.message
    assert rig.proc.wait(10) == -signal.SIGKILL and rig.sup.next_timer_ns() is None


def test_a_worker_this_manager_killed_is_no_protocol_failure_however_late_its_exit_comes(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found on a loaded machine: a worker killed while starting (a drain) closed its channel as it died, its exit
    # at nice 19 came after the grace, and the task was FAILED "closed its channel but kept running" instead of
    # going back to wait. The kill is held back here, as a slow exit holds it.
    from freeride._manager import supervisor as supervisor_module

    sent: list[int] = []
    monkeypatch.setattr(supervisor_module, "_killpg", lambda pgid, sig: sent.append(sig))
    rig.sup.signal(TID, signal.SIGKILL)
    rig.worker.close()
    assert rig.ready() == []
    deadline = rig.sup.next_timer_ns()
    assert deadline is not None and rig.sup.poll(deadline) == [] and rig.sup.next_timer_ns() is None
    assert signal.SIGKILL in sent and rig.proc.poll() is None  # alive still, and not judged


def test_a_dying_worker_gets_more_graces_to_exit_and_is_judged_once_it_no_longer_dies_or_they_run_out(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found on a loaded machine: a segfaulting worker at nice 19 was still in its exit 500 ms after its channel
    # closed, and its crash was reported as "closed its channel but kept running" (PROTOCOL), not as SIGSEGV.
    from freeride._manager import supervisor as supervisor_module

    dying = [True]
    monkeypatch.setattr(supervisor_module, "process_dying", lambda pid: dying[0])
    rig.worker.close()
    assert rig.ready() == []
    for _ in range(supervisor_module.MAX_DYING_GRACES):
        deadline = rig.sup.next_timer_ns()
        assert deadline is not None and rig.sup.poll(deadline) == []
    deadline = rig.sup.next_timer_ns()
    assert deadline is not None
    [failed] = rig.sup.poll(deadline)  # dying for twenty graces: judged all the same
    assert isinstance(failed, C.WorkerFailed) and "closed its channel" in failed.failure.message


def test_a_worker_that_stops_dying_is_judged_at_its_next_grace(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    from freeride._manager import supervisor as supervisor_module

    dying = [True]
    monkeypatch.setattr(supervisor_module, "process_dying", lambda pid: dying[0])
    rig.worker.close()
    assert rig.ready() == []
    first = rig.sup.next_timer_ns()
    assert first is not None and rig.sup.poll(first) == []
    dying[0] = False
    second = rig.sup.next_timer_ns()
    assert second is not None and second > first
    [failed] = rig.sup.poll(second)
    assert isinstance(failed, C.WorkerFailed) and "closed its channel" in failed.failure.message


def test_a_goodbye_makes_the_end_of_file_an_exit_and_the_exit_carries_the_logs_tail(rig: Rig) -> None:
    log = rig.sup.paths.task_dir(TID) / "worker.log"
    wait_for(lambda: rig.ready() is not None and log.exists() and "last words" in log.read_text(), 10)
    rig.worker.send(W.encode(W.Bye(0)))
    rig.worker.close()
    rig.ready()
    assert rig.sup.next_timer_ns() is None
    os.killpg(rig.proc.pid, signal.SIGTERM)
    events: list[Any] = []
    wait_for(lambda: events.extend(rig.ready()) or any(isinstance(e, C.WorkerExited) for e in events), 10)
    [exited] = [e for e in events if isinstance(e, C.WorkerExited)]
    assert (exited.exit_code, exited.signal) == (None, signal.SIGTERM) and "last words" in exited.log_tail
    assert TID not in rig.sup.workers and rig.watched == {}


def test_a_full_channel_drops_the_message_and_counts_it(rig: Rig) -> None:
    sent = 0
    while rig.sup.messages_dropped == 0:
        rig.sup.send(TID, W.Park(sent))
        sent += 1
    assert sent > 1 and rig.sup.messages_dropped == 1


def test_a_frozen_worker_reports_the_steps_its_board_says_it_finished(rig: Rig) -> None:
    rig.board.publish_done(6)
    rig.board.publish_step(6)
    assert _without_run_delay(rig.sup.freeze(TID)) == [C.WorkerStepsSeen(TID, 6, False, step=6)]
    rig.sup.signal(TID, signal.SIGCONT)
    rig.board.publish_doing(DOING_CHECKPOINT)  # then it began writing a checkpoint
    assert _without_run_delay(rig.sup.freeze(TID)) == [C.WorkerStepsSeen(TID, 6, False, in_checkpoint=True,
                                                                          step=6)]
    rig.sup.signal(TID, signal.SIGCONT)
    assert rig.sup.freeze("nobody-2") == []


def test_a_freeze_and_its_thaw_add_the_time_stood_still_to_the_workers_board(rig: Rig) -> None:
    # The worker's step leaves the time it stood still out of its own (ThawCounter): the board totals it.
    before = time.monotonic_ns()
    rig.sup.freeze(TID)
    time.sleep(0.01)
    rig.sup.signal(TID, signal.SIGCONT)
    assert 10_000_000 <= rig.board.stood_still_ns() <= time.monotonic_ns() - before


def test_a_frozen_worker_without_a_board_is_answered_with_nothing_read(rig: Rig) -> None:
    # The core judges a step that used up its timeout on the read that answers the freeze: there is always one.
    rig.sup.workers[TID].board = None
    assert _without_run_delay(rig.sup.freeze(TID)) == [C.WorkerStepsSeen(TID, -1)]
    rig.sup.signal(TID, signal.SIGCONT)


def test_a_frozen_worker_whose_board_cannot_be_read_is_answered_with_nothing_read(rig: Rig) -> None:
    rig.board.close()
    assert _without_run_delay(rig.sup.freeze(TID)) == [C.WorkerStepsSeen(TID, -1)]
    rig.sup.signal(TID, signal.SIGCONT)


def _without_run_delay(events: list[Any]) -> list[Any]:
    """The events, each run delay checked as read (a live worker's is known) and then left out, with whether the
    worker was starved or asleep (a worker frozen right after its thaw may not have had its core yet under load)."""
    assert all(e.run_delay_ns >= 0 for e in events), events
    return [dataclasses.replace(e, run_delay_ns=-1, starved=False, asleep=False) for e in events]


@pytest.mark.parametrize(("ran_ns", "state", "starved", "asleep"), [
    (10_000, "R", True, False),  # no run in the grant, waiting for its core
    (10_000, "S", False, True),  # no run, asleep (a hang in a sleep)
    (10_000, "T", False, False),  # stopped by someone else: neither
    (4_000_000, "R", False, False),  # it ran 4 ms of the grant: neither (its state is not read)
])
def test_a_worker_that_did_not_run_in_the_grant_it_is_frozen_in_is_reported_starved_or_asleep(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, ran_ns: int, state: str, starved: bool, asleep: bool
) -> None:
    import freeride._manager.supervisor as supervisor

    reads = iter([(5_000_000, 1_000_000), (5_000_000 + ran_ns, 3_000_000)])  # at the grant; before the stop
    states: list[int] = []
    monkeypatch.setattr(rig.sup.workers[TID].sched, "read_first", lambda count: next(reads))
    monkeypatch.setattr(supervisor, "process_state", lambda pid: states.append(pid) or state)
    rig.sup.granted(TID)
    [seen] = rig.sup.freeze(TID)
    assert (seen.starved, seen.asleep, seen.run_delay_ns) == (starved, asleep, 2_000_000)
    assert len(states) == (ran_ns < 50_000)  # the state is read only for a worker that did not run
    rig.sup.signal(TID, signal.SIGCONT)


def test_a_freeze_reports_only_the_waits_for_the_core_inside_grants(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # Frozen mid-step beside a rank, a worker waits for its core until its stop lands, at the rank's next bubble:
    # that wait, outside any grant, was taken off the step's granted time, and a busy hang was never judged.
    reads = iter([(0, 0), (5_000_000, 1_000_000),  # grant 1: 1 ms of waits in it
                  (5_100_000, 31_000_000), (9_000_000, 32_500_000),  # a 30 ms wait for the stop; 1.5 ms in grant 2
                  (9_000_000, 40_000_000)])  # a freeze without a grant's reading: nothing of it counts
    monkeypatch.setattr(rig.sup.workers[TID].sched, "read_first", lambda count: next(reads))
    seen = []
    for grant in (True, True, False):
        if grant:
            rig.sup.granted(TID)
        seen.extend(rig.sup.freeze(TID))
        rig.sup.signal(TID, signal.SIGCONT)
    assert [e.run_delay_ns for e in seen] == [1_000_000, 2_500_000, 2_500_000]
    assert not any(e.starved or e.asleep for e in seen)


def test_a_message_to_a_worker_that_went_away_returns_what_it_said_before_it_closed(rig: Rig) -> None:
    # Regression: the channel was closed at once, unread: a worker that reported its failure and exited
    # just before a park (a bubble's end) reached it was recorded as exiting "without reporting an error".
    rig.worker.send(W.encode(W.Failed(kind="EXCEPTION", message="boom", step=5)))
    rig.worker.send(W.encode(W.Bye(1)))
    rig.worker.close()
    [failed] = rig.sup.send(TID, W.Park(3))
    assert isinstance(failed, C.WorkerFailed) and failed.failure.kind == "EXCEPTION" and failed.failure.step == 5
    assert rig.sup.workers[TID].closed and rig.sup.next_timer_ns() is None  # it said goodbye: no grace
    assert rig.sup.send(TID, W.Park(3)) == []


def test_a_worker_the_trainer_stopped_is_dated_at_that_stop_and_continued_before_its_next_message(rig: Rig) -> None:
    # The trainer stopped it at a bubble's end as it parked (the core saw the park first): its next grant must reach
    # a running worker, and the time it stood still counts from the trainer's stop.
    stopped = time.monotonic_ns()
    os.killpg(rig.proc.pid, signal.SIGSTOP)  # what the trainer's stop_at_end does
    wait_for(lambda: process_state(rig.proc.pid) == "T", 5, what="the worker to be stopped")
    rig.sup.stopped_by_trainer(TID, stopped)
    assert rig.board.stopped_at_ns() == stopped
    rig.sup.send(TID, W.Grant(4, deadline_ns=1, margin_ns=0))
    wait_for(lambda: process_state(rig.proc.pid) != "T", 5, what="the worker to be continued")
    assert stopped < rig.board.stood_still_ns() + stopped <= time.monotonic_ns()


def test_a_freeze_of_a_worker_the_trainer_stopped_keeps_the_trainers_date_and_its_grant_thaws_it(rig: Rig) -> None:
    stopped = time.monotonic_ns() - 5_000_000  # 5 ms before the freeze: the trainer's end came to the loop late
    os.killpg(rig.proc.pid, signal.SIGSTOP)
    wait_for(lambda: process_state(rig.proc.pid) == "T", 5, what="the worker to be stopped")
    rig.sup.stopped_by_trainer(TID, stopped)
    rig.sup.freeze(TID)
    assert rig.board.stopped_at_ns() == stopped
    rig.sup.send(TID, W.Grant(4, deadline_ns=1, margin_ns=0))  # frozen: a message alone does not continue it
    assert process_state(rig.proc.pid) == "T"
    rig.sup.signal(TID, signal.SIGCONT)  # the grant's thaw
    assert rig.board.stood_still_ns() >= 5_000_000
    wait_for(lambda: process_state(rig.proc.pid) != "T", 5, what="the worker to be thawed")


def test_a_stop_the_trainer_claims_for_a_worker_this_manager_froze_already_changes_nothing(rig: Rig) -> None:
    rig.sup.freeze(TID)
    wait_for(lambda: process_state(rig.proc.pid) == "T", 5, what="the worker to be frozen")
    frozen_at = rig.board.stopped_at_ns()
    rig.sup.stopped_by_trainer(TID, frozen_at + 1)
    assert rig.board.stopped_at_ns() == frozen_at
    rig.sup.send(TID, W.Grant(4, deadline_ns=1, margin_ns=0))
    assert process_state(rig.proc.pid) == "T"  # still frozen: its thaw is the core's


def test_a_worker_is_named_to_the_end_path_before_it_is_reaped(rig: Rig) -> None:
    named: list[tuple[int, bool]] = []
    rig.sup.before_reap = lambda pid: named.append((pid, rig.proc.returncode is None))
    os.killpg(rig.proc.pid, signal.SIGKILL)
    rig.worker.close()
    wait_for(lambda: any(isinstance(e, C.WorkerExited) for e in rig.ready()), 5, what="the worker's exit")
    assert named and named[0] == (rig.proc.pid, True)  # first before its pid could name another process


def test_a_thaw_continues_the_worker_and_leaves_a_command_tasks_own_group_to_its_slices(rig: Rig) -> None:
    # The command between two slices is stopped by its task; a thaw that continued it too let it run outside every
    # bubble while its worker parked (a stranger's command was runnable in 88% of samples). A freeze stops both; a
    # kill ends both.
    command = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        handle = rig.sup.workers[TID]
        rig.sup.on_message(handle, W.ProcessGroup(pgid=command.pid))
        rig.sup.freeze(TID)
        wait_for(lambda: process_state(rig.proc.pid) == "T" and process_state(command.pid) == "T", 5,
                 what="the worker and its command to be stopped")
        rig.sup.signal(TID, signal.SIGCONT)  # a grant's thaw
        wait_for(lambda: process_state(rig.proc.pid) in ("S", "R"), 5, what="the worker to be continued")
        assert process_state(command.pid) == "T"
        rig.sup.signal(TID, signal.SIGKILL)
        assert command.wait(10) == -signal.SIGKILL
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
