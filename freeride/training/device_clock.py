"""Device time for bubbles: when a stage's GPU stream really ran out of work, and when it resumed.

On a GPU the trainer's host thread runs ahead of the device: ``forward_one_chunk`` returns once its
kernels are queued, and with NCCL the pipeline's receive wait makes the *stream* wait, not the host.
Host timestamps around actions then measure microseconds of launch overhead, not the idle GPU. So on
CUDA :class:`~freeride.training.instrument.InstrumentedSchedule` does not read the host clock in its
hooks: it records a CUDA event on the stage's current stream at each hook (``mark``) and carries on.
An event recorded where an action ends completes when that action's kernels are done, i.e. when the
stream runs out of work; one recorded where the next action begins (after the receive's stream wait)
completes when compute can resume. Those two completions are the bubble, as the device saw it.

:class:`CudaEventClock` resolves the events on a thread of its own, in order: it asks each whether it
is done (a query keeps the GIL) and waits only for one that is not (the events are blocking-sync events,
so the wait sleeps instead of spinning a core, and it releases the GIL), and converts its device
timestamp to the host's ``CLOCK_MONOTONIC`` through an *anchor*. The
training thread never synchronizes and never waits: a mark costs a capture check, the current stream,
one ``cudaEventRecord`` and a deque append. The resolver is woken only when it sleeps for want of marks
(it usually waits on an earlier event, the host being ahead), so a mark takes no lock and signals no
condition. What it costs the trainer is measured in ``bench/gpu`` (``bubble_timing``, call by call).

**Anchors.** An anchor is an event recorded on a private stream (created with the driver, not taken
from torch's pool, which other code, NCCL's streams among them, draws from too) and polled to its
completion, with the host clock read just before it was recorded and just after it completed: its
device time lies in that window, and the anchor stands for the window's middle. Where all streams
share one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, as Megatron-style trainers set), an
anchor waits behind everything the host has queued before it: the window is then long, and such an
anchor is refused (converted times would come early by that backlog); the last good one is kept and
a new one tried later. Anchors are renewed every ``anchor_interval_s`` so that the two clocks cannot
drift apart; :attr:`CudaEventClock.anchor_window_ns` is the error bound of the one in use.

**CUDA graphs.** A trainer may capture its step into a CUDA graph (``torch.cuda.graph``, whose default
capture mode is "global", or ``torch.compile(mode="reduce-overhead")``). In global mode, a call such as
``cudaEventQuery`` or ``cudaEventSynchronize`` from *any* thread while the capture runs invalidates it
(PyTorch's own NCCL watchdog did this: pytorch/pytorch#104487). So the resolver thread puts itself in
thread-local capture mode before its first CUDA call (as PyTorch's watchdog does since #148594): its
calls are then checked only against captures of its own thread, of which it has none. And a mark made
while the current stream is capturing is not recorded (an event recorded into a capture cannot be
waited for); it is counted in :attr:`CudaEventClock.skipped_in_capture`.

:class:`HostClock` is the CPU's: compute runs on the calling thread, so the host clock is the device's
and marks are resolved at once, inline. Both deliver ``(payload, time_ns)`` to one consumer, in the
order the marks were made; tests drive the consumer through a fake device with chosen times.
"""

from __future__ import annotations

import collections
import ctypes
import logging
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


