"""One cap inside a CUDA worker, on a fake torch.cuda: the context is measured first, torch's
allocator gets the rest less a headroom for the context's growth, CuPy allocates through torch's
allocator, the context is measured again after setup and the first step, and CUDA settings the
manager's environment carries are dropped. A real GPU checks the same in ``tests/gpu/``."""

from __future__ import annotations

import os

import pytest
from gpu_fakes import FakeCudaRuntime, FakeCupy, FakeDriver, GiB, MiB, gpu_uuid

from freeride.devices import DeviceName, WorkerSetupError
from freeride.devices.cuda_driver import UUID_ENV
from freeride.devices.cuda_worker import CONTEXT_HEADROOM_BYTES, CudaWorkerDevice, headroom_bytes, route_cupy_through


def worker(runtime: FakeCudaRuntime, driver: FakeDriver | None = None,
           env: dict[str, str] | None = None) -> CudaWorkerDevice:
    return CudaWorkerDevice(DeviceName("cuda", 3), runtime, driver or FakeDriver([]),
                            env={UUID_ENV: gpu_uuid(3), **(env or {})})


@pytest.fixture(autouse=True)
def _no_niceness(monkeypatch: pytest.MonkeyPatch) -> None:
    # prepare() lowers this process's priority: a test must not do that to the test run.
    monkeypatch.setattr("freeride.devices.cuda_worker.lower_priority", lambda: None)


