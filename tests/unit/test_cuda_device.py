"""The CUDA device on fakes of NVML, libcuda, torch.cuda and CuPy: identity, accounting, caps, MPS.

Everything here is what a GPU run depends on and a CPU machine can check: which GPU ``cuda:N`` is,
whose memory counts, how one cap is split, what a worker's environment says. The GPU tests in
``tests/gpu/`` check the same on a real device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpu_fakes import FakeCudaRuntime, FakeCupy, FakeDriver, FakeGpu, FakeNvml, GiB, MiB, gpu_uuid

from freeride._manager import core as C
from freeride._manager.device_poller import DevicePoller
from freeride.devices import DeviceName, WorkerSetupError, open_device
from freeride.devices.cuda import (
    UUID_ENV,
    CudaDevice,
    CudaWorkerDevice,
    resolve_uuid,
    route_cupy_through,
    uuids_from_visible_devices,
)
from freeride.devices.mps import MpsStatus, plan_mps, probe_mps
from freeride.devices.nvml import GpuProcess
from freeride.errors import ConfigError

NO_MPS = MpsStatus(False, "/tmp/nvidia-mps", "no MPS control pipe in /tmp/nvidia-mps")
LIVE_MPS = MpsStatus(True, "/tmp/nvidia-mps", "MPS control daemon pid 4242 at /tmp/nvidia-mps")


def four_gpus(models: tuple[str, ...] = ("NVIDIA H100 80GB HBM3",) * 4) -> FakeNvml:
    return FakeNvml([FakeGpu(gpu_uuid(i), model=m) for i, m in enumerate(models)])


def cuda(index: int, nvml: FakeNvml, env: dict[str, str], driver: FakeDriver | None = None,
         mps: MpsStatus = NO_MPS, **kw: object) -> CudaDevice:
    device = open_device(f"cuda:{index}", nvml=nvml, driver=driver, env=env, mps_status=mps, **kw)  # type: ignore[arg-type]
    assert isinstance(device, CudaDevice)
    return device


# ---------------------------------------------------------------------- identity


def test_cuda_n_is_the_nth_gpu_the_job_sees_not_nvmls_nth() -> None:
    nvml = four_gpus()
    # Slurm gave this job physical GPUs 2 and 3: its cuda:0 is GPU 2.
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": "2,3"}).uuid == gpu_uuid(2)
    assert cuda(1, nvml, {"CUDA_VISIBLE_DEVICES": "2,3"}).uuid == gpu_uuid(3)
    assert cuda(3, nvml, {}).uuid == gpu_uuid(3)  # unset: every GPU, PCI order


def test_visible_devices_by_uuid_prefix_and_mig_resolve_to_their_gpu() -> None:
    nvml = FakeNvml([FakeGpu(gpu_uuid(0)), FakeGpu(gpu_uuid(1, "MIG"))])
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": gpu_uuid(1, "MIG")}).uuid == gpu_uuid(1, "MIG")
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": gpu_uuid(0)[:12]}).uuid == gpu_uuid(0)


def test_visible_devices_end_at_the_first_entry_naming_no_gpu_as_cuda_does() -> None:
    nvml = four_gpus()
    assert uuids_from_visible_devices("1,7,2", nvml) == [gpu_uuid(1)]
    assert uuids_from_visible_devices("", nvml) == []
    assert uuids_from_visible_devices("1,1", nvml) == [gpu_uuid(1)]
    with pytest.raises(ConfigError, match=r"this job sees 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=1,7,2\)"):
        cuda(1, nvml, {"CUDA_VISIBLE_DEVICES": "1,7,2"})


def test_the_cuda_driver_numbering_wins_over_reading_the_variable() -> None:
    # Mixed models, fastest first: CUDA's order is not NVML's; the driver says which is which.
    nvml = four_gpus(("NVIDIA A10", "NVIDIA H100 80GB HBM3", "NVIDIA A10", "NVIDIA H100 80GB HBM3"))
    driver = FakeDriver([gpu_uuid(1), gpu_uuid(3), gpu_uuid(0), gpu_uuid(2)])
    assert cuda(0, nvml, {}, driver).uuid == gpu_uuid(1)
    assert resolve_uuid(DeviceName("cuda", 2), nvml, driver, {}) == gpu_uuid(0)
    # A driver that fails falls back to the variable.
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": "2"}, FakeDriver([], fail="CUDA error 100")).uuid == gpu_uuid(2)


def test_indices_on_mixed_models_without_pci_order_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    nvml = four_gpus(("NVIDIA A10", "NVIDIA H100 80GB HBM3", "NVIDIA A10", "NVIDIA H100 80GB HBM3"))
    uuids_from_visible_devices("0,1", nvml, None)
    assert "name GPUs by UUID" in caplog.text
    caplog.clear()
    uuids_from_visible_devices("0,1", nvml, "PCI_BUS_ID")
    assert caplog.text == ""


def test_no_usable_driver_is_a_clear_config_error() -> None:
    nvml = four_gpus()
    nvml.fail = "Driver/library version mismatch"
    with pytest.raises(ConfigError, match="cannot list the GPUs.*version mismatch"):
        cuda(0, nvml, {})
    assert nvml.shutdowns == 1


def test_a_worker_sees_only_its_gpu_by_uuid_with_few_threads() -> None:
    device = cuda(1, four_gpus(), {"CUDA_VISIBLE_DEVICES": "2,3"})
    env = device.worker_env(GiB)
    assert env["CUDA_VISIBLE_DEVICES"] == env[UUID_ENV] == gpu_uuid(3)
    assert env["OMP_NUM_THREADS"] == "2"
    assert not any(k.startswith("CUDA_MPS") for k in env)


def test_nvml_handles_are_looked_up_once() -> None:
    nvml = four_gpus()
    device = cuda(0, nvml, {})
    lookups = nvml.calls.count("by_uuid")
    for _ in range(5):
        device.sample({"t": [1]})
    assert nvml.calls.count("by_uuid") == lookups


# ---------------------------------------------------------------------- accounting


def test_task_usage_counts_compute_graphics_and_mps_lists_once_per_pid() -> None:
    nvml = four_gpus()
    gpu = nvml.gpus[0]
    gpu.processes = [GpuProcess(100, 300 * MiB), GpuProcess(999, 5 * GiB), GpuProcess(101, None)]
    gpu.mps = [GpuProcess(100, 310 * MiB), GpuProcess(200, 700 * MiB)]  # 200: an MPS client only
    sample = cuda(0, nvml, {}).sample({"a": [100, 101], "b": [200], "c": [300]})
    assert sample.error == ""
    assert dict(sample.task_bytes) == {"a": 310 * MiB, "b": 700 * MiB, "c": 0}
    assert sample.free_bytes == gpu.free_bytes


def test_a_worker_invisible_to_nvml_is_accounted_by_its_own_report() -> None:
    # In a container NVML lists host PIDs: the worker's pid matches nothing, so the device says 0.
    core = C.SchedulerCore(C.CoreConfig(headroom_bytes=0))
    spec_cap = 1 * GiB
    from freeride.messages import TaskSpec

    core.on_event(C.DeviceMemorySampled(10 * GiB), 0)
    core.on_event(C.TaskAdded("t", TaskSpec(target="m:T", memory_bytes=spec_cap), 1), 0)
    core.on_event(C.WorkerReady("t", 123, context_bytes=500 * MiB), 0)
    core.on_event(C.TaskMemorySampled("t", 0), 0)
    assert core.tasks["t"].state.value == "PARKED"
    out = core.on_event(C.WorkerParked("t", 0, 0, (), 0, 0, 0, "deadline", 0.0, 0, device_bytes=1200 * MiB), 0)
    assert core.tasks["t"].state.value == "FAILED"
    failure = core.tasks["t"].failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT" and "1200 MiB" in failure.message
    assert any(isinstance(a, C.Kill) for a in out)


def test_an_nvml_error_becomes_a_device_state_and_admits_nothing_until_it_clears() -> None:
    nvml = four_gpus()
    device = cuda(0, nvml, {})
    posted: list[object] = []
    poller = DevicePoller(device, posted.append, memory_poll_ms=10, device_poll_ms=10)
    poller.poll_once()
    assert isinstance(posted[-1], C.DeviceMemorySampled)
    nvml.fail = "GPU is lost"
    poller.poll_once()
    poller.poll_once()  # the same problem is announced once
    problems = [e for e in posted if isinstance(e, C.DeviceStatusChanged)]
    assert len(problems) == 1 and "GPU is lost" in problems[0].problem
    core = C.SchedulerCore(C.CoreConfig(headroom_bytes=0))
    from freeride.messages import TaskSpec

    core.on_event(C.DeviceMemorySampled(10 * GiB), 0)
    core.on_event(problems[0], 0)
    out = core.on_event(C.TaskAdded("t", TaskSpec(target="m:T", memory_bytes=GiB), 1), 0)
    assert not any(isinstance(a, C.Spawn) for a in out)
    assert "cannot be read: " in core.waiting_reason(core.tasks["t"])
    nvml.fail = ""
    poller.poll_once()
    assert posted.count(C.DeviceStatusChanged("")) == 1 and isinstance(posted[-1], C.DeviceMemorySampled)
    out = core.on_event(C.DeviceStatusChanged(""), 0)
    assert any(isinstance(a, C.Spawn) for a in out)


# ---------------------------------------------------------------------- one cap


def worker(runtime: FakeCudaRuntime, driver: FakeDriver | None = None) -> CudaWorkerDevice:
    return CudaWorkerDevice(DeviceName("cuda", 3), runtime, driver or FakeDriver([]),
                            env={UUID_ENV: gpu_uuid(3)})


@pytest.fixture(autouse=True)
def _no_niceness(monkeypatch: pytest.MonkeyPatch) -> None:
    # prepare() lowers this process's priority: a test must not do that to the test run.
    monkeypatch.setattr("freeride.devices.cuda.lower_priority", lambda: None)


def test_the_allocator_gets_the_cap_minus_the_measured_context() -> None:
    rt = FakeCudaRuntime(context_bytes=500 * MiB, workspace_bytes=8 * MiB)
    driver = FakeDriver([])
    dev = worker(rt, driver)
    assert dev.torch_device == "cuda:0"  # a worker sees only its GPU
    dev.prepare(2 * GiB)
    assert rt.contexts == 1 and dev.context_bytes == 500 * MiB
    assert rt.limits == [2 * GiB - 500 * MiB]  # torch's (and CuPy's) share: context + allocator = cap
    assert rt.routed and dev.cupy_routed
    assert driver.blocking_sync == [0] and rt.threads == 2
    rt.reserve(1 * GiB)
    assert dev.used_bytes() == 500 * MiB + GiB


def test_without_nvml_sight_the_context_is_the_free_memory_it_took() -> None:
    rt = FakeCudaRuntime(context_bytes=600 * MiB, workspace_bytes=8 * MiB, visible=False)
    dev = worker(rt)
    dev.prepare(2 * GiB)
    assert dev.context_bytes == 600 * MiB
    assert rt.limits == [2 * GiB - 600 * MiB]
    rt.reserve(300 * MiB)
    assert dev.used_bytes() == 900 * MiB  # the self-report the manager uses in a container


def test_a_cap_below_the_context_is_refused_with_the_figure() -> None:
    dev = worker(FakeCudaRuntime(context_bytes=500 * MiB))
    # 500 MiB context + 8 MiB cuBLAS workspace + the 64 MiB the allocator needs at least.
    with pytest.raises(WorkerSetupError, match=r"context takes 500 MiB on this GPU, so give at least 572 MiB") as exc:
        dev.prepare(512 * MiB)
    assert exc.value.kind == "MEMORY_LIMIT"


def test_a_context_grown_by_lazily_loaded_kernels_shrinks_the_allocator_share() -> None:
    rt = FakeCudaRuntime(context_bytes=400 * MiB, workspace_bytes=0)
    dev = worker(rt)
    dev.prepare(2 * GiB)
    rt.context_bytes = 550 * MiB  # a task's first new kernels loaded
    rt.reserve(GiB)
    assert dev.used_bytes() == 550 * MiB + GiB
    assert rt.limits[-1] == 2 * GiB - 550 * MiB
    assert dev.peak_bytes() == 550 * MiB + GiB


def test_a_command_task_worker_creates_no_context_of_its_own() -> None:
    rt = FakeCudaRuntime()
    dev = worker(rt)
    dev.prepare(GiB, command=True)
    dev.synchronize()
    assert (rt.contexts, rt.syncs, rt.limits, dev.used_bytes()) == (0, 0, [], 0)


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


# ---------------------------------------------------------------------- MPS


def test_a_live_mps_daemon_is_one_whose_pid_file_names_a_running_control_daemon(tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not probe_mps(env).live and "no MPS control pipe" in probe_mps(env).detail
    os.mkfifo(tmp_path / "control")
    assert "no readable" in probe_mps(env).detail
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text("4242\n")
    assert "stale pipe" in probe_mps(env, process_name=lambda pid: None).detail
    assert not probe_mps(env, process_name=lambda pid: "bash").live
    status = probe_mps(env, process_name=lambda pid: "nvidia-cuda-mps-control")
    assert status.live and status.pipe_directory == str(tmp_path)


def test_mps_clients_get_low_priority_an_sm_share_and_the_cap_pinned() -> None:
    device = cuda(0, four_gpus(), {}, mps=LIVE_MPS, mps_sm_percent=30)
    env = device.worker_env(1536 * MiB)
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1536M"  # device 0: the worker sees one GPU
    assert "MPS client" in device.describe()


def test_mps_require_without_a_live_daemon_refuses_to_start() -> None:
    with pytest.raises(ConfigError, match="--mps require: no live MPS control daemon"):
        plan_mps("require", status=NO_MPS)
    with pytest.raises(ConfigError, match="--mps-sm-percent"):
        plan_mps("auto", 0, status=LIVE_MPS)
    with pytest.raises(ConfigError, match="--mps must be"):
        plan_mps("sometimes", status=LIVE_MPS)


def test_mps_off_keeps_workers_out_of_a_live_daemon() -> None:
    plan = plan_mps("off", status=LIVE_MPS)
    env = plan.worker_env(GiB)
    assert set(env) == {"CUDA_MPS_PIPE_DIRECTORY"} and env["CUDA_MPS_PIPE_DIRECTORY"] != LIVE_MPS.pipe_directory
    assert os.path.isdir(env["CUDA_MPS_PIPE_DIRECTORY"]) and not os.listdir(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.rmdir(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert plan_mps("off", status=NO_MPS).worker_env(GiB) == {}
    assert plan_mps("auto", status=NO_MPS).worker_env(GiB) == {}
