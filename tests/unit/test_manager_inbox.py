"""The loop's inbox on its own: ingress from other threads, one wake-up per post, and backpressure."""

from __future__ import annotations

import select
import threading
from concurrent.futures import Future
from typing import Any

import pytest
from conftest import holds_for, wait_for

from freeride._manager.inbox import BUBBLES_PER_TURN, Inbox
from freeride.errors import ManagerUnavailable


def make(max_pending: int = 10) -> Inbox[tuple[Any, int]]:
    return Inbox(max_pending, lambda event, received_ns, job: (event, received_ns))


def readable(inbox: Inbox[Any]) -> bool:
    return bool(select.select([inbox.fileno()], [], [], 0)[0])


def test_a_post_wakes_the_loop_and_items_come_out_in_order() -> None:
    inbox = make()
    assert not readable(inbox) and not inbox.has_work()
    inbox.post("a")
    inbox.post("b")
    assert readable(inbox) and inbox.has_work()
    assert inbox.clear_wake() == [] and not readable(inbox)
    assert list(inbox.items()) == ["a", "b"] and not inbox.has_work()
    inbox.release()


def test_bubble_events_are_converted_on_the_posters_thread_and_chunked() -> None:
    inbox = make(max_pending=BUBBLES_PER_TURN * 4)
    assert inbox.post_bubbles(list(range(BUBBLES_PER_TURN + 3)), received_ns=7) == 0
    first, second = inbox.take_chunk(), inbox.take_chunk()
    assert first is not None and second is not None and inbox.take_chunk() is None
    assert len(first) == BUBBLES_PER_TURN and second == [(BUBBLES_PER_TURN + i, 7) for i in range(3)]
    assert inbox.received == BUBBLES_PER_TURN + 3
    inbox.release()


def test_a_stream_past_the_bound_waits_for_room_and_goes_on_when_the_loop_takes_some() -> None:
    inbox = make(max_pending=10)
    done: list[int] = []
    poster = threading.Thread(target=lambda: done.append(inbox.post_bubbles(list(range(15)), 0)), daemon=True)
    poster.start()
    wait_for(lambda: inbox.waiting_events() == 10)
    holds_for(lambda: poster.is_alive() and inbox.waiting_events() == 10, 0.2, "the poster waits at the bound")
    assert inbox.take_chunk() == [(i, 0) for i in range(10)]
    poster.join(10)
    assert done == [0] and inbox.take_chunk() == [(i, 0) for i in range(10, 15)]
    inbox.release()


def test_closing_fails_queued_calls_refuses_new_ones_and_counts_waiting_and_blocked_events_as_dropped() -> None:
    inbox = make(max_pending=4)
    queued = inbox.call_async("stats")
    inbox.post_bubbles([1, 2, 3, 4], 0)
    lost: list[int] = []
    blocked = threading.Thread(target=lambda: lost.append(inbox.post_bubbles([5, 6], 0)), daemon=True)
    blocked.start()
    holds_for(blocked.is_alive, 0.1, "the second message waits for room")
    inbox.close()
    blocked.join(10)
    assert lost == [2] and inbox.dropped == 6 and inbox.received == 6
    with pytest.raises(ManagerUnavailable, match="stopping"):
        queued.result(0)
    refused: Future[Any] = inbox.call_async("stats")
    with pytest.raises(ManagerUnavailable, match="stopping"):
        refused.result(0)
    inbox.release()
    inbox.post("late")  # after release nothing wakes, nothing raises
