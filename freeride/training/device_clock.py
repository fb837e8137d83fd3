"""Device time for bubbles: when a stage's GPU stream really ran out of work, and when it resumed.

On a GPU the trainer's host thread runs ahead of the device: ``forward_one_chunk`` returns once its
kernels are queued, and with NCCL the pipeline's receive wait makes the *stream* wait, not the host.
Host timestamps around actions then measure microseconds of launch overhead, not the idle GPU. So on
CUDA :class:`~freeride.training.instrument.InstrumentedSchedule` does not read the host clock in its
hooks: it records a CUDA event on the stage's current stream at each hook (``mark``) and carries on.
An event recorded where an action ends completes when that action's kernels are done, i.e. when the
stream runs out of work; one recorded where the next action begins (after the receive's stream wait)
completes when compute can resume. Those two completions are the bubble, as the device saw it.

:class:`CudaEventClock` resolves the events on a thread of its own, in order: it waits for each (the
events are blocking-sync events, so the wait sleeps instead of spinning a core, and it releases the
GIL) and converts its device timestamp to the host's ``CLOCK_MONOTONIC`` through an *anchor*: an
event recorded on a private, idle stream at a known host time, taken anew every ``anchor_interval_s``
so that the two clocks cannot drift apart. A bubble's start is reported as soon as the event that
opens it completes, its end as soon as the one that closes it does. The training thread never
synchronizes and never waits: a mark costs one ``cudaEventRecord`` and a queue append. What it costs
the trainer is measured in ``bench/gpu``.

:class:`HostClock` is the CPU's: compute runs on the calling thread, so the host clock is the device's
and marks are resolved at once, inline. Both deliver ``(payload, time_ns)`` to one consumer, in the
order the marks were made; tests drive the consumer through a fake clock with chosen device times.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

Consumer = Callable[[Any, int], None]


class MarkClock(Protocol):
    """Stamps points of a stage's compute stream and hands them to the consumer in order."""

    #: True when :meth:`mark` delivers at once (the host clock): results of an iteration are complete
    #: when its last mark returns.
    synchronous: bool

    def mark(self, payload: Any) -> None:
        """Stamp now (in stream order) and, once the time is known, call the consumer with it."""
        ...

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every mark made so far was delivered (never on the training path); True if so."""
        ...

    def close(self) -> None: ...


class HostClock:
    """CPU: the host clock is the device's; every mark is delivered inline."""

    synchronous = True

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def mark(self, payload: Any) -> None:
        self._consumer(payload, time.monotonic_ns())

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass


_STOP = object()


class CudaEventClock:
    """CUDA: marks are events on the current stream, resolved to host times on a thread (module doc)."""

    synchronous = False

    def __init__(self, consumer: Consumer, device_index: int, anchor_interval_s: float = 0.5,
                 max_pending: int = 65536) -> None:
        import torch

        self._torch = torch
        self._device = device_index
        self._consumer = consumer
        self._anchor_interval_ns = int(anchor_interval_s * 1e9)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._free: list[Any] = []  # finished events, reused: recording one allocates nothing new
        self._free_lock = threading.Lock()
        self._anchor_stream = torch.cuda.Stream(device=device_index)
        self._anchor: tuple[Any, int] = self._new_anchor()
        self._anchor_at = time.monotonic_ns()
        self.dropped = 0  # marks not taken because the resolver fell max_pending behind
        self.resolved = 0
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=f"freeride-device-clock-{device_index}", daemon=True)
        self._thread.start()

    def _event(self) -> Any:
        with self._free_lock:
            if self._free:
                return self._free.pop()
        return self._torch.cuda.Event(enable_timing=True, blocking=True)

    def mark(self, payload: Any) -> None:
        event = self._event()
        event.record(self._torch.cuda.current_stream(self._device))
        self._idle.clear()
        try:
            self._queue.put_nowait((event, payload))
        except queue.Full:  # the trainer never waits for us: the mark is lost, and counted
            self.dropped += 1

    def _new_anchor(self) -> tuple[Any, int]:
        """An event on the private stream, which is idle, so it completes right after it is recorded."""
        anchor = self._torch.cuda.Event(enable_timing=True, blocking=True)
        anchor.record(self._anchor_stream)
        host_ns = time.monotonic_ns()
        anchor.synchronize()
        return anchor, host_ns

    def _to_host(self, event: Any) -> int:
        anchor, host_ns = self._anchor
        return host_ns + round(anchor.elapsed_time(event) * 1e6)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                self._idle.set()
                continue
            if item is _STOP:
                self._idle.set()
                return
            event, payload = item
            try:
                event.synchronize()  # sleeps (blocking-sync event), without the GIL
                now = time.monotonic_ns()
                if now - self._anchor_at >= self._anchor_interval_ns:
                    self._anchor, self._anchor_at = self._new_anchor(), now
                at_ns = self._to_host(event)
            except Exception:  # noqa: BLE001 - a CUDA error here must not reach the trainer
                log.exception("device clock: an event could not be resolved; its mark is dropped")
                self.dropped += 1
                continue
            with self._free_lock:
                self._free.append(event)
            self.resolved += 1
            try:
                self._consumer(payload, at_ns)
            except Exception:  # noqa: BLE001
                log.exception("device clock: the consumer failed on %r", payload)
            if self._queue.empty():
                self._idle.set()

    def flush(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not (self._queue.empty() and self._idle.wait(0.01)):
            if time.monotonic() > deadline:
                return False
        return True

    def close(self) -> None:
        self.flush()
        self._queue.put(_STOP)
        self._thread.join(5)
