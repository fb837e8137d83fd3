"""A worker on a CPU core checks its own resident set between steps and tells the manager at once when it is over
its cap (the manager's watchdog polls every 50 ms, in which a fast leak doubled a stranger's cap). A fake core
scripts the resident set; the real reading is tested against ``/proc`` at the end."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from freeride._channel import Channel, Grant, Init, Parked, Usage
from freeride._worker import runtime as runtime_module
from freeride._worker.runtime import WorkerRuntime
from freeride.devices import DeviceName, WorkerDevice
from freeride.devices.cpu import CpuWorkerDevice, rss_bytes
from freeride.task import SideTask, TaskContext

MS = 1_000_000
MiB = 2**20


class ScriptedCore(WorkerDevice):
    """A core whose resident set grows 2 MiB a step from 100 MiB (None: it cannot be read here)."""

    def __init__(self, readable: bool = True) -> None:
        super().__init__(DeviceName("cpu", 0))
        self.readable = readable
        self.resident = 100 * MiB

    @property
    def torch_device(self) -> str:
        return "cpu"

    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        pass

    def resident_bytes(self) -> int | None:
        return self.resident if self.readable else None


class Leaky(SideTask):
    def __init__(self, core: ScriptedCore, steps: int) -> None:
        self.core, self.n, self.steps = core, 0, steps

    def setup(self, ctx: TaskContext) -> None:
        pass

    def step(self) -> None:
        self.core.resident += 2 * MiB
        self.n += 1

    def done(self) -> bool:
        return self.n >= self.steps

    def progress(self) -> float:
        return float(self.n)


def _grant(worker: Channel, tmp_path: Path, core: ScriptedCore, steps: int) -> WorkerRuntime:
    rt = WorkerRuntime(worker, Init(task_id="t-1", memory_limit_bytes=40 * MiB, work_dir=str(tmp_path / "work"),
                                    checkpoint_dir=str(tmp_path / "ckpt"), device="cpu:0"))
    rt.device = core
    if core.readable:
        rt._resident_cap = 100 * MiB + rt.limit  # as run() sets it from the baseline it sends with ready
    rt.task, rt.setup_done = Leaky(core, steps), True
    rt._run_grant(Grant(1, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0))
    return rt


def _received(manager: Channel) -> list[object]:
    got = []
    while (msg := manager.recv_nowait()) is not None:
        got.append(msg)
    return got


def test_the_step_that_takes_the_resident_set_over_its_cap_is_reported_once_and_at_once(
    tmp_path: Path, channels: tuple[Channel, Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "RESIDENT_CHECK_NS", 0)  # every step read (the real one: each 1 ms)
    manager, worker = channels
    _grant(worker, tmp_path, ScriptedCore(), steps=30)
    usages = [m for m in _received(manager) if isinstance(m, Usage)]
    # 100 MiB baseline + 40 MiB cap: the 21st step (142 MiB) is the first over it, and only it is told
    assert [u.device_bytes for u in usages] == [142 * MiB]


def test_within_its_cap_or_where_the_resident_set_cannot_be_read_nothing_is_told(
    tmp_path: Path, channels: tuple[Channel, Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "RESIDENT_CHECK_NS", 0)
    manager, worker = channels
    _grant(worker, tmp_path, ScriptedCore(), steps=20)  # 140 MiB: at the cap, not over it
    assert not [m for m in _received(manager) if isinstance(m, Usage)]
    _grant(worker, tmp_path, ScriptedCore(readable=False), steps=30)
    got = _received(manager)
    assert not [m for m in got if isinstance(m, Usage)] and [m for m in got if isinstance(m, Parked)]


def test_a_cpu_cores_resident_set_is_the_watchdogs_figure_and_follows_what_the_process_touches() -> None:
    core = CpuWorkerDevice(DeviceName("cpu", 0))
    before = core.resident_bytes()
    assert before is not None and abs(before - rss_bytes(os.getpid())) < 8 * MiB
    block = bytearray(64 * MiB)  # zero pages are not resident until written
    block[:: os.sysconf("SC_PAGE_SIZE")] = b"\x01" * len(range(0, len(block), os.sysconf("SC_PAGE_SIZE")))
    after = core.resident_bytes()
    assert after is not None and after - before >= 48 * MiB
    del block