def test_the_allocator_gets_the_cap_minus_the_measured_context_and_a_headroom() -> None:
    rt = FakeCudaRuntime(context_bytes=500 * MiB, workspace_bytes=8 * MiB)
    driver = FakeDriver([])
    dev = worker(rt, driver)
    assert dev.torch_device == "cuda:0"  # a worker sees only its GPU
    dev.prepare(2 * GiB)
    assert rt.contexts == 1 and dev.context_bytes == 500 * MiB
    share = 2 * GiB - 500 * MiB - 8 * MiB
    assert headroom_bytes(share) == share // 8
    assert rt.limits == [2 * GiB - 500 * MiB - share // 8]  # torch's (and CuPy's) share
    assert rt.routed and dev.cupy_routed
    assert driver.blocking_sync == [0] and rt.threads == 2
    rt.reserve(1 * GiB)
    assert dev.used_bytes() == 500 * MiB + GiB


def test_the_headroom_is_an_eighth_of_the_share_at_most_256_mib() -> None:
    assert headroom_bytes(64 * MiB) == 8 * MiB
    assert headroom_bytes(40 * GiB) == CONTEXT_HEADROOM_BYTES == 256 * MiB


def test_without_nvml_sight_the_context_is_the_free_memory_it_took() -> None:
    rt = FakeCudaRuntime(context_bytes=600 * MiB, workspace_bytes=8 * MiB, visible=False)
    dev = worker(rt)
    dev.prepare(2 * GiB)
    assert dev.context_bytes == 600 * MiB
    share = 2 * GiB - 608 * MiB
    assert rt.limits == [share - headroom_bytes(share) + 8 * MiB]
    rt.reserve(300 * MiB)
    assert dev.used_bytes() == 900 * MiB  # the self-report the manager uses in a container


def test_a_cap_below_the_context_is_refused_with_the_figure() -> None:
    dev = worker(FakeCudaRuntime(context_bytes=500 * MiB))
    # 500 MiB context + 8 MiB cuBLAS workspace + the 64 MiB the allocator needs at least.
    with pytest.raises(WorkerSetupError, match=r"context takes 500 MiB on this GPU, so give at least 572 MiB") as exc:
        dev.prepare(512 * MiB)
    assert exc.value.kind == "MEMORY_LIMIT"


def test_growth_within_the_headroom_leaves_the_allocators_share_alone() -> None:
    rt = FakeCudaRuntime(context_bytes=400 * MiB, workspace_bytes=0)
    dev = worker(rt)
    dev.prepare(4 * GiB)
    limit = rt.limits[-1]
    rt.context_bytes = 500 * MiB  # setup's first kernels loaded: 100 MiB, under the 256 MiB headroom
    dev.synchronize()
    assert dev.context_bytes == 500 * MiB and rt.limits == [limit]


def test_growth_past_the_headroom_shrinks_the_allocators_share_after_the_first_step() -> None:
    rt = FakeCudaRuntime(context_bytes=400 * MiB, workspace_bytes=0)
    dev = worker(rt)
    dev.prepare(2 * GiB)
    dev.synchronize()  # after setup: nothing new
    rt.context_bytes = 700 * MiB  # the first step's kernels loaded
    rt.reserve(GiB)
    dev.synchronize()  # after the first step: measured at once, not at the park
    assert rt.limits[-1] == 2 * GiB - 700 * MiB  # context + allocator = cap
    assert dev.peak_bytes() == 700 * MiB + GiB
    rt.context_bytes = 900 * MiB
    dev.synchronize()  # later steps are not measured on the step path ...
    assert dev.context_bytes == 700 * MiB
    assert dev.used_bytes() == 900 * MiB + GiB  # ... but at every park
    assert rt.limits[-1] == 2 * GiB - 900 * MiB


def test_a_parks_measure_asks_nvml_for_the_processes_once() -> None:
    # NVML's process list is a driver call of up to a millisecond or so: the park's measure and the context's
    # remeasure share one.
    class Counting(FakeCudaRuntime):
        queries = 0

        def own_device_bytes(self) -> int | None:
            self.queries += 1
            return super().own_device_bytes()

    rt = Counting(context_bytes=400 * MiB, workspace_bytes=0)
    dev = worker(rt)
    dev.prepare(2 * GiB)
    rt.reserve(GiB)
    rt.queries = 0
    assert dev.used_bytes() == 400 * MiB + GiB
    assert rt.queries == 1


def test_the_share_never_drops_below_what_the_allocator_already_holds() -> None:
    rt = FakeCudaRuntime(context_bytes=400 * MiB, workspace_bytes=0)
    dev = worker(rt)
    dev.prepare(2 * GiB)
    rt.reserve(1500 * MiB)
    rt.context_bytes = 800 * MiB  # 400 + 1500 + 400 MiB growth: over the cap; the watchdog judges that
    assert dev.used_bytes() == 2300 * MiB
    assert rt.limits[-1] == 1500 * MiB


def test_a_command_task_worker_creates_no_context_of_its_own() -> None:
    rt = FakeCudaRuntime()
    dev = worker(rt)
    dev.prepare(GiB, command=True)
    dev.synchronize()
    assert (rt.contexts, rt.syncs, rt.limits, dev.used_bytes()) == (0, 0, [], 0)


def test_cuda_settings_from_the_managers_environment_are_dropped_before_cuda_starts() -> None:
    env = {"CUDA_LAUNCH_BLOCKING": "1", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "HOME": "/root"}
    dev = worker(FakeCudaRuntime(), env=env)
    dev.prepare(2 * GiB, command=True)  # a command inherits the worker's environment: dropped for it too
    assert dev.dropped_settings == ["CUDA_LAUNCH_BLOCKING=1", "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"]
    assert dev._env == {UUID_ENV: gpu_uuid(3), "HOME": "/root"}


def test_the_host_baseline_is_the_workers_resident_set() -> None:
    dev = worker(FakeCudaRuntime())
    assert dev.host_baseline_bytes() > 10 * MiB
    with open(f"/proc/{os.getpid()}/statm") as fh:
        assert dev.host_baseline_bytes() == pytest.approx(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
                                                          rel=0.2)


def test_cupy_allocates_through_the_one_allocator_and_gives_back() -> None:
    cupy = FakeCupy()
    allocated: list[tuple[int, int]] = []
    freed: list[int] = []

    def alloc(size: int, stream: int) -> int:
        allocated.append((size, stream))
        return 0x1000 * len(allocated)

    route_cupy_through(cupy, alloc, freed.append, 0)
    pointer = cupy.allocator(4096)
    assert allocated == [(4096, 0x5EED)] and pointer.ptr == 0x1000  # on CuPy's current stream
    empty = cupy.allocator(0)
    assert empty.ptr == 0 and len(allocated) == 1  # nothing to allocate
    del pointer, empty
    assert freed == [0x1000]  # released when CuPy drops the memory
