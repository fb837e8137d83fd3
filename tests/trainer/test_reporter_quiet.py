"""A quiet slot's events wait on the training thread and go, marked late and in order, with the next other event."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import now_ns, wait_for
from test_reporter import FakeStream

from freeride._boards import EndBoard, end_board_path
from freeride._local_events import LocalEvents, decode, local_events_path, sent_late
from freeride.endpoints import Endpoint
from freeride.messages import BubbleEnd, BubbleStart, TrainerLayout
from freeride.training.reporter import MAX_HELD_EVENTS, QUIET_HOLD_NS, BubbleReporter

MS = 1_000_000
RANK = 5


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.endpoint = Endpoint("unix", str(tmp_path / "m.sock"))
        EndBoard.create(end_board_path(self.endpoint.address))
        self.board = EndBoard.open(end_board_path(self.endpoint.address), writable=True)  # the manager's
        self.local = LocalEvents(local_events_path(self.endpoint.address))
        self.wire: list = []
        self.reporter = BubbleReporter("cpu:0", stage=1, rank=RANK, endpoint=self.endpoint, backoff_initial_s=0.01,
                                       start=False)
        self.reporter._open_stream = (  # type: ignore[method-assign]
            lambda alive: FakeStream(self.reporter._batches(alive), self.wire, None))
        self.reporter._thread.start()
        wait_for(lambda: self.reporter._local is not None, 5, what="the reporter to open the local event socket")

    def read(self) -> list[tuple[object, bool]]:
        return [(decode(d), sent_late(d)) for d in self.local.read()]

    def bubble(self, iteration: int, slot: int, start: int, length: int = 100) -> None:
        self.reporter.bubble_start(iteration, slot, "fill", predicted_ns=MS, start_ns=start)
        self.reporter.bubble_end(iteration, slot, end_ns=start + length)

    def close(self) -> None:
        self.reporter.close()
        self.local.close()
        self.board.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    made = Rig(tmp_path)
    yield made
    made.close()


def _start(iteration: int, slot: int, at: int) -> BubbleStart:
    return BubbleStart(1, RANK, iteration, slot, "fill", at, MS)


def test_a_quiet_slots_events_wait_for_the_next_loud_one_and_go_first_marked_late(rig: Rig) -> None:
    rig.board.set_quiet(RANK, bytes([0, 1, 1]))  # slots 1 and 2 quiet
    t = now_ns()
    rig.bubble(1, 1, t)
    rig.bubble(1, 2, t + 1000)
    assert rig.read() == []  # held: nothing sent, no one woken
    assert rig.board.ended_ns(RANK, t + 1000) == t + 1100  # the end board is written at the end all the same
    rig.reporter.bubble_start(1, 0, "fill", predicted_ns=MS, start_ns=t + 2000)
    assert rig.read() == [
        (_start(1, 1, t), True), (BubbleEnd(1, RANK, 1, 1, t + 100), True),
        (_start(1, 2, t + 1000), True), (BubbleEnd(1, RANK, 1, 2, t + 1100), True),
        (_start(1, 0, t + 2000), False),
    ]
    counters = rig.reporter.counters()
    assert counters.local == counters.enqueued == 5 and counters.dropped == 0


def test_an_end_follows_its_start_whatever_the_board_says_meanwhile(rig: Rig) -> None:
    t = now_ns()
    rig.board.set_quiet(RANK, bytes([1]))
    rig.reporter.bubble_start(1, 0, "fill", predicted_ns=MS, start_ns=t)
    rig.board.set_quiet(RANK, b"")  # loud now: the held start's end is held too, never sent before it
    rig.reporter.bubble_end(1, 0, end_ns=t + 100)
    assert rig.read() == []
    rig.bubble(1, 1, t + 200)
    assert [e for e, _ in rig.read()] == [_start(1, 0, t), BubbleEnd(1, RANK, 1, 0, t + 100), _start(1, 1, t + 200),
                                         BubbleEnd(1, RANK, 1, 1, t + 300)]
    rig.reporter.bubble_start(2, 0, "fill", predicted_ns=MS, start_ns=t + 400)  # loud at its start ...
    rig.board.set_quiet(RANK, bytes([1]))
    rig.reporter.bubble_end(2, 0, end_ns=t + 500)  # ... so its end goes at once
    assert [late for _, late in rig.read()] == [False, False]


def test_held_events_go_once_the_first_is_old_enough_or_they_are_many(rig: Rig) -> None:
    rig.board.set_quiet(RANK, bytes([1]))
    t = now_ns()
    rig.bubble(1, 0, t)
    rig.bubble(2, 0, t + QUIET_HOLD_NS - 200)
    assert rig.read() == []
    rig.reporter.bubble_start(3, 0, "fill", predicted_ns=MS, start_ns=t + QUIET_HOLD_NS)
    assert len(rig.read()) == 5  # the bound reached: everything held goes, the last too
    for i in range(MAX_HELD_EVENTS // 2):
        rig.bubble(10 + i, 0, t + QUIET_HOLD_NS + 1000 * (i + 1))
    got = rig.read()
    assert len(got) == MAX_HELD_EVENTS and all(late for _, late in got)


def test_closing_sends_what_is_held(rig: Rig) -> None:
    rig.board.set_quiet(RANK, bytes([1]))
    t = now_ns()
    rig.bubble(1, 0, t)
    rig.reporter.close()
    assert [e for e, _ in rig.read()] == [_start(1, 0, t), BubbleEnd(1, RANK, 1, 0, t + 100)]


def test_a_layout_never_overtakes_held_events(rig: Rig) -> None:
    rig.board.set_quiet(RANK, bytes([1]))
    t = now_ns()
    rig.bubble(1, 0, t)
    rig.reporter.report_layout("1F1B", stages=2, microbatches=4, at_ns=t + 200)
    got = [e for e, _ in rig.read()]
    assert got[:2] == [_start(1, 0, t), BubbleEnd(1, RANK, 1, 0, t + 100)] and isinstance(got[2], TrainerLayout)


def test_another_ranks_quiet_slots_and_slots_past_the_board_are_loud(rig: Rig) -> None:
    rig.board.set_quiet(RANK + 1, bytes([1]))
    t = now_ns()
    rig.bubble(1, 0, t)
    rig.bubble(1, 5000, t + 200)  # past the board's slots
    assert [late for _, late in rig.read()] == [False] * 4


def test_held_events_whose_socket_failed_go_over_the_wire_in_order(rig: Rig) -> None:
    rig.board.set_quiet(RANK, bytes([1]))
    t = now_ns()
    rig.bubble(1, 0, t)
    rig.local.close()  # the manager is gone
    rig.reporter.bubble_start(1, 1, "fill", predicted_ns=MS, start_ns=t + 200)
    wait_for(lambda: len(rig.wire) == 3, 5, what="the wire to carry the held events and the next")
    assert rig.wire == [_start(1, 0, t), BubbleEnd(1, RANK, 1, 0, t + 100), _start(1, 1, t + 200)]
