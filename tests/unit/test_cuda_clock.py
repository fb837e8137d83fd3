"""The CUDA event clock on a simulated GPU (``FakeTorchCuda``): CUDA graph capture, anchors behind a
backlog, renewals, flush and close. The same clock on a real GPU: ``tests/gpu/test_device_clock.py``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from conftest import wait_for
from gpu_fakes import FakeCudaError, FakeTorchCuda

from freeride.training import device_clock
from freeride.training.device_clock import CudaEventClock, TorchClockDevice

MS = 1_000_000


class Got:
    """The consumer: every delivered (payload, host ns), in order."""

    def __init__(self) -> None:
        self.items: list[tuple[object, int]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, payload: object, at_ns: int) -> None:
        self.gate.wait()
        with self.lock:
            self.items.append((payload, at_ns))

    def times(self) -> dict[object, int]:
        with self.lock:
            return dict(self.items)


@pytest.fixture
def clocks() -> Iterator[list[CudaEventClock]]:
    made: list[CudaEventClock] = []
    yield made
    for clock in made:
        clock.close(timeout_s=2)


def make(clocks: list[CudaEventClock], gpu: FakeTorchCuda, got: Got, **kw: object) -> CudaEventClock:
    clock = CudaEventClock(got, 0, device=gpu, **kw)  # type: ignore[arg-type]
    clocks.append(clock)
    return clock


def test_marks_resolve_in_order_to_the_host_time_their_device_work_ended(clocks: list[CudaEventClock]) -> None:
    gpu, got = FakeTorchCuda(drift_ppm=30), Got()
    clock = make(clocks, gpu, got)
    before = time.monotonic_ns()
    clock.mark("a")
    gpu.launch(20 * MS)  # the host runs ahead; the device works 20 ms
    clock.mark("b")
    marked = time.monotonic_ns()
    assert clock.flush(10)
    t = got.times()
    assert [p for p, _ in got.items] == ["a", "b"]
    # a: right away, to within the anchor's error bound (half its window: a loaded host widens it);
    # b: when the kernel ended, long after it was marked.
    w = clock.anchor_window_ns
    assert before - w <= t["a"] <= marked + w
    assert t["b"] - t["a"] == pytest.approx(20 * MS, abs=2 * clock.anchor_window_ns + 1 * MS)
    assert t["b"] > marked + 15 * MS
    assert clock.dropped == clock.skipped_in_capture == 0


def test_an_event_already_done_is_resolved_without_the_wait_that_lets_go_of_the_gil(
    clocks: list[CudaEventClock], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's Event.synchronize lets go of the GIL even for an event that is done, and taking it back waits for
    # the training thread: on the H200 a mark cost 26 us with the resolver running, its own calls 3 us. Events
    # done by the time the resolver reaches them (a burst, or the two marks of an action's end and a wait's
    # start) are asked with query(), which keeps the GIL; only one not done yet is waited for.
    from gpu_fakes import FakeEvent

    waited: list[int] = []
    real = FakeEvent.synchronize
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: (waited.append(1), real(self))[1])
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got)
    wait_for(lambda: clock.anchors > 0, 10)
    got.gate.clear()  # the resolver holds in delivery while the marks pile up, all done on an idle device
    for i in range(20):
        clock.mark(i)
    got.gate.set()
    assert clock.flush(10) and [p for p, _ in got.items] == list(range(20))
    assert len(waited) <= 1  # at most the first, if the resolver reached it before the device was done
    got.items.clear()
    before = len(waited)
    gpu.launch(20 * MS)  # not done when the resolver asks: waited for
    clock.mark("after")
    assert clock.flush(10) and [p for p, _ in got.items] == ["after"]
    assert len(waited) > before


def test_resolving_during_a_global_graph_capture_leaves_the_capture_intact(clocks: list[CudaEventClock]) -> None:
    # pytorch/pytorch#104487: an event query from another thread during a capture in global mode breaks it.
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got)
    wait_for(lambda: clock.capture_safe, 10)
    got.gate.clear()  # the resolver waits inside delivery, then resolves the rest during the capture
    for i in range(5):
        clock.mark(i)
        gpu.launch(2 * MS)
    with gpu.capture("global"):
        got.gate.set()
        wait_for(lambda: len(got.items) == 5, 10)  # events waited for and anchors taken meanwhile
        gpu.launch(MS)
    assert gpu.refused_calls == []


def test_without_thread_local_mode_the_same_capture_is_invalidated(clocks: list[CudaEventClock]) -> None:
    # The failure the fix prevents, shown on the same simulated device: the test above can fail.
    gpu, got = FakeTorchCuda(thread_local_ok=False), Got()
    clock = make(clocks, gpu, got)
    got.gate.clear()
    for i in range(3):
        clock.mark(i)
        gpu.launch(2 * MS)
    with pytest.raises(FakeCudaError, match="capture was invalidated"), gpu.capture("global"):
        got.gate.set()
        wait_for(lambda: gpu.refused_calls, 10)
    assert not clock.capture_safe


def test_a_mark_inside_a_capture_is_not_recorded_and_is_counted(clocks: list[CudaEventClock]) -> None:
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got)
    clock.mark("before")
    with gpu.capture("thread_local") as capture:
        clock.mark("inside")
        gpu.launch(MS)
    clock.mark("after")
    assert clock.flush(10)
    assert [p for p, _ in got.items] == ["before", "after"]
    assert clock.skipped_in_capture == 1 and capture.events == 0


def backlogged_renewal(clocks: list[CudaEventClock], window_ns: int) -> tuple[CudaEventClock, int, int]:
    """CUDA_DEVICE_MAX_CONNECTIONS=1: an anchor recorded on any stream completes only after all work
    queued before it. The renewal after mark x is recorded behind 60 ms of queued work; x itself
    completed at once. Returns the clock, x's resolved time and the host time x was marked."""
    gpu, got = FakeTorchCuda(max_connections=1), Got()
    clock = make(clocks, gpu, got, anchor_interval_s=0.0, anchor_window_ns=window_ns)
    clock.mark("warm")
    assert clock.flush(10)  # the first anchor, on an idle device
    got.gate.clear()
    clock.mark("hold")  # the resolver waits inside its delivery while the host queues ahead
    wait_for(lambda: clock.resolved == 2, 10)
    marked = time.monotonic_ns()
    clock.mark("x")
    gpu.launch(60 * MS)
    clock.mark("y")
    got.gate.set()
    assert clock.flush(10)
    return clock, got.times()["x"], marked


