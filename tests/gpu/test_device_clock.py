"""The CUDA event clock on a real GPU: marks resolve in order, to host times that bracket device work,
without the marking thread waiting for the device."""

from __future__ import annotations

import threading
import time

from conftest import wait_for
from gpu_support import GPU

from freeride.training.device_clock import CudaEventClock

pytestmark = GPU


def test_marks_resolve_in_order_to_host_times_that_span_the_device_work_between_them() -> None:
    import torch

    got: list[tuple[str, int]] = []
    lock = threading.Lock()

    def consume(payload: object, at_ns: int) -> None:
        with lock:
            got.append((str(payload), at_ns))

    clock = CudaEventClock(consume, 0)
    try:
        before = time.monotonic_ns()
        clock.mark("a")
        torch.cuda._sleep(200_000_000)  # a long kernel: the host does not wait for it
        clock.mark("b")
        clock.mark("c")
        after_marks = time.monotonic_ns()
        assert got == [] or got[0][0] == "a"  # b cannot be resolved before the kernel ends
        wait_for(lambda: len(got) == 3, 60)
        (na, ta), (nb, tb), (nc, tc) = got
        assert (na, nb, nc) == ("a", "b", "c")
        assert before <= ta <= tb <= tc
        assert tb - ta > tc - tb  # the kernel lies between a and b, nothing between b and c
        assert tb > after_marks  # b's time is the device's, after the host had moved on
        assert clock.dropped == 0 and clock.flush(10)
    finally:
        clock.close()
