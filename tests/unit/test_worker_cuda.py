"""The worker runtime on a GPU, with a fake device: steps in device time, one cap, resume from the CPU.

The fake device stands for :class:`freeride.devices.cuda_worker.CudaWorkerDevice`; what it records is what
a real GPU worker would have asked of torch.cuda. A real GPU runs the same paths in ``tests/gpu/``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from conftest import wait_for

from freeride._channel import Channel, Failed, Grant, Init, Message, Parked, Ready, Stop, Usage
from freeride._worker.runtime import WorkerRuntime
from freeride.devices import DeviceName, WorkerDevice, WorkerSetupError
from freeride.task import SideTask, TaskContext

MS = 1_000_000


class FakeGpuWorkerDevice(WorkerDevice):
    """A GPU as a worker sees it: each step's queued work finishes only when it is waited for."""

    def __init__(self, queued_ns: int = 0, refuse: str = "") -> None:
        super().__init__(DeviceName("cuda", 0))
        self.queued_ns = queued_ns
        self.refuse = refuse
        self.synced_at: list[int] = []
        self.prepared_with: tuple[int, bool] | None = None

    @property
    def torch_device(self) -> str:
        return "cuda:0"

    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        self.prepared_with = (memory_limit_bytes, command)
        if self.refuse:
            raise WorkerSetupError("MEMORY_LIMIT", self.refuse)
        self.context_bytes = 480 * 2**20

    def synchronize(self) -> None:
        # The device finishes what the step queued: the host waits for it here, not in step().
        deadline = time.monotonic_ns() + self.queued_ns
        while time.monotonic_ns() < deadline:
            pass
        self.synced_at.append(time.monotonic_ns())

    def used_bytes(self) -> int:
        return 700 * 2**20


class Launcher(SideTask):
    """Queues work and returns at once, as a CUDA step does."""

    def __init__(self) -> None:
        self.n = 0

    def setup(self, ctx: TaskContext) -> None:
        pass

    def step(self) -> None:
        self.n += 1

    def done(self) -> bool:
        return self.n >= 3

    def progress(self) -> float:
        return float(self.n)


def make_runtime(worker: Channel, tmp_path: Path, device: WorkerDevice, target: str = "",
                 working_dir: str = "") -> WorkerRuntime:
    rt = WorkerRuntime(worker, Init(task_id="t-1", memory_limit_bytes=2**30, work_dir=str(tmp_path / "work"),
                                    checkpoint_dir=str(tmp_path / "ckpt"), device="cpu:0", target=target,
                                    working_dir=working_dir))
    rt.device = device
    return rt


def drain(manager: Channel) -> list[Message]:
    out = []
    while (msg := manager.recv_nowait()) is not None:
        out.append(msg)
    return out


def test_a_step_ends_when_the_device_has_done_its_work_not_when_its_kernels_are_queued(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    manager, worker = channels
    device = FakeGpuWorkerDevice(queued_ns=3 * MS)
    rt = make_runtime(worker, tmp_path, device)
    rt.task, rt.setup_done = Launcher(), True
    rt._run_grant(Grant(1, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0))
    parked = next(m for m in drain(manager) if isinstance(m, Parked))
    assert parked.steps == 3 and len(device.synced_at) == 3
    # Every step's measured end comes after the device finished it: its duration holds the device time.
    for start, duration, synced in zip(parked.starts_ns, parked.durations_ns, device.synced_at, strict=True):
        assert start + duration >= synced


def test_a_park_is_reported_before_the_device_is_measured_and_its_usage_follows(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    # On CUDA the worker's measure asks NVML for the GPU's processes (a millisecond or so): inside the park
    # report it delayed every park, and the manager freezes a worker still running half a millisecond past
    # the bubble's end. The report goes first; the measure follows it, for the manager's watchdog.
    manager, worker = channels
    device = FakeGpuWorkerDevice()
    rt = make_runtime(worker, tmp_path, device)
    rt.task, rt.setup_done = Launcher(), True
    sent: list[str] = []
    send = rt.chan.send

    def recording_send(msg: Message) -> None:
        sent.append(msg.TAG)
        send(msg)

    measure = device.used_bytes

    def recording_measure() -> int:
        sent.append("measured")
        return measure()

    rt.chan.send = recording_send  # type: ignore[method-assign,assignment]
    device.used_bytes = recording_measure  # type: ignore[method-assign]
    rt._run_grant(Grant(1, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0))
    assert sent[:3] == ["parked", "measured", "usage"]
    usage = next(m for m in drain(manager) if isinstance(m, Usage))
    assert usage.device_bytes == 700 * 2**20  # the worker's own measure, for the manager's watchdog


def test_a_cap_the_context_cannot_fit_in_fails_at_start_with_memory_limit(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    manager, worker = channels
    rt = make_runtime(worker, tmp_path, FakeGpuWorkerDevice(refuse="the context takes 500 MiB: give at least 564 MiB"),
                      target="sample_tasks:Counter")
    assert rt.run() == 2
    [failed] = drain(manager)
    assert isinstance(failed, Failed) and failed.kind == "MEMORY_LIMIT" and "give at least 564 MiB" in failed.message


def test_ready_says_how_large_the_context_is(tmp_path: Path, channels: tuple[Channel, Channel]) -> None:
    manager, worker = channels
    device = FakeGpuWorkerDevice()
    rt = make_runtime(worker, tmp_path, device, target="sample_tasks:Counter",
                      working_dir=str(Path(__file__).parents[1]))
    runner = threading.Thread(target=rt.run, daemon=True)
    runner.start()
    ready = wait_for(manager.recv_nowait, 30)
    manager.send(Stop(checkpoint=False))
    runner.join(30)
    assert device.prepared_with == (2**30, False)
    assert isinstance(ready, Ready) and ready.context_bytes == 480 * 2**20


class RngTraining(SideTask):
    """Keeps a CPU generator's state in its checkpoint, as the bundled training tasks do."""

    def setup(self, ctx: TaskContext) -> None:
        self.generator = torch.Generator().manual_seed(7)
        self.weights = torch.zeros(4)

    def step(self) -> None:
        self.weights += torch.rand(4, generator=self.generator)

    def done(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])  # a CPU byte tensor, or it raises
        self.weights = state["weights"].to("cpu")


def test_regression_a_checkpoint_resumes_on_a_gpu_worker_because_it_loads_on_the_cpu_first(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    # Loaded with map_location="cuda:0", RNG states moved to the GPU and every training task failed
    # its first resume on CUDA (on this CPU-only machine that load raises at once).
    _, worker = channels
    (tmp_path / "ckpt").mkdir()
    first = make_runtime(worker, tmp_path, FakeGpuWorkerDevice())
    first.task = RngTraining()
    first.task.setup(None)  # type: ignore[arg-type]
    first.setup_done, first.steps = True, 5
    first.task.step()
    assert first._checkpoint()
    resumed = make_runtime(worker, tmp_path, FakeGpuWorkerDevice())
    resumed.task = RngTraining()
    resumed.task.setup(None)  # type: ignore[arg-type]
    resumed._restore()
    assert resumed.steps == 5
    assert torch.equal(resumed.task.weights, first.task.weights)
    assert torch.equal(resumed.task.generator.get_state(), first.task.generator.get_state())
