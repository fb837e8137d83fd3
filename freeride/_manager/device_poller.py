"""The device poller: reads the device off the manager loop's thread and posts what it read.

NVML calls take tens of microseconds to milliseconds (and can hang for longer when a GPU is in
trouble); the loop owns the bubble-start-to-grant path and must never wait on them. So one thread
reads the device every ``memory_poll_ms`` (each watched task's usage) and ``device_poll_ms`` (free
memory), and posts core events to the loop: :class:`~freeride._manager.core.TaskMemorySampled`,
:class:`~freeride._manager.core.DeviceMemorySampled`, and
:class:`~freeride._manager.core.DeviceStatusChanged` when the device stops or starts answering. A
device error is a state, never an exception that leaves this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from freeride._manager import core as C
from freeride.devices import Device

log = logging.getLogger(__name__)


class DevicePoller:
    """Samples ``device`` on its own thread; ``post`` receives core events (thread-safe, non-blocking)."""

    def __init__(self, device: Device, post: Callable[[Any], None], memory_poll_ms: float,
                 device_poll_ms: float) -> None:
        self.device = device
        self._post = post
        self._memory_period_s = memory_poll_ms / 1000.0
        self._device_period_s = device_poll_ms / 1000.0
        self._watched: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.problem = ""
        self.samples = 0
        #: Set once the first reading is posted: the daemon waits for it (briefly) before it serves, so
        #: a new manager answers its first requests with a memory budget.
        self.first_reading = threading.Event()

    def watch(self, task_id: str, pids: Sequence[int]) -> None:
        """Sample these processes as ``task_id`` from now on (replaces its earlier list)."""
        with self._lock:
            self._watched[task_id] = tuple(pids)

    def forget(self, task_id: str) -> None:
        with self._lock:
            self._watched.pop(task_id, None)

    def start(self) -> None:
        """Start sampling (once; later calls do nothing)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"device-{self.device.name.slug}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def poll_once(self, *, free: bool = True) -> None:
        """One reading, posted (the thread's body; also called directly by tests)."""
        with self._lock:
            watched = dict(self._watched)
        sample = self.device.sample(watched, free=free)
        self.samples += 1
        if sample.error:
            if sample.error != self.problem:
                log.error("[%s] the device cannot be read: %s", self.device, sample.error)
                self.problem = sample.error
                self._post(C.DeviceStatusChanged(sample.error))
            return
        if self.problem:
            log.warning("[%s] the device answers again", self.device)
            self.problem = ""
            self._post(C.DeviceStatusChanged(""))
        for task_id, used in sample.task_bytes.items():
            self._post(C.TaskMemorySampled(task_id, used, sample.host_bytes.get(task_id, -1)))
        if sample.free_bytes is not None:
            self._post(C.DeviceMemorySampled(sample.free_bytes))

    def _run(self) -> None:
        next_free = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            free = now >= next_free
            if free:
                next_free = now + self._device_period_s
            try:
                self.poll_once(free=free)
            except Exception:  # a bug here must not end the sampling, and never the manager
                log.exception("[%s] device poll failed", self.device)
            self.first_reading.set()
            self._wake.wait(self._memory_period_s)