def test_an_anchor_queued_behind_a_backlog_is_refused_so_times_do_not_come_early(clocks: list[CudaEventClock]) -> None:
    clock, x, marked = backlogged_renewal(clocks, window_ns=200_000)
    assert clock.anchors_refused >= 1
    assert abs(x - marked) <= 2 * MS  # converted with the last good anchor


def test_with_no_bound_on_the_window_the_backlog_makes_times_early(clocks: list[CudaEventClock]) -> None:
    # The same run with the window bound lifted: the error the bound prevents, so the test above can fail.
    clock, x, marked = backlogged_renewal(clocks, window_ns=10**12)
    assert clock.anchors_refused == 0
    assert marked - x > 20 * MS  # early by about half the 60 ms the anchor waited


def test_an_anchor_renewed_between_two_marks_keeps_their_interval(clocks: list[CudaEventClock]) -> None:
    # 200 ppm of drift: without renewals the error would grow with time; with them it stays within the window.
    gpu, got = FakeTorchCuda(drift_ppm=200), Got()
    clock = make(clocks, gpu, got, anchor_interval_s=0.0)
    clock.mark("a")
    assert clock.flush(10)
    # a's time is off by at most its anchor's bound; an anchor is tried again before b is resolved (the GIL
    # can hold the resolver past the window limit between its two clock reads: that one is refused).
    tried, window_a = clock.anchors + clock.anchors_refused, clock.anchor_window_ns
    gpu.launch(30 * MS)
    clock.mark("b")
    assert clock.flush(10)
    assert clock.anchors + clock.anchors_refused > tried
    t = got.times()
    device_gap = gpu.default_stream.busy_until - gpu.device_ns_of(t["a"])
    bound = window_a + clock.anchor_window_ns + 0.2 * MS
    assert t["b"] - t["a"] == pytest.approx(device_gap / (1 + gpu.drift), abs=bound)


def test_flush_returns_only_once_the_last_mark_is_delivered(clocks: list[CudaEventClock]) -> None:
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got)
    got.gate.clear()  # delivery of the first mark is held
    clock.mark("a")
    clock.mark("b")
    assert not clock.flush(0.2)
    got.gate.set()
    assert clock.flush(10)
    assert [p for p, _ in got.items] == ["a", "b"]