class ClockDevice(Protocol):
    """What :class:`CudaEventClock` asks of torch.cuda and the driver. Real: :class:`TorchClockDevice`.

    Events are timing, blocking-sync events: ``record(stream)``, ``query()``, ``synchronize()``,
    ``elapsed_time(later) -> ms``.
    """

    def new_event(self) -> Any: ...

    def current_stream(self) -> Any:
        """The calling thread's current stream on the clock's device."""
        ...

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a CUDA graph."""
        ...

    def private_stream(self) -> Any:
        """A stream no other code uses (not one of torch's pool), at the highest priority."""
        ...

    def release_stream(self, stream: Any) -> None: ...

    def thread_local_capture_mode(self) -> bool:
        """Put the calling thread in thread-local stream-capture mode; False where that is not possible."""
        ...


_STOP = object()
#: An anchor whose window (host time before its record to host time after its completion) is longer is
#: refused: it waited behind queued work, and would make converted times early by that wait.
ANCHOR_WINDOW_NS = 200_000
#: How long an anchor is polled before it counts as waiting behind a backlog.
_ANCHOR_SPIN_NS = 2_000_000
#: After a refused anchor, the next is tried no sooner than this.
_ANCHOR_RETRY_NS = 20_000_000
_FIRST_ANCHOR_TRIES = 5
#: How long the resolver sleeps with nothing pending before it looks again (a mark wakes it sooner).
_IDLE_WAIT_S = 0.05


class CudaEventClock:
    """CUDA: marks are events on the current stream, resolved to host times on a thread (module doc).

    ``device`` replaces torch.cuda and the driver (tests: ``tests/gpu_fakes.FakeTorchCuda``).
    """

    synchronous = False

    def __init__(self, consumer: Consumer, device_index: int, anchor_interval_s: float = 0.5,
                 max_pending: int = 65536, *, device: ClockDevice | None = None,
                 anchor_window_ns: int = ANCHOR_WINDOW_NS) -> None:
        self._dev: ClockDevice = device if device is not None else TorchClockDevice(device_index)
        self._device_index = device_index
        self._consumer = consumer
        self._anchor_interval_ns = int(anchor_interval_s * 1e9)
        self._anchor_window_limit_ns = anchor_window_ns
        # Marks waiting for the resolver, oldest first. A deque's append and popleft are atomic, so the marking
        # thread takes no lock; it wakes the resolver only when that one said it sleeps (``_idle``).
        self._pending: collections.deque[Any] = collections.deque()
        self._max_pending = max_pending
        self._idle = False  # the resolver found nothing pending and waits on ``_wake``
        self._wake = threading.Event()
        # Finished events, reused: recording one allocates nothing new (the resolver appends, the marking
        # thread pops; both atomic).
        self._free: list[Any] = []
        self._anchor: tuple[Any, int] | None = None  # (event, host ns of its device time)
        self._next_anchor_ns = 0
        #: Half the window of the anchor in use: the most a converted time can be off by it (ns).
        self.anchor_window_ns = 0
        self.anchors = 0  # anchors taken
        self.anchors_refused = 0  # anchors whose window was too long (they waited behind queued work)
        self.dropped = 0  # marks not taken because the resolver fell max_pending behind, or unresolvable
        self.skipped_in_capture = 0  # marks made while the current stream was capturing a CUDA graph
        self.resolved = 0
        self.capture_safe = False  # the resolver thread is in thread-local capture mode
        self._queued = 0  # marks queued (training thread)
        self._settled = 0  # marks delivered or dropped (resolver thread)
        self._settled_cond = threading.Condition()
        self._flushers = 0  # threads in flush(), counted under the condition: only they need a notify
        self._stopping = False
        self._stream = self._dev.private_stream()
        self._thread = threading.Thread(target=self._run, name=f"freeride-device-clock-{device_index}", daemon=True)
        self._thread.start()

    @property
    def marks(self) -> int:
        """Marks taken so far (recorded and queued for the resolver; not those dropped or skipped)."""
        return self._queued

    def mark(self, payload: Any) -> None:
        dev = self._dev
        if dev.capturing():  # an event recorded into a capture cannot be waited for
            self.skipped_in_capture += 1
            return
        pending = self._pending
        if len(pending) >= self._max_pending:  # the trainer never waits for us: the mark is lost, and counted
            self.dropped += 1
            return
        try:
            event = self._free.pop()
        except IndexError:
            event = dev.new_event()
        event.record(dev.current_stream())
        pending.append((event, payload))
        self._queued += 1  # only the marking thread writes it
        if self._idle:  # read after the append: a resolver that said it sleeps after it sees the mark itself
            self._wake.set()

    # ------------------------------------------------------------------ the resolver thread

    def _take_anchor(self) -> bool:
        """A new anchor, if its window is short enough (see the module doc); True if taken."""
        event = self._dev.new_event()
        before = time.monotonic_ns()
        event.record(self._stream)
        after = before
        while not event.query():  # polled, not slept on: a blocking wait's wake-up would widen the window
            after = time.monotonic_ns()
            if after - before > _ANCHOR_SPIN_NS:
                event.synchronize()
                after = time.monotonic_ns()
                break
        else:
            after = time.monotonic_ns()
        window = after - before
        if self._anchor is not None and window > self._anchor_window_limit_ns:
            self.anchors_refused += 1
            return False
        if window > self._anchor_window_limit_ns:
            # No anchor at all yet: this one is the best there is; it is replaced at the first good one.
            self.anchors_refused += 1
            log.info("device clock: first anchor waited %.0f us behind queued work; replaced at the next "
                     "short one", window / 1000)
        self._anchor = (event, before + window // 2)
        self.anchor_window_ns = (window + 1) // 2
        self.anchors += 1
        return window <= self._anchor_window_limit_ns

    def _to_host(self, event: Any) -> int:
        assert self._anchor is not None
        anchor, host_ns = self._anchor
        return host_ns + round(anchor.elapsed_time(event) * 1e6)

    def _settle(self, count: int = 1) -> None:
        # Counted without a lock (only this thread writes it), then a notify only where a flush waits: the lock
        # and the notify were the resolver's own Python at every mark, time the training thread waits for the GIL.
        # A flusher counts itself before it reads the count, so one that read it before this increment is seen.
        self._settled += count
        if self._flushers:
            with self._settled_cond:
                self._settled_cond.notify_all()

    def _run(self) -> None:
        self.capture_safe = self._dev.thread_local_capture_mode()
        if not self.capture_safe:
            log.warning("device clock: this thread cannot leave global stream-capture mode: a CUDA graph "
                        "captured while it waits for an event may be invalidated")
        # The first anchor at once, before the trainer queues work (the device is likely idle now): a
        # first anchor taken behind a backlog would stand until a short one replaces it.
        for _ in range(_FIRST_ANCHOR_TRIES):
            try:
                if self._take_anchor():
                    break
            except Exception:  # noqa: BLE001 - retried at the first mark
                log.exception("device clock: no anchor yet")
                break
        self._next_anchor_ns = time.monotonic_ns() + (self._anchor_interval_ns if self.anchors_refused == 0
                                                      else _ANCHOR_RETRY_NS)
        pending, wake = self._pending, self._wake
        while True:
            try:
                item = pending.popleft()
            except IndexError:
                if self._stopping:
                    return
                self._idle = True
                if not pending:  # checked after saying so: a mark appended before it is seen here, one after wakes us
                    wake.wait(_IDLE_WAIT_S)
                wake.clear()
                self._idle = False
                continue
            if item is _STOP:
                return
            event, payload = item
            try:
                # Asked first, with the GIL held: done already (this thread behind the device, as when events come
                # in a burst), it is resolved without letting go of the GIL. torch's synchronize lets go of it even
                # for an event that is done, and taking it back waits for the training thread (a mark's record lets
                # go of it too): the H200 measured 26 us a mark with the resolver running, its own calls 3 us.
                if not event.query():
                    event.synchronize()  # sleeps (blocking-sync event), without the GIL
                now = time.monotonic_ns()
                if self._anchor is None or now >= self._next_anchor_ns:
                    good = self._take_anchor()
                    self._next_anchor_ns = now + (self._anchor_interval_ns if good else _ANCHOR_RETRY_NS)
                at_ns = self._to_host(event)
            except Exception:  # noqa: BLE001 - a CUDA error here must not reach the trainer
                log.exception("device clock: an event could not be resolved; its mark is dropped")
                self.dropped += 1
                self._settle()
                continue
            self._free.append(event)
            self.resolved += 1
            try:
                self._consumer(payload, at_ns)
            except Exception:  # noqa: BLE001
                log.exception("device clock: the consumer failed on %r", payload)
            self._settle()

    # ------------------------------------------------------------------ off the training path

    def flush(self, timeout_s: float = 30.0) -> bool:
        target = self._queued
        with self._settled_cond:
            self._flushers += 1
            try:
                return self._settled_cond.wait_for(lambda: self._settled >= target, timeout_s)
            finally:
                self._flushers -= 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what resolves within ``timeout_s``, then stop; never waits longer, even behind a
        device event that never completes (a hung kernel, a receive whose sender died)."""
        deadline = time.monotonic() + timeout_s
        if not self.flush(timeout_s):
            log.warning("device clock: %d mark(s) not resolved within %.0f s; left undelivered",
                        self._queued - self._settled, timeout_s)
        self._stopping = True
        self._pending.append(_STOP)
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.1)
        if self._thread.is_alive():
            log.warning("device clock: its thread is still waiting for a device event; left behind")
        else:
            self._dev.release_stream(self._stream)


# ---------------------------------------------------------------------- the real device

_CU_STREAM_NON_BLOCKING = 0x1
_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


class TorchClockDevice:
    """:class:`ClockDevice` on torch.cuda and the CUDA driver API (libcuda, through ctypes)."""

    def __init__(self, device_index: int) -> None:
        import torch

        self._torch = torch
        self._index = device_index
        # The current stream as torch's Python object, kept while torch's current stream is the same one: a mark
        # asks for it every time, and building the object anew (what ``torch.cuda.current_stream`` does) is
        # most of that call. One tuple (key, stream), replaced whole: right from any thread.
        self._current: tuple[Any, Any] = (None, None)
        self._lib: Any = None
        self._ctx = ctypes.c_void_p()
        self._dev = ctypes.c_int()
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            log.warning("device clock: libcuda cannot be loaded (%s): anchors use one of torch's pool streams", exc)

    def new_event(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True, blocking=True)

    def current_stream(self) -> Any:
        torch = self._torch
        get = getattr(torch._C, "_cuda_getCurrentStream", None)  # (stream id, device index, device type)
        if get is None:  # a torch without it: the public call
            return torch.cuda.current_stream(self._index)
        key = get(self._index)
        current = self._current
        if current[0] != key:
            current = self._current = (key, torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                              device_type=key[2]))
        return current[1]

    def capturing(self) -> bool:
        return bool(self._torch.cuda.is_current_stream_capturing())

    def _call(self, name: str, *args: Any) -> None:
        """A driver call by its current symbol (``_v2`` where cuda.h maps the name to one)."""
        fn = getattr(self._lib, f"{name}_v2", None) or getattr(self._lib, name)
        rc = int(fn(*args))
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUDA error {rc}")

    def private_stream(self) -> Any:
        torch = self._torch
        if self._lib is not None:
            try:
                torch.cuda.init()
                self._call("cuDeviceGet", ctypes.byref(self._dev), self._index)
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), self._dev)
                self._call("cuCtxPushCurrent", self._ctx)
                try:
                    least, greatest = ctypes.c_int(), ctypes.c_int()
                    self._call("cuCtxGetStreamPriorityRange", ctypes.byref(least), ctypes.byref(greatest))
                    stream = ctypes.c_void_p()
                    self._call("cuStreamCreateWithPriority", ctypes.byref(stream), _CU_STREAM_NON_BLOCKING, greatest)
                finally:
                    self._call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))
                return torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", self._index))
            except (RuntimeError, AttributeError) as exc:
                log.warning("device clock: no private stream (%s): anchors use one of torch's pool streams", exc)
        return torch.cuda.Stream(device=self._index, priority=-1)

    def release_stream(self, stream: Any) -> None:
        if self._lib is None or not isinstance(stream, self._torch.cuda.ExternalStream):
            return
        try:
            self._call("cuStreamDestroy", ctypes.c_void_p(stream.cuda_stream))
            self._call("cuDevicePrimaryCtxRelease", self._dev)
        except (RuntimeError, AttributeError) as exc:
            log.info("device clock: its stream was not released (%s)", exc)

    def thread_local_capture_mode(self) -> bool:
        if self._lib is None:
            return False
        mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            return int(self._lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))) == 0
        except AttributeError:  # a driver from before CUDA 10.1
            return False
