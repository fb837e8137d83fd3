"""The manager's memory stays bounded under a flood: its queues hold back or drop, and count.

These drive a real :class:`ManagerLoop` (own thread, real eventfd and store, no gRPC) with the
calls its servicers make, so a flood can be started and stopped exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices, holds_for, now_ns, wait_for

from freeride._manager import core as C
from freeride._manager.loop import LoopConfig, ManagerLoop, with_ends_known
from freeride.devices import open_device
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart

MS = 1_000_000
BOUND = 64


def pairs(first: int, n: int) -> list[BubbleEvent]:
    """Start/end pairs 10 ns apart, in the host clock's recent past."""
    t0 = now_ns() - (first + n) * 10 - MS
    out: list[BubbleEvent] = []
    for it in range(first, first + n):
        out.append(BubbleStart(0, 0, it, 0, "flood", t0 + it * 10, MS, -1))
        out.append(BubbleEnd(0, 0, it, 0, t0 + it * 10 + 5))
    return out


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[ManagerLoop]:
    config = LoopConfig(state_dir=tmp_path / "state", max_pending_events=BOUND)
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), config)
    yield loop
    loop.stop()


def recorder(loop: ManagerLoop) -> list[BubbleEvent]:
    seen: list[BubbleEvent] = []
    original = loop.core.on_event

    def recording(event: C.Event, now_ns: int) -> list[C.Action]:
        if isinstance(event, (C.BubbleStarted, C.BubbleEnded)):
            seen.append(event.bubble)
        return original(event, now_ns)

    loop.core.on_event = recording  # type: ignore[method-assign]
    return seen


def waiting_events(loop: ManagerLoop) -> int:
    return loop.inbox.waiting_events()


def test_flood_is_held_back_at_the_bound_then_every_event_is_handled_in_order(loop: ManagerLoop) -> None:
    handed = recorder(loop)
    events = pairs(0, 500)  # 1000 events in messages of 20, far past the bound
    flooder = threading.Thread(
        target=lambda: [loop.post_bubbles(events[i:i + 20], now_ns()) for i in range(0, len(events), 20)], daemon=True
    )
    flooder.start()
    wait_for(lambda: waiting_events(loop) > BOUND - 20)
    # The loop is not running: the flood waits for room instead of growing the inbox.
    holds_for(lambda: flooder.is_alive() and waiting_events(loop) <= BOUND, 0.3,
              "the flooder stays blocked with the inbox at its bound")
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    flooder.join(20)
    assert not flooder.is_alive()
    wait_for(lambda: len(handed) == len(events))
    assert handed == events
    assert loop.events_dropped == 0
    assert loop.event_delay.count == len(events)
    loop.stop()
    runner.join(10)


def test_a_batch_larger_than_the_bound_goes_in_chunks_that_fit(loop: ManagerLoop) -> None:
    handed = recorder(loop)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    events = pairs(0, 5 * BOUND)
    assert loop.post_bubbles(events, now_ns()) == 0
    wait_for(lambda: len(handed) == len(events))
    assert handed == events
    loop.stop()
    runner.join(10)


def test_a_stream_waiting_for_room_gives_up_counted_when_the_loop_stops(loop: ManagerLoop) -> None:
    loop.post_bubbles(pairs(0, BOUND // 2), now_ns())  # the inbox is full; nobody drains it
    lost: list[int] = []
    waiter = threading.Thread(target=lambda: lost.append(loop.post_bubbles(pairs(100, 3), now_ns())), daemon=True)
    waiter.start()
    holds_for(waiter.is_alive, 0.3, "the stream stays blocked waiting for room")
    runner = threading.Thread(target=loop.run, daemon=True)
    loop.stop()  # queued ahead of the bubbles: the loop stops before it gets to them
    runner.start()
    waiter.join(10)
    runner.join(10)
    assert lost == [6]
    assert loop.events_dropped == BOUND + 6  # the stopped loop's leftovers are counted too
    assert loop.events_received == BOUND + 6


def test_slow_watch_viewer_loses_the_overflow_counted_and_the_loop_goes_on(loop: ManagerLoop) -> None:
    handed = recorder(loop)
    viewer = loop.subscribe()  # never read
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    events = pairs(0, 5_030)  # 10,060 live-view bubble events for a queue of 10,000
    for i in range(0, len(events), 500):
        loop.post_bubbles(events[i:i + 500], now_ns())
    wait_for(lambda: len(handed) == len(events))
    assert viewer.qsize() == viewer.maxsize == 10_000
    assert loop.watch_events_dropped == len(events) - 10_000
    loop.stop()
    runner.join(10)


def test_a_start_read_together_with_its_end_reaches_the_core_with_that_end(loop: ManagerLoop) -> None:
    starts: list[C.BubbleStarted] = []
    original = loop.core.on_event

    def recording(event: C.Event, now_ns: int) -> list[C.Action]:
        if isinstance(event, C.BubbleStarted):
            starts.append(event)
        return original(event, now_ns)

    loop.core.on_event = recording  # type: ignore[method-assign]
    over, late = pairs(0, 2)[:2], pairs(1, 1)[0]  # one bubble whole, then only the next one's start
    loop.post_bubbles([*over, late], now_ns())
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    wait_for(lambda: len(starts) == 2)
    assert [s.end_ns for s in starts] == [over[1].end_ns, 0]  # type: ignore[union-attr]
    loop.stop()
    runner.join(10)


def test_only_a_start_whose_end_follows_in_the_same_read_carries_it() -> None:
    t = now_ns() - MS
    start, end = BubbleStart(0, 0, 7, 1, "steady", t, MS, -1), BubbleEnd(0, 0, 7, 1, t + 10)
    other = BubbleStart(0, 0, 7, 2, "steady", t + 20, MS, -1)
    backwards = BubbleEnd(0, 0, 7, 2, t + 5)  # an end before its start: the core ignores it, so no grant hangs on it
    given = with_ends_known([C.BubbleStarted(start, t), C.BubbleEnded(end, t), C.BubbleStarted(other, t),
                             C.BubbleEnded(backwards, t)])
    assert [getattr(e, "end_ns", None) for e in given] == [t + 10, None, 0, None]
    assert with_ends_known([C.BubbleStarted(other, t)]) == [C.BubbleStarted(other, t)]
