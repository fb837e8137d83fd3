"""The CUDA device, as its manager sees it, on fakes of NVML and libcuda: identity (MIG included),
compute modes, accounting, NVML failures and stuck calls, MPS, and where CUDA may be initialised.

Everything here is what a GPU run depends on and a CPU machine can check: which GPU ``cuda:N`` is,
whose memory counts, what a worker's environment says, when the manager must refuse to start. NVML is
freeride's own :class:`~freeride.devices.nvml.PyNvml` over a fake ``pynvml`` module. The worker's side
(one cap) is in ``test_cuda_caps.py``; the GPU tests in ``tests/gpu/`` check the same on a real device.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_for
from gpu_fakes import FakeDriver, FakeGpu, FakeNvml, GiB, MiB, gpu_uuid

from freeride._manager import core as C
from freeride._manager.device_poller import DevicePoller
from freeride.devices import DeviceError, DeviceName, SubprocessCudaDriver, open_device
from freeride.devices.cuda import UUID_ENV, CudaDevice, resolve_uuid, uuids_from_visible_devices
from freeride.devices.cuda_driver import parse_probe_output
from freeride.devices.mps import MpsStatus, plan_mps, probe_mps
from freeride.devices.nvml import COMPUTE_MODE_EXCLUSIVE_PROCESS, COMPUTE_MODE_PROHIBITED, GpuProcess
from freeride.errors import ConfigError
from freeride.messages import TaskSpec

NO_MPS = MpsStatus(False, "/tmp/nvidia-mps", "no MPS control pipe in /tmp/nvidia-mps")
LIVE_MPS = MpsStatus(True, "/tmp/nvidia-mps", "MPS control daemon pid 4242 at /tmp/nvidia-mps")
NO_DRIVER = FakeDriver([], fail="libcuda cannot be loaded")


def four_gpus(models: tuple[str, ...] = ("NVIDIA H100 80GB HBM3",) * 4) -> FakeNvml:
    return FakeNvml([FakeGpu(gpu_uuid(i), model=m) for i, m in enumerate(models)])


def cuda(index: int, nvml: FakeNvml, env: dict[str, str], driver: FakeDriver | None = None,
         status: MpsStatus = NO_MPS, **kw: object) -> CudaDevice:
    device = open_device(f"cuda:{index}", nvml=nvml, driver=driver or NO_DRIVER, env=env, mps_status=status,
                         **kw)  # type: ignore[arg-type]
    assert isinstance(device, CudaDevice)
    return device


def a100_with_mig() -> FakeNvml:
    """GPU 0 without MIG; GPU 1 split into two MIG devices (slot 1 empty); GPU 2 cannot do MIG."""
    slices = [FakeGpu(gpu_uuid(10, "MIG"), model="NVIDIA A100-SXM4-40GB MIG 3g.20gb", total_bytes=20 * GiB,
                      free_bytes=19 * GiB),
              None,
              FakeGpu(gpu_uuid(11, "MIG"), model="NVIDIA A100-SXM4-40GB MIG 2g.10gb", total_bytes=10 * GiB,
                      free_bytes=9 * GiB)]
    return FakeNvml([FakeGpu(gpu_uuid(0), model="NVIDIA A100-SXM4-40GB"),
                     FakeGpu(gpu_uuid(1), model="NVIDIA A100-SXM4-40GB", mig=slices),
                     FakeGpu(gpu_uuid(2), model="NVIDIA A100-SXM4-40GB", mig_capable=False)],
                    uuid_lookup_mig=False)


# ---------------------------------------------------------------------- identity


def test_cuda_n_is_the_nth_gpu_the_job_sees_not_nvmls_nth() -> None:
    nvml = four_gpus()
    # Slurm gave this job physical GPUs 2 and 3: its cuda:0 is GPU 2.
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": "2,3"}).uuid == gpu_uuid(2)
    assert cuda(1, nvml, {"CUDA_VISIBLE_DEVICES": "2,3"}).uuid == gpu_uuid(3)
    assert cuda(3, nvml, {}).uuid == gpu_uuid(3)  # unset: every GPU, PCI order


def test_visible_devices_by_uuid_prefix_resolve_to_their_gpu() -> None:
    nvml = four_gpus()
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": gpu_uuid(1)}).uuid == gpu_uuid(1)
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": gpu_uuid(2)[:12]}).uuid == gpu_uuid(2)


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


def test_regression_a_mig_slice_from_the_driver_opens_as_that_slice_not_a_guessed_gpu() -> None:
    # cuDeviceGetUuid_v2 gives the MIG device's own UUID, which matches no GPU's: it was turned into
    # "GPU-<uuid>", and opening the device failed. NVML's UUID lookup here finds GPUs only.
    nvml = a100_with_mig()
    device = cuda(0, nvml, {}, FakeDriver([gpu_uuid(11, "MIG")]))
    assert device.uuid == gpu_uuid(11, "MIG")
    assert device.total_bytes == 10 * GiB and "MIG 2g.10gb" in device.model
    assert device.free_memory_bytes() == 9 * GiB  # the slice's memory, not its GPU's
    assert device.worker_env(GiB)["CUDA_VISIBLE_DEVICES"] == gpu_uuid(11, "MIG")


def test_a_mig_slice_named_in_visible_devices_resolves_and_indices_are_refused_with_mig_on() -> None:
    nvml = a100_with_mig()
    assert cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": gpu_uuid(10, "MIG")}).uuid == gpu_uuid(10, "MIG")
    with pytest.raises(ConfigError, match="MIG is on here.*name the slice by its UUID"):
        cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": "1"})


def test_a_device_cuda_sees_and_nvml_does_not_list_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="that NVML does not list"):
        cuda(0, four_gpus(), {}, FakeDriver([gpu_uuid(9, "MIG")]))


def test_no_usable_driver_is_a_clear_config_error() -> None:
    nvml = four_gpus()
    nvml.fail = 18  # NVML_ERROR_LIB_RM_VERSION_MISMATCH
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
    lookups = nvml.calls.count("nvmlDeviceGetHandleByUUID")
    for _ in range(5):
        device.sample({"t": [1]})
    assert nvml.calls.count("nvmlDeviceGetHandleByUUID") == lookups


# ---------------------------------------------------------------------- where CUDA is initialised

PROBE = """
import os, sys
pipes = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
with open(sys.argv[1], "w") as fh:
    fh.write(pipes + "\\n" + str(os.listdir(pipes)))
