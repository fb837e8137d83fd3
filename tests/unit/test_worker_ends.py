"""A bubble's end stops new steps at once: the worker reads its boards before every step.

The worker runs in this process with a real channel and real board files; the "manager" and the
"trainer" are this test, writing the boards from inside a step, exactly between two steps of the
worker. Issue 13: the worker learned of an end only from the park message, read between steps, so
it kept starting steps until that message came (about 1% of steps began after the real end).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_devices
from sample_tasks import Counter

from freeride._boards import EndBoard, WorkerBoard
from freeride._channel import Channel, Grant, Init, Parked
from freeride._worker.runtime import WorkerRuntime

DEVICE = cpu_devices(1)[0]
S = 10**9
RANK = 3


class CallsBack(Counter):
    """Runs ``hook(step index)`` inside each step."""

    def __init__(self, hook: Callable[[int], None]) -> None:
        super().__init__(step_ms=0.05, log_steps=False)
        self.hook = hook

    def step(self) -> None:
        self.hook(self.count)
        super().step()


def worker(tmp_path: Path, channel: Channel, task: Counter) -> tuple[WorkerRuntime, WorkerBoard, EndBoard]:
    board = WorkerBoard.create(tmp_path / "board")
    EndBoard.create(tmp_path / "ends")
    rt = WorkerRuntime(channel, Init(
        task_id="t-1", memory_limit_bytes=2**28, work_dir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "ckpt"), device=DEVICE, board_file=str(tmp_path / "board"),
        end_board=str(tmp_path / "ends"),
    ))
    rt.task = task
    rt.setup_done = True
    rt._warmup_pending = False
    return rt, board, EndBoard.open(tmp_path / "ends", writable=True)


def grant(grant_id: int, start_ns: int, seconds: float = 5.0, trainer_ends: bool = True) -> Grant:
    return Grant(grant_id, deadline_ns=time.monotonic_ns() + int(seconds * S), margin_ns=0, rank=RANK,
                 bubble_start_ns=start_ns, trainer_ends=trainer_ends)


def parked(manager: Channel) -> Parked:
    msg = manager.recv(timeout_s=5)
    assert isinstance(msg, Parked), msg
    return msg


def test_a_worker_its_deadline_parks_holds_its_bubble_until_its_report_is_sent(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # Starved between its decision to park and its report, it is still stopped by the trainer at the end; where
    # the end is known already, it lets go first (a stop then would cost a continue).
    import struct

    from freeride._boards import END_RECORDS_BYTES

    manager, channel = channels

    def holding() -> int:
        with open(tmp_path / "ends", "rb") as fh:
            fh.seek(END_RECORDS_BYTES + RANK * 32 + 16)
            return int(struct.unpack("<q", fh.read(8))[0])

    box: dict[str, Any] = {"second": False}
    rt, _, ends = worker(tmp_path, channel, CallsBack(
        lambda i: box["e"].record_end(RANK, 300, 7) if box["second"] else None))
    box["e"] = ends
    at_send: list[tuple[str, int]] = []
    send = channel.send

    def spy(msg: Any) -> None:
        if isinstance(msg, Parked):
            at_send.append((msg.reason, holding()))
        send(msg)

    channel.send = spy  # type: ignore[method-assign]
    ends.arm_stop(RANK, 200, os.getpid())
    rt._run_grant(grant(8, start_ns=200, seconds=0.002))
    assert parked(manager).reason == "deadline"
    assert at_send == [("deadline", 1)] and holding() == 0
    ends.arm_stop(RANK, 300, os.getpid())
    box["second"] = True
    rt._run_grant(grant(9, start_ns=300))
    assert parked(manager).reason == "ended"
    assert at_send[1] == ("ended", 0)


def test_the_managers_end_word_stops_the_next_step(tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    manager, channel = channels
    box: dict[str, WorkerBoard] = {}
    rt, board, _ = worker(tmp_path, channel, CallsBack(lambda i: box["b"].end_grant(7, 1) if i == 3 else None))
    box["b"] = board
    assert rt._run_grant(grant(7, start_ns=100)) is False
    msg = parked(manager)
    # Step 3 learned of the end while it ran; no step began after it, and no park message was needed.
    assert (msg.steps, msg.reason, msg.end_ns) == (4, "park", 1)
    assert board.step() == 3


def test_the_trainers_end_stops_the_next_step_and_is_reported(tmp_path: Path,
                                                               channels: tuple[Channel, Channel]) -> None:
    manager, channel = channels
    box: dict[str, EndBoard] = {}

    def hook(i: int) -> None:
        if i == 2:
            box["ends"].record_end(RANK, 100, 12345)

    rt, _, ends = worker(tmp_path, channel, CallsBack(hook))
    box["ends"] = ends
    rt._run_grant(grant(7, start_ns=100))
    msg = parked(manager)
    assert (msg.steps, msg.reason, msg.end_ns) == (3, "ended", 12345)


def test_an_end_of_another_bubble_or_rank_stops_nothing(tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    manager, channel = channels
    box: dict[str, Any] = {}

    def hook(i: int) -> None:
        if i == 1:
            box["ends"].record_end(RANK, 99, 5)  # the bubble before this one
            box["ends"].record_end(RANK + 1, 100, 5)  # another rank's
            box["board"].end_grant(6, 1)  # an older grant's
        if i == 4:
            box["ends"].record_end(RANK, 100, 5)

    rt, board, ends = worker(tmp_path, channel, CallsBack(hook))
    box.update(ends=ends, board=board)
    rt._run_grant(grant(7, start_ns=100))
    assert parked(manager).steps == 5


def test_a_grant_whose_bubble_the_trainers_record_has_moved_past_runs_no_step(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # Granted before its bubble's end reached the manager, a worker starved until the trainer's next bubble had
    # ended too read no end for its own, and stepped to the grant's deadline outside any bubble.
    manager, channel = channels
    rt, _, ends = worker(tmp_path, channel, CallsBack(lambda i: None))
    ends.record_end(RANK, 100, 42)
    ends.record_end(RANK, 300, 350)  # the rank's next bubble, over as well
    rt._run_grant(grant(7, start_ns=100))
    msg = parked(manager)
    assert (msg.steps, msg.reason, msg.end_ns) == (0, "ended", 300)
    # An earlier bubble's record says nothing of a later one's end.
    rt._run_grant(grant(8, start_ns=400, seconds=0.002))
    assert parked(manager).reason == "deadline"


def test_a_grant_whose_bubble_already_ended_runs_no_step(tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    manager, channel = channels
    rt, _, ends = worker(tmp_path, channel, CallsBack(lambda i: None))
    ends.record_end(RANK, 100, 42)
    rt._run_grant(grant(7, start_ns=100))
    msg = parked(manager)
    assert (msg.steps, msg.reason, msg.end_ns) == (0, "ended", 42)


@pytest.mark.parametrize("by", ["ended", "park"])
def test_a_grant_taken_after_its_bubbles_end_and_its_deadline_is_reported_as_ended_by_the_end(
    tmp_path: Path, channels: tuple[Channel, Channel], by: str
) -> None:
    # Under load (CI, the first-hour park latency test): a worker that read its grant late, past both the
    # bubble's end and its own deadline, said "deadline"; the manager then counted no park latency for it.
    manager, channel = channels
    rt, board, ends = worker(tmp_path, channel, CallsBack(lambda i: None))
    if by == "ended":
        ends.record_end(RANK, 100, 42)  # the trainer's end board
    else:
        board.end_grant(7, 42)  # the ended-grant word (a local end read by the loop, or the stream's thread)
    rt._run_grant(grant(7, start_ns=100, seconds=-0.001))
    msg = parked(manager)
    assert (msg.steps, msg.reason, msg.end_ns) == (0, by, 42)


def test_the_reference_policy_ignores_the_trainers_ends(tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # Its emulation must stay faithful: the reference system never sees a real end.
    manager, channel = channels
    rt, _, ends = worker(tmp_path, channel, CallsBack(lambda i: None))
    ends.record_end(RANK, 100, 42)
    rt._run_grant(grant(7, start_ns=100, seconds=0.02, trainer_ends=False))
    msg = parked(manager)
    assert msg.reason == "deadline" and msg.steps > 0


# ---------------------------------------------------------------- a bubble that outlives its deadline (issue 21)

MS = 10**6


def outlived(grant_id: int, survival_ns: tuple[int, ...], trainer_ends: bool = True) -> tuple[Grant, int]:
    """A grant whose deadline passed a millisecond ago, in a bubble that began 3 ms ago, and that bubble's start."""
    now = time.monotonic_ns()
    start = now - 3 * MS
    return Grant(grant_id, deadline_ns=now - MS, margin_ns=0, rank=RANK, bubble_start_ns=start,
                 trainer_ends=trainer_ends, survival_ns=survival_ns, grace_ns=MS // 2), start


def ends_at_step(box: dict[str, Any], step: int) -> Callable[[int], None]:
    """A hook that writes the trainer's end of the bubble started at ``box["start"]`` inside step ``step``."""
    def hook(i: int) -> None:
        if i == step:
            box["ends"].record_end(RANK, box["start"], time.monotonic_ns())
    return hook


def test_a_short_step_goes_on_past_the_deadline_until_the_trainers_end_while_its_slot_has_longer_lengths(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    manager, channel = channels
    box: dict[str, Any] = {}
    rt, _, box["ends"] = worker(tmp_path, channel, CallsBack(ends_at_step(box, 4)))
    g, box["start"] = outlived(7, survival_ns=(2 * MS, 60 * S))  # the slot has lasted a minute before
    rt._run_grant(g)
    msg = parked(manager)
    assert (msg.steps, msg.reason) == (5, "ended")


@pytest.mark.parametrize(("survival_ns", "trainer_ends"), [
    ((2 * MS, 60 * S), False),  # it cannot learn the real end: it keeps to its deadline
    ((MS, 2 * MS), True),  # 3 ms have passed: longer than any bubble of its slot before
], ids=["no-end-path", "longer-than-every-length"])
def test_a_grant_past_its_deadline_runs_no_step_where_nothing_says_the_bubble_goes_on(
        tmp_path: Path, channels: tuple[Channel, Channel], survival_ns: tuple[int, ...], trainer_ends: bool) -> None:
    manager, channel = channels
    rt, _, _ = worker(tmp_path, channel, CallsBack(lambda i: None))
    g, _ = outlived(7, survival_ns=survival_ns, trainer_ends=trainer_ends)
    rt._run_grant(g)
    msg = parked(manager)
    assert (msg.steps, msg.reason) == (0, "deadline")


@pytest.mark.parametrize(("survival_s", "steps"), [((0.002, 0.004), 0), ((0.002, 30.0, 60.0), 3)])
def test_a_step_longer_than_the_grace_is_sized_to_the_low_percentile_of_the_longer_lengths(
        tmp_path: Path, channels: tuple[Channel, Channel], survival_s: tuple[float, ...], steps: int) -> None:
    manager, channel = channels
    box: dict[str, Any] = {}
    rt, _, box["ends"] = worker(tmp_path, channel, CallsBack(ends_at_step(box, 2)))
    rt.estimator.extend([10 * MS] * 64)  # 10 ms steps: more than the grace
    g, box["start"] = outlived(7, survival_ns=tuple(int(s * S) for s in survival_s))
    rt._run_grant(g)
    # 4 ms is the only length left (1 ms away: no 10 ms step fits); with 30 s left, steps go on to the end.
    msg = parked(manager)
    assert msg.steps == steps


def test_a_step_the_end_came_during_is_timed_by_its_run_in_the_bubble_not_its_wait_for_the_core_after(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # A step running at a real end shares the core with the trainer (at nice 19: it hardly runs) until it
    # finishes or is frozen; timed to its end, it raised the task's p95 until short bubbles fitted no step.
    manager, channel = channels
    box: dict[str, Any] = {}

    def hook(i: int) -> None:
        if i == 1:
            box["ends"].record_end(RANK, 100, time.monotonic_ns())
            time.sleep(0.05)  # the trainer's compute: the step waits, using no CPU

    rt, _, box["ends"] = worker(tmp_path, channel, CallsBack(hook))
    rt._run_grant(grant(7, start_ns=100))
    msg = parked(manager)
    assert (msg.steps, msg.reason) == (2, "ended")
    assert msg.durations_ns[1] < 25 * MS  # its CPU time (a little); it waited 50 ms
    assert rt.estimator.estimate_ns() is not None and rt.estimator.estimate_ns() < 25 * MS


def test_the_board_says_when_the_running_step_began_and_nothing_between_steps(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # The manager, told of the end, freezes at once a step that began too late to end within the grace.
    manager, channel = channels
    box: dict[str, WorkerBoard] = {}
    seen: list[tuple[int, int]] = []

    def hook(i: int) -> None:
        seen.append((box["b"].step(), box["b"].step_began_ns()))
        if i == 2:
            box["b"].end_grant(7, 1)

    rt, board, _ = worker(tmp_path, channel, CallsBack(hook))
    box["b"] = board
    before = time.monotonic_ns()
    rt._run_grant(grant(7, start_ns=100))
    parked(manager)
    assert [step for step, _ in seen] == [0, 1, 2]
    began = [at for _, at in seen]
    assert before <= began[0] <= began[1] <= began[2] <= time.monotonic_ns()
    assert board.step_began_ns() == 0  # after the last step: none runs


def test_the_end_board_says_the_worker_holds_its_grants_bubble_from_its_first_step_until_it_parks(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # What the trainer reads at its end to stop a worker still holding its bubble (the end board's stop record).
    import struct

    from freeride._boards import END_RECORDS_BYTES

    manager, channel = channels
    box: dict[str, EndBoard] = {}
    seen: list[int] = []

    def holding() -> int:
        with open(tmp_path / "ends", "rb") as fh:
            fh.seek(END_RECORDS_BYTES + RANK * 32 + 16)
            return int(struct.unpack("<q", fh.read(8))[0])

    def hook(i: int) -> None:
        seen.append(holding())
        if i == 2:
            box["e"].record_end(RANK, 100, time.monotonic_ns())

    rt, _, ends = worker(tmp_path, channel, CallsBack(hook))
    box["e"] = ends
    rt._run_grant(grant(7, start_ns=100))
    parked(manager)
    assert seen == [1, 1, 1] and holding() == 0
    # A grant that does not follow the trainer's ends says nothing there.
    seen.clear()
    rt._run_grant(grant(8, start_ns=200, seconds=0.01, trainer_ends=False))
    parked(manager)
    assert seen and set(seen) == {0}


def test_no_step_begins_while_the_trainers_thread_that_shares_its_core_is_runnable(
        tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    # With each bubble's end stamped where the data came, the first rank's worker began steps after it in 1,120 of
    # 1,596 grants (1F1B, spin:50): the rank, runnable, waited up to 3.5 ms for the core the worker kept.
    import subprocess
    import sys
    import threading

    from freeride._boards import ThreadState

    manager, channel = channels
    go_r, go_w = os.pipe()
    rank = subprocess.Popen([sys.executable, "-c", f"import os\nos.read({go_r}, 1)\nwhile True: pass"],
                            pass_fds=(go_r,))
    box: dict[str, Any] = {}

    def hook(i: int) -> None:
        if i == 2:  # its data comes: the rank computes, and would need this core
            os.write(go_w, b"x")
            state = ThreadState(rank.pid)
            deadline = time.monotonic() + 10
            while not state.runnable():
                assert time.monotonic() < deadline, "the rank never ran"
                time.sleep(0.001)
            state.close()
            threading.Timer(0.05, lambda: box["ends"].record_end(RANK, 100, 4242)).start()  # its end, said later

    try:
        rt, _, ends = worker(tmp_path, channel, CallsBack(hook))
        box["ends"] = ends
        ends.set_trainer_thread(RANK, rank.pid)
        began = time.monotonic()
        rt._run_grant(grant(7, start_ns=100))
        msg = parked(manager)
        assert (msg.steps, msg.reason, msg.end_ns) == (3, "ended", 4242)  # none after the rank was runnable
        assert time.monotonic() - began >= 0.05
    finally:
        rank.kill()
        rank.wait()
        os.close(go_r)
        os.close(go_w)
