"""The DeepSpeed adapter on a GPU: its marks are CUDA events, so a wait the *device* spends is the bubble,
and the host never waits for it.

Two layers. A real DeepSpeed schedule (``TrainSchedule`` on either stage, ``DualPipeVSchedule``) replayed by
``bench/deepspeed_replay.py``'s engine with device work: each forward and backward launches a matrix
product, and the first instruction of each run the adapter treats as one wait (receives; DualPipeV's
``CommitP2P``, two of which can follow one another) makes the stream wait behind a ``torch.cuda._sleep`` of a
chosen length that starts once the stage's work before it is done, as a neighbour's send arriving later
would. Checked: every such wait is a bubble of its length, in order, and the iteration returned on the host
long before the device finished. Then a real one-rank
``PipelineEngine`` on the GPU (an NCCL group of one): instrumented on the device clock, its losses and
weights are those of an uninstrumented twin, and each iteration's bubbles are delivered.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu_support import GPU, LengthSink, device_ns

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frameworks"))

from framework_support import deepspeed_one_rank, require_framework  # noqa: E402

pytestmark = GPU

CYCLES_PER_UNIT = 4_000_000  # ~2 ms of an H100/H200's clock: far above launch overheads
HOST_UNIT_NS = 2_000_000


def _replay(schedule_type: Any, stage_id: int, waits: tuple[str, ...], device: str,
            wait: Callable[[Any, int], None]) -> Any:
    """A replayed DeepSpeed stage whose instructions run on ``device`` (module doc); ``wait(engine, units)``
    holds it as a neighbour's late send would."""
    import torch

    from bench.deepspeed_replay import ReplayEngine

    class DeviceReplay(ReplayEngine):
        @staticmethod
        def _instruction(name: str) -> Any:
            def run(self: Any, **kwargs: Any) -> None:
                if name in ("ForwardPass", "BackwardPass"):
                    torch.matmul(self.a, self.a, out=self.c)
                    self.fresh = True
                elif name in waits and self.fresh:  # a run's first: its wait is the bubble's
                    self.fresh = False
                    self.seen += 1
                    if self.units:
                        wait(self, self.units.pop(0))
                if name == "OptimizerStep":
                    self.clip_fp32_gradients()

            return run

        def _train_schedule(self) -> Any:
            self.fresh = True
            return super()._train_schedule()

    engine = DeviceReplay(schedule_type, 4, 2, stage_id)
    engine.a = torch.randn(256, 256, device=device)
    engine.c = torch.empty_like(engine.a)
    engine.units = []
    engine.seen = 0
    return engine


def _device_wait(engine: Any, units: int) -> None:
    """The stream (not the host) waits for a send that arrives ``units`` after the stage's work so far."""
    import torch

    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream())
    with torch.cuda.stream(engine.comm):
        engine.comm.wait_event(done)
        torch.cuda._sleep(units * CYCLES_PER_UNIT)  # the neighbour's send, still in flight
        arrived = torch.cuda.Event()
        arrived.record(engine.comm)
    torch.cuda.current_stream().wait_event(arrived)


def _bubble_lengths(kind: str, stage_id: int, device: str, wait: Callable[[Any, int], None],
                    floor_ns: int) -> tuple[list[int], int, int]:
    """Run two iterations (the second with waits of 1, 2, 3, ... units where the rank meets them): the
    second's bubbles over ``floor_ns``, in slot order, how many waits there were, and the host's time for it."""
    import torch
    from deepspeed.runtime.pipe import schedule

    from freeride.training import deepspeed as fds

    waits = (fds.COMMIT_P2P,) if kind == "DualPipeVSchedule" else ("RecvActivation", "RecvGrad")
    engine = _replay(getattr(schedule, kind), stage_id, waits, device, wait)
    if device.startswith("cuda"):
        engine.comm = torch.cuda.Stream()
    sink = LengthSink()
    sink.device = device
    handle = fds._install(engine, sink, device=device)
    handle.tracker.report_min_ns = 0
    try:
        engine.train_batch()  # the first iteration: no waits, how many there are
        count, engine.seen = engine.seen, 0
        engine.units = list(range(1, count + 1))  # 1, 2, 3, ... units, in the order the rank meets them
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        begin = time.monotonic_ns()
        engine.train_batch()
        host_ns = time.monotonic_ns() - begin
    finally:
        fds.uninstrument(engine)  # closes the tracker: waits for the device, delivers everything
    return [ns for ns in sink.of(1) if ns > floor_ns], count, host_ns


@pytest.mark.parametrize("kind,stage_id", [("TrainSchedule", 0), ("TrainSchedule", 1), ("DualPipeVSchedule", 0),
                                           ("DualPipeVSchedule", 1)])
def test_device_waits_are_the_bubbles_and_the_host_does_not_wait(kind: str, stage_id: int) -> None:
    require_framework("deepspeed")
    import torch

    unit_ns = device_ns(lambda: torch.cuda._sleep(CYCLES_PER_UNIT))
    waited, count, host_ns = _bubble_lengths(kind, stage_id, "cuda:0", _device_wait, unit_ns // 2)
    # The same replay with the host waiting, on the host clock, says which waits are bubbles: a receive always
    # is; a DualPipeV commit only at a planned slot (the others are counted as unplanned waits).
    host_waited, host_count, _ = _bubble_lengths(kind, stage_id, "cpu", lambda e, u: time.sleep(u * HOST_UNIT_NS / 1e9),
                                                 HOST_UNIT_NS // 2)
    units = [round(ns / HOST_UNIT_NS) for ns in host_waited]
    assert count == host_count > 0 and len(waited) == len(units), (waited, units, count, host_count)
    for k, ns in zip(units, waited, strict=True):  # the same waits, each of its length on the device
        assert abs(ns - k * unit_ns) <= 0.1 * k * unit_ns + 300_000, (units, waited, unit_ns)
    assert waited == sorted(waited)  # in the device's order
    if kind == "TrainSchedule":
        assert units == list(range(1, count + 1))
    assert host_ns < sum(waited)  # the host ran ahead: it never waited for the device


@pytest.fixture(scope="module")
def nccl_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank NCCL group on a file store (no port), and DeepSpeed initialised on it."""
    require_framework("deepspeed")
    import torch

    torch.cuda.set_device(0)
    with deepspeed_one_rank(tmp_path_factory.mktemp("store") / "store", "nccl"):
        yield


def _engine() -> Any:
    import torch

    from freeride.workload.deepspeed_job import build_model, make_engine

    torch.manual_seed(0)
    return make_engine(build_model(8, 1, -1, 0.0, False, 1), 2, 4, 1.0)


def test_a_real_engine_on_the_gpu_trains_as_its_twin_and_delivers_each_iteration(nccl_rank: None) -> None:
    import torch

    from freeride.training import deepspeed as fds
    from freeride.workload.deepspeed_job import batches

    engine, twin = _engine(), _engine()
    assert next(engine.module.parameters()).is_cuda
    delivered: list[int] = []
    handle = fds.instrument(engine, LengthSink(), device="cuda:0",
                            on_iteration=lambda it, bubbles: delivered.append(it))
    assert type(handle.tracker.clock).__name__ == "CudaEventClock"
    data, twin_data = batches(8, 2, 1), batches(8, 2, 1)
    try:
        losses = [float(engine.train_batch(data)) for _ in range(4)]
    finally:
        fds.uninstrument(engine)  # delivers the last iteration
    assert losses == [float(twin.train_batch(twin_data)) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), twin.module.parameters(), strict=True))
    assert delivered == [0, 1, 2, 3]
