"""A local trainer's event datagrams (``freeride._local_events``), the end fast path that turns a local end
into an end seen (``_manager/ends.py``), and the loop's exact timer (``_manager/timer.py``)."""

from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path

import pytest

from freeride._boards import WorkerBoard
from freeride._local_events import MAX_DATAGRAM, LocalEvents, LocalEventSender, decode, encode
from freeride._manager import core as C
from freeride._manager.ends import EndPath
from freeride._manager.timer import make_timer
from freeride.errors import ConfigError
from freeride.messages import BubbleEnd, BubbleStart, TrainerLayout

KEY = (1, 0, 5, 2)

EVENTS = [
    BubbleStart(1, 0, 5, 2, "fwd-recv · ünïcode", 1_000, 2_000_000, 16 * 2**30, learned=True),
    BubbleEnd(1, 0, 5, 2, 1_500_000),
    TrainerLayout("Interleaved1F1B", 4, 8, ("cuda:0", "node-b/cuda:1"), 3_000, 2**30, job="run-7"),
    TrainerLayout("", 2, 2, (), 4_000, -1),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_crosses_a_datagram_whole(event: object) -> None:
    assert decode(encode(event)) == event  # type: ignore[arg-type]


def test_the_senders_packing_of_hot_events_is_the_encoders() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = LocalEventSender.__new__(LocalEventSender)
    sender._sock, sender._send = a, a.send
    start, end = EVENTS[0], EVENTS[1]
    assert isinstance(start, BubbleStart) and isinstance(end, BubbleEnd)
    assert sender.send_start(start.stage, start.rank, start.iteration, start.slot, start.kind, start.start_ns,
                             start.predicted_ns, start.free_memory_bytes, start.learned)
    assert sender.send_end(end.stage, end.rank, end.iteration, end.slot, end.end_ns)
    assert [b.recv(MAX_DATAGRAM), b.recv(MAX_DATAGRAM)] == [encode(start), encode(end)]
    a.close()
    b.close()


def test_a_layout_datagram_from_before_jobs_reads_as_one_of_no_known_job() -> None:
    old = encode(EVENTS[2]).replace(b', "run-7"]', b"]")
    assert decode(old) == TrainerLayout("Interleaved1F1B", 4, 8, ("cuda:0", "node-b/cuda:1"), 3_000, 2**30)


@pytest.mark.parametrize("data, why", [
    (b"", "empty"),
    (b"\x09" + bytes(40), "tag 9"),
    (encode(EVENTS[1])[:-1], "tag 2"),  # an end one byte short
    (encode(EVENTS[1]) + b"x", "tag 2"),  # an end with a byte too many
    (encode(EVENTS[0])[:20], "tag 1"),  # a start cut short
    (encode(EVENTS[0]).replace("ünïcode".encode(), b"\xff\xfe"), "UTF-8"),
    (encode(EVENTS[2])[:-3], "malformed"),  # a layout whose JSON is cut
    (encode(EVENTS[3]).replace(b'["", [], ""]', b'{"a": 1}'), "must be"),  # not a list
    (encode(EVENTS[3]).replace(b'["", [], ""]', b'[1, ["x"], ""]'), "must be"),
    (encode(EVENTS[3]).replace(b'["", [], ""]', b'["s", [2], ""]'), "must be"),
    (encode(EVENTS[3]).replace(b'["", [], ""]', b'["s", [], 7]'), "must be"),  # a job that is no text
    (encode(EVENTS[3]).replace(b'["", [], ""]', b'["s", [], "", 1]'), "must be"),  # one item too many
])
def test_a_datagram_that_is_no_event_says_why(data: bytes, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        decode(data)


def test_datagrams_arrive_whole_and_in_order_on_an_owner_only_socket(tmp_path: Path) -> None:
    local = LocalEvents(tmp_path / "e")
    sender = LocalEventSender(tmp_path / "e")
    assert local.read() == []
    for i in range(300):
        assert sender.send_end(0, 0, i, 0, 10 + i)
    assert sender.send(EVENTS[2])
    got = [decode(d) for d in local.read()]
    assert got == [BubbleEnd(0, 0, i, 0, 10 + i) for i in range(300)] + [EVENTS[2]]
    assert oct(os.stat(tmp_path / "e").st_mode & 0o777) == "0o600"
    local.close()
    assert not (tmp_path / "e").exists()


def test_each_trainer_has_its_own_connection_closed_when_it_goes_and_extra_ones_are_refused(tmp_path: Path) -> None:
    local = LocalEvents(tmp_path / "e")
    a, b = LocalEventSender(tmp_path / "e"), LocalEventSender(tmp_path / "e")
    for i in range(3):
        assert a.send_end(0, 0, i, 0, 10 + i) and b.send_end(0, 1, i, 0, 10 + i)
    got = [decode(d) for d in local.read()]
    assert [e for e in got if e.rank == 0] == [BubbleEnd(0, 0, i, 0, 10 + i) for i in range(3)]
    assert [e for e in got if e.rank == 1] == [BubbleEnd(0, 1, i, 0, 10 + i) for i in range(3)]
    assert local.connections == 2
    a.close()
    assert local.read() == [] and local.connections == 1
    assert select.select([local], [], [], 0)[0] == []  # nothing left to read: the loop is not woken again
    assert b.send_end(0, 1, 3, 0, 13)
    assert select.select([local], [], [], 0)[0] == [local]
    assert [decode(d) for d in local.read()] == [BubbleEnd(0, 1, 3, 0, 13)]
    local.MAX_CONNECTIONS = 2
    extra = [LocalEventSender(tmp_path / "e") for _ in range(2)]
    local.read()
    assert local.connections == 2 and local.refused == 1
    assert not any(s.send_end(0, 2, 0, 0, 1) for s in extra[1:])  # the refused one learns it at its next send
    local.close()
    assert not b.send_end(0, 1, 4, 0, 14)


def test_sending_to_a_manager_that_fell_behind_or_died_answers_false_and_never_raises(tmp_path: Path) -> None:
    local = LocalEvents(tmp_path / "e")
    sender = LocalEventSender(tmp_path / "e")
    results = [sender.send_end(0, 0, i, 0, 10 + i) for i in range(5000)]  # far past the socket's queue
    assert results[0] and not results[-1]
    assert not sender.send_start(0, 0, 0, 0, "k" * (MAX_DATAGRAM + 1), 1, 1, 1, False)  # too long: the wire
    assert not sender.send_end(0, 0, 2**70, 0, 1)  # out of range: the wire says why
    local.close()  # the manager is gone
    assert not sender.send_end(0, 0, 0, 0, 1)
    assert not sender.send(EVENTS[2])
    sender.close()


def test_only_the_published_grants_bubble_becomes_an_end_seen_and_sets_its_word(tmp_path: Path) -> None:
    path = EndPath(lambda: 0)
    end = BubbleEnd(*KEY, 2_000)
    assert path.local_end(end, 0) == []  # nothing published
    board = WorkerBoard.create(tmp_path / "board")
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    assert path.local_end(BubbleEnd(1, 1, 5, 2, 2_000), 0) == []  # another rank
    assert path.local_end(BubbleEnd(1, 0, 5, 3, 2_000), 0) == []  # another slot
    assert path.local_end(BubbleEnd(*KEY, 900), 0) == []  # an end before the grant's bubble began
    assert board.ended_grant() < 7
    assert path.local_end(end, 0) == [C.TrainerEndSeen("t", 7, 2_000)]
    assert (board.ended_grant(), board.ended_at_ns()) == (7, 2_000)
    assert path.end_to_worker_ms().count == 1
    board.close()  # the worker died and was reaped while armed: the end is still answered
    assert path.local_end(end, 0) == [C.TrainerEndSeen("t", 7, 2_000)]
    path.reported(7)  # the worker reported the grant's steps: nothing is held any more
    assert path.local_end(end, 0) == []


def test_the_timer_wakes_a_select_at_its_time_not_at_the_next_millisecond() -> None:
    timer = make_timer()
    assert timer is not None
    try:
        assert select.select([timer], [], [], 0)[0] == []
        timer.arm(time.monotonic_ns() - 1)  # past: readable at once
        assert select.select([timer], [], [], 1)[0] == [timer]
        timer.clear()
        timer.arm(time.monotonic_ns() + 3_600 * 10**9)
        assert select.select([timer], [], [], 0)[0] == []
        timer.arm(None)  # disarmed
        assert select.select([timer], [], [], 0)[0] == []
    finally:
        timer.close()
