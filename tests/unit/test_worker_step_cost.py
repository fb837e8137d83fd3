"""What a worker learns of its step time: a step's cost, less what it waited for the device.

A fake device stands for a CPU core whose kernel counts the stepping thread's run delay
(:meth:`freeride.devices.CpuWorkerDevice.waited_ns`; the real count is tested in ``test_process_cpu.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

from freeride._channel import Channel, Grant, Init, Parked
from freeride._worker.runtime import WorkerRuntime
from freeride.devices import DeviceName, WorkerDevice
from freeride.task import SideTask, TaskContext

MS = 1_000_000


class WaitingCore(WorkerDevice):
    """A core that says its thread waited ``waits_ns`` of each step's wall time (None: it keeps no count)."""

    def __init__(self, counts: bool = True) -> None:
        super().__init__(DeviceName("cpu", 0))
        self.counts = counts
        self.waited = 0

    @property
    def torch_device(self) -> str:
        return "cpu"

    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        pass

    def waited_ns(self) -> int | None:
        return self.waited if self.counts else None


class Delayed(SideTask):
    """Each step takes 5 ms of wall time, 4 of them (the device says) spent waiting for the core."""

    def __init__(self, device: WaitingCore) -> None:
        self.device = device
        self.n = 0

    def setup(self, ctx: TaskContext) -> None:
        pass

    def step(self) -> None:
        end = time.monotonic_ns() + 5 * MS
        self.device.waited += 4 * MS
        while time.monotonic_ns() < end:
            pass
        self.n += 1

    def done(self) -> bool:
        return self.n >= 3

    def progress(self) -> float:
        return float(self.n)


def run_grant(worker: Channel, manager: Channel, tmp_path: Path, device: WaitingCore) -> tuple[WorkerRuntime, Parked]:
    rt = WorkerRuntime(worker, Init(task_id="t-1", memory_limit_bytes=2**30, work_dir=str(tmp_path / "work"),
                                    checkpoint_dir=str(tmp_path / "ckpt"), device="cpu:0"))
    rt.device = device
    rt.task, rt.setup_done = Delayed(device), True
    rt._run_grant(Grant(1, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0))
    parked = manager.recv_nowait()
    assert isinstance(parked, Parked)
    return rt, parked


def test_a_step_that_waited_for_its_core_costs_its_wall_time_less_the_wait(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    manager, worker = channels
    rt, parked = run_grant(worker, manager, tmp_path, WaitingCore())
    assert parked.steps == 3
    # The spans keep where each step was (its wall time); the costs, what it would take on an idle core.
    assert all(d >= 5 * MS for d in parked.durations_ns)
    assert len(parked.costs_ns) == 3
    assert all(c == d - 4 * MS for c, d in zip(parked.costs_ns, parked.durations_ns, strict=True))
    # The process's first step is a warm-up, no sample (``warmup_steps``): the estimate is the others' p95.
    assert parked.warmup_steps == 1
    assert rt.estimator.estimate_ns() == max(parked.costs_ns[1:]), "the worker's admission learns the costs too"


def test_a_device_that_keeps_no_count_reports_no_costs_and_learns_the_wall_time(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    manager, worker = channels
    rt, parked = run_grant(worker, manager, tmp_path, WaitingCore(counts=False))
    assert parked.costs_ns == ()
    assert rt.estimator.estimate_ns() == max(parked.durations_ns[parked.warmup_steps:]) >= 5 * MS


def test_a_grants_harvested_time_is_every_steps_cost_not_the_listed_wall_times(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    # A stranger's 0.2 ms steps, preempted by the trainer on their core, read "harvested 0.155 s" of 6.4 ms of work:
    # the wall times were summed. The grant's harvested time is its steps' costs, summed.
    manager, worker = channels
    _, parked = run_grant(worker, manager, tmp_path, WaitingCore())
    assert parked.worked_ns == sum(parked.costs_ns) < sum(parked.durations_ns) - 11 * MS


class Quick(SideTask):
    """100 steps of about 20 us: more than a park lists."""

    def __init__(self) -> None:
        self.n = 0

    def setup(self, ctx: TaskContext) -> None:
        pass

    def step(self) -> None:
        end = time.monotonic_ns() + 20_000
        while time.monotonic_ns() < end:
            pass
        self.n += 1

    def done(self) -> bool:
        return self.n >= 100

    def progress(self) -> float:
        return float(self.n)


def test_a_grant_of_more_steps_than_a_park_lists_counts_them_all_as_harvested(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    manager, worker = channels
    rt = WorkerRuntime(worker, Init(task_id="t-1", memory_limit_bytes=2**30, work_dir=str(tmp_path / "work"),
                                    checkpoint_dir=str(tmp_path / "ckpt"), device="cpu:0"))
    rt.device = WaitingCore(counts=False)
    rt.task, rt.setup_done = Quick(), True
    rt._run_grant(Grant(1, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0))
    parked = manager.recv_nowait()
    assert isinstance(parked, Parked)
    assert parked.steps == 100 and len(parked.durations_ns) == 64  # the list keeps the last 64
    assert parked.worked_ns >= sum(parked.durations_ns) + 36 * 20_000  # the 36 unlisted steps too
