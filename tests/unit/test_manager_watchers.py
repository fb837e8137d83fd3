"""Live views on their own: a slow viewer loses events, never the loop's time; stopping ends every view."""

from __future__ import annotations

import pytest

from freeride._manager import watchers as W
from freeride.messages import TaskEvent


def test_a_full_viewer_loses_events_counted_and_the_others_get_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "QUEUE_EVENTS", 2)
    hub = W.Watchers()
    assert not hub.queues
    slow, fast = hub.subscribe(), hub.subscribe()
    assert len(hub.queues) == 2
    for i in range(2):
        hub.publish(TaskEvent(float(i)))
    fast.get_nowait()
    fast.get_nowait()
    hub.publish(TaskEvent(9.0))
    assert hub.dropped == 1 and fast.get_nowait() == TaskEvent(9.0) and slow.qsize() == 2
    hub.unsubscribe(slow)
    assert len(hub.queues) == 1


def test_stopping_ends_every_view_and_a_later_viewer_at_once() -> None:
    hub = W.Watchers()
    q = hub.subscribe()
    hub.close()
    assert q.get_nowait() is None
    assert hub.subscribe().get_nowait() is None
