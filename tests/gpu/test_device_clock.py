"""The CUDA event clock on a real GPU: marks resolve in order, to host times that bracket device work,
without the marking thread waiting for the device; a trainer's CUDA graph capture survives the clock's
thread; anchors stay right when every stream shares one hardware queue. The same on a simulated GPU
runs everywhere: ``tests/unit/test_cuda_clock.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

from conftest import wait_for
from gpu_support import GPU

from freeride.training.device_clock import ANCHOR_WINDOW_NS, CudaEventClock

pytestmark = GPU


class Got:
    def __init__(self) -> None:
        self.items: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, payload: object, at_ns: int) -> None:
        with self.lock:
            self.items.append((str(payload), at_ns))


def test_marks_resolve_in_order_to_host_times_that_span_the_device_work_between_them() -> None:
    import torch

    got = Got()
    clock = CudaEventClock(got, 0)
    try:
        before = time.monotonic_ns()
        clock.mark("a")
        torch.cuda._sleep(200_000_000)  # a long kernel: the host does not wait for it
        clock.mark("b")
        clock.mark("c")
        after_marks = time.monotonic_ns()
        assert got.items == [] or got.items[0][0] == "a"  # b cannot be resolved before the kernel ends
        wait_for(lambda: len(got.items) == 3, 60)
        (na, ta), (nb, tb), (nc, tc) = got.items
        assert (na, nb, nc) == ("a", "b", "c")
        assert before <= ta <= tb <= tc
        assert tb - ta > tc - tb  # the kernel lies between a and b, nothing between b and c
        assert tb > after_marks  # b's time is the device's, after the host had moved on
        assert clock.dropped == 0 and clock.flush(10)
        assert clock.capture_safe and clock.anchor_window_ns < ANCHOR_WINDOW_NS
        assert isinstance(clock._stream, torch.cuda.ExternalStream)  # its own stream, not one of torch's pool
    finally:
        clock.close()


def test_a_graph_captured_in_global_mode_while_the_clock_resolves_survives_and_replays() -> None:
    # pytorch/pytorch#104487: another thread's event query during a global-mode capture invalidates it.
    import torch

    got = Got()
    clock = CudaEventClock(got, 0, anchor_interval_s=0.0)  # a new anchor (a record and queries) per mark
    x = torch.ones(1024, 1024, device="cuda:0")
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                y = x @ x  # warm-up on the side stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(stream)
        for i in range(20):  # marks that resolve while the capture below runs
            clock.mark(f"before-{i}")
            torch.cuda._sleep(5_000_000)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture_error_mode="global", the default
            clock.mark("inside")
            for _ in range(50):
                y = x @ x
                torch.cuda._sleep(1_000_000)
        graph.replay()
        torch.cuda.synchronize()
        assert clock.flush(30)
        assert clock.skipped_in_capture == 1 and "inside" not in [p for p, _ in got.items]
        assert len(got.items) == 20 and clock.dropped == 0
        assert torch.equal(y, x @ x)
    finally:
        clock.close()


ONE_QUEUE = textwrap.dedent("""
    import json, sys, time, torch
    from freeride.training.device_clock import CudaEventClock
    got = {}
    clock = CudaEventClock(lambda p, t: got.__setitem__(p, t), 0, anchor_interval_s=0.0)
    while clock.anchors == 0:
        time.sleep(0.001)
    marked = time.monotonic_ns()
    clock.mark("a")
    torch.cuda._sleep(int(sys.argv[1]))  # a long kernel the anchors queue behind
    clock.mark("b")
    end = torch.cuda.Event(blocking=False)
    end.record()
    while not end.query():  # the host sees the kernel end within the poll's few microseconds
        pass
    ended = time.monotonic_ns()
    clock.flush(30)
    clock.close()
    print(json.dumps({"a": got["a"], "b": got["b"], "marked": marked, "ended": ended, "refused": clock.anchors_refused,
                      "window": clock.anchor_window_ns}))
""")


def test_with_one_hardware_queue_converted_times_do_not_come_early() -> None:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 / start.elapsed_time(end) * 100)  # about 100 ms of spinning
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    done = subprocess.run([sys.executable, "-c", ONE_QUEUE, str(cycles)], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    # a completed at once; the anchor renewed after it waited behind the kernel and was refused.
    assert r["marked"] <= r["a"] <= r["marked"] + 2_000_000, r
    assert r["ended"] - 2_000_000 <= r["b"] <= r["ended"] + 1_000_000, r  # not early by the backlog