def test_close_is_bounded_behind_an_event_that_never_completes(clocks: list[CudaEventClock],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    gpu, got = FakeTorchCuda(), Got()
    clock = CudaEventClock(got, 0, device=gpu)
    clock.mark("done")
    assert clock.flush(10)
    gpu.launch(3600 * 10**9)  # a hung kernel, or a receive whose sender died
    clock.mark("never")
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    clock.close(timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert "not resolved" in caplog.text and "left behind" in caplog.text
    assert gpu.released == []  # its stream is still waited on: not destroyed under the thread


def test_close_releases_the_private_stream(clocks: list[CudaEventClock]) -> None:
    gpu, got = FakeTorchCuda(), Got()
    clock = CudaEventClock(got, 0, device=gpu)
    clock.mark("a")
    clock.close(timeout_s=5)
    assert [p for p, _ in got.items] == ["a"]
    assert gpu.released == gpu.private_streams and gpu.private_streams[0].private


def test_a_mark_wakes_a_resolver_that_sleeps_for_want_of_marks(clocks: list[CudaEventClock],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The resolver would sleep a minute with nothing pending: each mark must wake it, or its flush times out.
    monkeypatch.setattr(device_clock, "_IDLE_WAIT_S", 60.0)
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got)
    for i in range(20):
        wait_for(lambda: clock._idle, what="the resolver asleep with nothing pending")
        clock.mark(i)
        assert clock.flush(5), f"mark {i} was not delivered: the resolver slept through it"
    assert [p for p, _ in got.items] == list(range(20))
    assert clock.marks == 20


def test_marks_past_max_pending_are_dropped_counted_and_the_rest_delivered_in_order(
        clocks: list[CudaEventClock]) -> None:
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got, max_pending=3)
    got.gate.clear()  # the resolver takes "a" and is held delivering it
    clock.mark("a")
    wait_for(lambda: not clock._pending, what="the resolver holding the first mark")
    for name in "bcdef":
        clock.mark(name)  # the trainer never waits: three are queued, two dropped
    assert (clock.marks, clock.dropped) == (4, 2)
    got.gate.set()
    assert clock.flush(10)
    assert [p for p, _ in got.items] == ["a", "b", "c", "d"]


class _StubCuda:
    """torch.cuda as :class:`TorchClockDevice` sees it: streams named by a key that a test changes."""

    def __init__(self) -> None:
        self.made: list[tuple[int, int, int]] = []
        self.public_calls = 0

    def Stream(self, stream_id: int, device_index: int, device_type: int) -> object:  # noqa: N802 - torch's name
        self.made.append((stream_id, device_index, device_type))
        return object()

    def current_stream(self, index: int) -> object:
        self.public_calls += 1
        return ("public", index)


def test_the_real_devices_current_stream_is_built_once_per_stream_torch_makes_current() -> None:
    dev = TorchClockDevice(0)
    key = [(11, 0, 1)]
    cuda = _StubCuda()
    dev._torch = SimpleNamespace(cuda=cuda, _C=SimpleNamespace(_cuda_getCurrentStream=lambda index: key[0]))
    first = dev.current_stream()
    assert dev.current_stream() is first and cuda.made == [(11, 0, 1)]
    key[0] = (12, 0, 1)  # the trainer entered another stream's context
    second = dev.current_stream()
    assert second is not first and cuda.made == [(11, 0, 1), (12, 0, 1)]
    key[0] = (11, 0, 1)
    assert dev.current_stream() is not second and len(cuda.made) == 3
    assert cuda.public_calls == 0


def test_without_torchs_raw_current_stream_the_real_device_asks_the_public_call() -> None:
    dev = TorchClockDevice(3)
    cuda = _StubCuda()
    dev._torch = SimpleNamespace(cuda=cuda, _C=SimpleNamespace())
    assert dev.current_stream() == ("public", 3) and cuda.public_calls == 1


def test_flushes_beside_a_marking_thread_each_return_once_their_marks_are_delivered(
        clocks: list[CudaEventClock]) -> None:
    gpu, got = FakeTorchCuda(), Got()
    clock = make(clocks, gpu, got)
    done = threading.Event()

    def trainer() -> None:
        for i in range(3000):
            clock.mark(i)
        done.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    flushes = 0
    while not done.is_set() or flushes == 0:
        # A flush whose notify was lost still returns True, at its timeout: so the timeout is long, and a flush
        # must return long before it (each waits for milliseconds of marks).
        started = time.monotonic()
        assert clock.flush(60)
        assert time.monotonic() - started < 20, "a flush was not told its marks were delivered; it timed out"
        flushes += 1
    thread.join()
    assert clock.flush(10)
    assert [p for p, _ in got.items] == list(range(3000)) and clock.dropped == 0
