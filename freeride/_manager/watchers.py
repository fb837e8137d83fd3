"""Live views (``Control.Watch``): task changes and bubbles, published by the loop to every viewer.

Each viewer has a bounded queue; the loop never waits on one: a slow viewer loses events (counted),
never the manager's time. A viewer's queue ends with None when the manager stops, at once for a
viewer that subscribes after that.
"""

from __future__ import annotations

import queue
import threading

from freeride.messages import TaskEvent

#: Events a viewer may be behind by before it loses some.
QUEUE_EVENTS = 10_000


class Watchers:
    def __init__(self) -> None:
        #: The viewers' queues: the loop tests this list's truth (no call) before it builds an event.
        self.queues: list[queue.Queue[TaskEvent | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        #: Events a slow viewer's full queue did not take.
        self.dropped = 0

    def subscribe(self) -> queue.Queue[TaskEvent | None]:
        q: queue.Queue[TaskEvent | None] = queue.Queue(maxsize=QUEUE_EVENTS)
        with self._lock:
            if self._closed:
                q.put_nowait(None)
            else:
                self.queues.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[TaskEvent | None]) -> None:
        with self._lock:
            if q in self.queues:
                self.queues.remove(q)

    def publish(self, event: TaskEvent) -> None:
        with self._lock:
            for q in self.queues:
                try:
                    q.put_nowait(event)
                except queue.Full:
                    self.dropped += 1

    def close(self) -> None:
        """End every viewer's queue; later subscribers get an ended queue at once."""
        with self._lock:
            self._closed = True
            for q in self.queues:
                try:
                    q.put_nowait(None)
                except queue.Full:
                    pass