print("%s\\n%s" % ("ab" * 16, "cd" * 16))
"""


def test_the_manager_asks_a_child_that_cannot_join_mps_for_the_uuids(tmp_path: Path) -> None:
    # cuInit makes a process an MPS client of a live daemon; the manager's own process never calls it.
    seen = tmp_path / "seen"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps", "CUDA_VISIBLE_DEVICES": "1"}
    driver = SubprocessCudaDriver(env, argv=[sys.executable, "-c", PROBE, str(seen)])
    assert driver.device_uuids() == [bytes.fromhex("ab" * 16), bytes.fromhex("cd" * 16)]
    pipes, listing = seen.read_text().splitlines()
    assert pipes != "/tmp/nvidia-mps" and listing == "[]"  # a private, empty pipe directory
    assert not os.path.exists(pipes)  # removed afterwards


def test_open_device_does_not_load_libcuda_in_the_managers_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*a: object) -> None:
        raise AssertionError("libcuda loaded in the manager's process")

    monkeypatch.setattr("freeride.devices.cuda_driver.LibCuda.__init__", no)
    device = open_device("cuda:0", nvml=four_gpus(), env={"CUDA_VISIBLE_DEVICES": "3"}, mps_status=NO_MPS)
    assert isinstance(device, CudaDevice) and device.uuid == gpu_uuid(3)  # no libcuda here: the variable


def test_the_probe_childs_failure_is_a_device_error_with_its_reason() -> None:
    with pytest.raises(DeviceError, match="libcuda cannot be loaded"):
        parse_probe_output(1, "error: libcuda cannot be loaded (no such file)\n")
    with pytest.raises(DeviceError, match="Killed"):
        parse_probe_output(-9, "", "Traceback ...\nKilled\n")
    assert parse_probe_output(0, "\n" + "00" * 16 + "\n") == [bytes(16)]


# ---------------------------------------------------------------------- compute modes


def exclusive() -> FakeNvml:
    nvml = four_gpus()
    nvml.gpus[0].compute_mode = COMPUTE_MODE_EXCLUSIVE_PROCESS
    return nvml


def test_exclusive_process_without_mps_refuses_to_start_saying_why() -> None:
    with pytest.raises(ConfigError, match="EXCLUSIVE_PROCESS.*only as MPS clients.*no MPS daemon serves it"):
        cuda(0, exclusive(), {})
    with pytest.raises(ConfigError, match="--mps off keeps side tasks out"):
        cuda(0, exclusive(), {}, status=LIVE_MPS, mps="off")
    device = cuda(0, exclusive(), {}, status=LIVE_MPS)  # MPS clients share an exclusive GPU: fine
    assert "EXCLUSIVE_PROCESS" in device.describe() and "MPS client" in device.describe()


def test_a_prohibited_gpu_refuses_to_start() -> None:
    nvml = four_gpus()
    nvml.gpus[2].compute_mode = COMPUTE_MODE_PROHIBITED
    with pytest.raises(ConfigError, match="PROHIBITED: no process may create a CUDA context"):
        cuda(0, nvml, {"CUDA_VISIBLE_DEVICES": "2"})


def test_a_refused_mps_off_plan_leaves_no_pipe_directory_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = plan_mps

    def recording(*a: object, **kw: object) -> object:
        plan = real(*a, **kw)  # type: ignore[arg-type]
        made.append(plan.private_pipe_directory)
        return plan

    monkeypatch.setattr("freeride.devices.plan_mps", recording)
    with pytest.raises(ConfigError):
        cuda(0, exclusive(), {}, status=LIVE_MPS, mps="off")
    assert made and made[0] and not os.path.exists(made[0])


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


def test_each_tasks_host_memory_is_read_beside_its_device_memory() -> None:
    sample = cuda(0, four_gpus(), {}).sample({"me": [os.getpid()], "gone": [2**22 + 12345]})
    assert sample.host_bytes["me"] > 10 * MiB  # this interpreter's resident set
    assert sample.host_bytes["gone"] == 0


@pytest.mark.parametrize("code", [3, 4], ids=["not-supported", "no-permission"])
def test_process_lists_nvml_will_not_give_are_empty_and_the_device_stays_up(code: int) -> None:
    nvml = four_gpus()
    nvml.gpus[0].lists_error = code
    sample = cuda(0, nvml, {}).sample({"a": [100]})
    assert sample.error == "" and dict(sample.task_bytes) == {"a": 0}  # the worker's own report counts then


@pytest.mark.parametrize("code", [13, 999, 4], ids=["function-not-found", "unknown", "no-permission"])
def test_an_mps_list_error_never_takes_the_device_down(code: int, caplog: pytest.LogCaptureFixture) -> None:
    nvml = four_gpus()
    nvml.gpus[0].processes = [GpuProcess(100, 300 * MiB)]
    nvml.gpus[0].mps_error = code
    device = cuda(0, nvml, {})
    for _ in range(3):
        sample = device.sample({"a": [100]})
        assert sample.error == "" and dict(sample.task_bytes) == {"a": 300 * MiB}
    assert caplog.text.count("cannot list MPS clients") == 1


def test_a_worker_invisible_to_nvml_is_accounted_by_its_own_report() -> None:
    # In a container NVML lists host PIDs: the worker's pid matches nothing, so the device says 0.
    core = C.SchedulerCore(C.CoreConfig(headroom_bytes=0))
    core.on_event(C.DeviceMemorySampled(10 * GiB), 0)
    core.on_event(C.TaskAdded("t", TaskSpec(target="m:T", memory_bytes=GiB), 1), 0)
    core.on_event(C.WorkerReady("t", 123, context_bytes=500 * MiB), 0)
    core.on_event(C.TaskMemorySampled("t", 0), 0)
    assert core.tasks["t"].state.value == "PARKED"
    core.on_event(C.WorkerParked("t", 0, 0, (), 0, 0, 0, "deadline", 0.0, 0), 0)
    out = core.on_event(C.WorkerUsage("t", 1200 * MiB), 0)
    assert core.tasks["t"].state.value == "FAILED"
    failure = core.tasks["t"].failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT" and "1200 MiB" in failure.message
    assert any(isinstance(a, C.Kill) for a in out)


def test_a_gpu_tasks_host_memory_beyond_its_baseline_is_capped_as_on_a_cpu_core() -> None:
    core = C.SchedulerCore(C.CoreConfig(headroom_bytes=0))
    core.on_event(C.DeviceMemorySampled(10 * GiB), 0)
    core.on_event(C.TaskAdded("t", TaskSpec(target="m:T", memory_bytes=GiB), 1), 0)
    core.on_event(C.WorkerReady("t", 123, context_bytes=500 * MiB, host_baseline_bytes=1500 * MiB), 0)
    core.on_event(C.TaskMemorySampled("t", 800 * MiB, host_bytes=2400 * MiB), 0)  # +900 MiB on the host: fine
    assert core.tasks["t"].state.value == "PARKED"
    out = core.on_event(C.TaskMemorySampled("t", 800 * MiB, host_bytes=2600 * MiB), 0)
    failure = core.tasks["t"].failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT"
    assert failure.message == ("used 1100 MiB of host memory beyond its worker's 1500 MiB baseline, over its cap of "
                               "1024 MiB (what setup or its first step allocates counts, libraries loaded there too)")
    assert any(isinstance(a, C.Kill) for a in out)


def test_the_poller_posts_host_memory_with_device_memory() -> None:
    device = cuda(0, four_gpus(), {})
    posted: list[object] = []
    poller = DevicePoller(device, posted.append, memory_poll_ms=10, device_poll_ms=10)
    poller.watch("me", [os.getpid()])
    poller.poll_once()
    [sampled] = [e for e in posted if isinstance(e, C.TaskMemorySampled)]
    assert sampled.task_id == "me" and sampled.used_bytes == 0 and sampled.host_bytes > 10 * MiB


def test_an_nvml_error_becomes_a_device_state_and_admits_nothing_until_it_clears() -> None:
    nvml = four_gpus()
    device = cuda(0, nvml, {})
    posted: list[object] = []
    poller = DevicePoller(device, posted.append, memory_poll_ms=10, device_poll_ms=10)
    poller.poll_once()
    assert isinstance(posted[-1], C.DeviceMemorySampled)
    nvml.fail = 15  # NVML_ERROR_GPU_IS_LOST
    poller.poll_once()
    poller.poll_once()  # the same problem is announced once
    problems = [e for e in posted if isinstance(e, C.DeviceStatusChanged)]
    assert len(problems) == 1 and "GPU is lost" in problems[0].problem
    core = C.SchedulerCore(C.CoreConfig(headroom_bytes=0))
    core.on_event(C.DeviceMemorySampled(10 * GiB), 0)
    core.on_event(problems[0], 0)
    out = core.on_event(C.TaskAdded("t", TaskSpec(target="m:T", memory_bytes=GiB), 1), 0)
    assert not any(isinstance(a, C.Spawn) for a in out)
    assert "cannot be read: " in core.waiting_reason(core.tasks["t"])
    nvml.fail = 0
    poller.poll_once()
    assert posted.count(C.DeviceStatusChanged("")) == 1 and isinstance(posted[-1], C.DeviceMemorySampled)
    out = core.on_event(C.DeviceStatusChanged(""), 0)
    assert any(isinstance(a, C.Spawn) for a in out)


def test_a_stuck_nvml_call_makes_the_device_unreadable_and_it_recovers_when_the_call_returns() -> None:
    nvml = four_gpus()
    device = cuda(0, nvml, {})
    device._deadline.timeout_s = 0.2
    stuck = threading.Event()
    nvml.module.hang_on["nvmlDeviceGetMemoryInfo"] = stuck
    first = device.sample({"a": [1]})
    assert "has not returned in 0 s" in first.error
    started = time.monotonic()
    second = device.sample({"a": [1]})  # fails at once while the call is still stuck
    assert "has not returned for" in second.error and time.monotonic() - started < 0.15
    del nvml.module.hang_on["nvmlDeviceGetMemoryInfo"]
    stuck.set()
    wait_for(lambda: device.sample({"a": [1]}).error == "", 10)


def test_close_never_waits_long_behind_a_stuck_nvml_call() -> None:
    nvml = FakeNvml([FakeGpu(gpu_uuid(0))], shutdown_wait_s=0.2)
    device = cuda(0, nvml, {})
    stuck = threading.Event()
    nvml.module.hang_on["nvmlDeviceGetComputeRunningProcesses"] = stuck
    failures: list[BaseException] = []

    def read() -> None:
        try:
            device.process_memory_bytes([1])
        except DeviceError as exc:
            failures.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: nvml.calls[-1] == "nvmlDeviceGetComputeRunningProcesses", 10)
    started = time.monotonic()
    device.close()
    assert time.monotonic() - started < 2 and nvml.shutdowns == 0
    stuck.set()
    reader.join(10)
    assert not reader.is_alive()
    assert len(failures) == 1 and "NVML was shut down" in str(failures[0])  # told, not given a stale figure


def test_inherited_cuda_settings_are_named_once_at_start(caplog: pytest.LogCaptureFixture) -> None:
    cuda(0, four_gpus(), {"CUDA_LAUNCH_BLOCKING": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "do not inherit CUDA_LAUNCH_BLOCKING=1, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in caplog.text


# ---------------------------------------------------------------------- MPS


def test_a_live_mps_daemon_is_one_that_serves_its_control_pipe(tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not probe_mps(env).live and "no MPS control pipe" in probe_mps(env).detail
    os.mkfifo(tmp_path / "control")
    assert "not served (no readable" in probe_mps(env).detail  # a pipe nobody reads: stale
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text("4242\n")
    assert "a stale pipe" in probe_mps(env, process_name=lambda pid: "nvidia-cuda-mps-control").detail
    reader = os.open(tmp_path / "control", os.O_RDONLY | os.O_NONBLOCK)  # the daemon holds it open
    try:
        status = probe_mps(env, process_name=lambda pid: "nvidia-cuda-mps-control")
        assert status.live and status.pipe_directory == str(tmp_path) and "pid 4242" in status.detail
        other_ns = probe_mps(env, process_name=lambda pid: None)  # the daemon's pid is not ours to see
        assert other_ns.live and "another PID namespace" in other_ns.detail
    finally:
        os.close(reader)


def test_a_control_socket_is_live_only_while_something_accepts_on_it(tmp_path: Path) -> None:
    short = Path(f"/tmp/fr-mps-{os.getpid()}")
    short.mkdir(exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(short)}
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(short / "control"))
        server.listen(1)
        assert probe_mps(env, process_name=lambda pid: None).live
        server.close()  # the socket file stays, nobody accepts: a daemon that died
        assert not probe_mps(env, process_name=lambda pid: None).live
    finally:
        for f in short.iterdir():
            f.unlink()
        short.rmdir()


def test_mps_clients_get_low_priority_an_sm_share_and_the_cap_pinned() -> None:
    device = cuda(0, four_gpus(), {}, status=LIVE_MPS, mps_sm_percent=30)
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
    plan.release()
    assert not os.path.exists(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert plan_mps("off", status=NO_MPS).worker_env(GiB) == {}
    assert plan_mps("auto", status=NO_MPS).worker_env(GiB) == {}

