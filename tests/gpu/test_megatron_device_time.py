"""The Megatron adapter on a GPU: its marks are CUDA events, so a wait the *device* spends (a stream
held by a kernel, as an NCCL receive holds it) is the bubble, and the host never waits for it.

Megatron's real schedule function runs as one rank in this process (``tests/frameworks/megatron_sim.py``,
its transfers stubbed): where it receives, a ``torch.cuda._sleep`` kernel of a chosen length holds the
stream, as a receive would. Checked: the bubbles come out in the order of those lengths, at their
slots, and the iteration returned on the host long before the device finished its sleeps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_support import GPU, LengthSink

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frameworks"))

from framework_support import one_process_group, require_framework  # noqa: E402

pytestmark = GPU

CYCLES_PER_UNIT = 20_000_000  # ~10 ms of a GPU's clock: far above launch overheads


@pytest.mark.parametrize("virtual", [1, 2])
def test_device_waits_are_the_bubbles_and_the_host_does_not_wait(virtual: int) -> None:
    require_framework("megatron")
    import megatron_sim
    import torch

    from freeride.training.megatron import instrument

    with one_process_group():
        rank = megatron_sim.Rank(2, 0, 4, virtual)
        rank.state.device = "cuda:0"
        rank.chunks = [c.cuda() for c in rank.chunks]
        rank.state.on_wait = lambda units: torch.cuda._sleep(units * CYCLES_PER_UNIT)
        sink = LengthSink()
        function: Any = instrument(megatron_sim.schedule_function(virtual), sink, device="cuda:0", report_min_ns=0)
        rank.step(function)  # where the rank receives
        positions = sorted(set(rank.state.received_at))
        waits = {p: i + 1 for i, p in enumerate(positions)}  # 1, 2, 3, ... units, in position order
        torch.cuda.synchronize()
        begin = time.monotonic_ns()
        rank.step(function, waits)
        host_ns = time.monotonic_ns() - begin
        function.close()  # waits for the device, delivers everything
    measured = {slot: ns for (iteration, slot), ns in sink.lengths.items() if iteration == 1 and slot in waits}
    assert set(measured) == set(waits)
    by_length = sorted(measured, key=measured.__getitem__)
    assert by_length == positions  # the longer the device's wait, the longer the bubble
    assert host_ns < measured[positions[-1]]  # the host ran ahead: it never waited for the device
