"""The torchtitan adapter on a GPU: the wrapper around a trainer's ``pp_schedule`` attaches the device clock
for each ``step`` only, so a wait the *device* spends is the bubble, the host never waits for it, and
between steps (validation, anything else) the stages run bare.

The schedule is ``bench/gpu/bubble_timing.py``'s stage of a four-stage 1F1B on the GPU: its actions are
matrix products on the current stream, and before each action that needs a neighbour, the stream (not the
host) waits behind a ``torch.cuda._sleep`` that starts once the stage's work before it is done, as NCCL's
receive wait holds it. A torchtitan ``Trainer`` is the object that holds it as ``pp_schedule`` (torchtitan
itself is not needed: its schedule is torch's).
"""

from __future__ import annotations

import time
import types

from gpu_support import GPU, LengthSink, device_ns

pytestmark = GPU

WAIT_CYCLES = 8_000_000  # ~4 ms of an H100/H200's clock


def test_each_step_reports_the_devices_waits_and_the_host_does_not_wait() -> None:
    import torch

    from bench.gpu.bubble_timing import GpuStage, Schedule1F1B
    from freeride.training import torchtitan as ftt

    stage = GpuStage(torch, 1, 4, 1024, 2)
    schedule = Schedule1F1B(stage, 8, WAIT_CYCLES)
    trainer = types.SimpleNamespace(pp_schedule=schedule)
    sink = LengthSink()
    delivered: list[int] = []
    wrapper = ftt.instrument(trainer, sink, on_iteration=lambda it, bubbles: delivered.append(it))
    assert trainer.pp_schedule is wrapper and type(wrapper.instrumented.clock).__name__ == "CudaEventClock"
    wait_ns = device_ns(lambda: torch.cuda._sleep(WAIT_CYCLES), repeats=1)
    host_ns = []
    try:
        for _ in range(4):
            torch.cuda.synchronize()
            begin = time.monotonic_ns()
            trainer.pp_schedule.step()
            host_ns.append(time.monotonic_ns() - begin)
        torch.cuda.synchronize()
        wrapper.instrumented.flush()
        marked = dict(sink.lengths), list(delivered)
        # Between steps the stages run bare: a step of the raw schedule (as validation's would) marks nothing.
        schedule.step()
        torch.cuda.synchronize()
        wrapper.instrumented.flush()
        assert (dict(sink.lengths), list(delivered)) == marked
    finally:
        ftt.uninstrument(trainer)  # waits for the device, delivers everything
    assert trainer.pp_schedule is schedule
    assert delivered == [0, 1, 2, 3]
    waits = len(schedule.waits_before)
    for iteration in range(1, 4):  # the first iteration pays one-off costs (the event pool, the first anchor)
        lengths = [ns for (it, _), ns in sorted(sink.lengths.items()) if it == iteration and ns > wait_ns // 2]
        assert len(lengths) == waits, (iteration, lengths, waits)
        for ns in lengths:  # each bubble is one device wait, of its length
            assert abs(ns - wait_ns) <= 0.1 * wait_ns + 300_000, (iteration, lengths, wait_ns)
        assert host_ns[iteration] < waits * wait_ns  # the host ran ahead: it never waited for the device
