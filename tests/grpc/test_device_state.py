"""A manager of a GPU whose NVML fails: NOT_SERVING with the reason, never a crash; and caps that the
CUDA context cannot fit in are refused at submit. The GPU is faked (``gpu_fakes``); the manager,
its loop and its gRPC services are real."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, wait_for
from gpu_fakes import FakeGpu, FakeNvml, gpu_uuid

from freeride._manager.daemon import Manager
from freeride._wire.client import ControlClient, health_status
from freeride.devices import open_device
from freeride.devices.mps import MpsStatus
from freeride.endpoints import Endpoint
from freeride.errors import RequestRejected
from freeride.messages import TaskSpec

MiB = 2**20


@pytest.fixture
def gpu_manager(tmp_path: Path) -> Iterator[tuple[Manager, FakeNvml]]:
    # No room past the headroom: tasks are accepted but never started (no worker on this CPU machine).
    nvml = FakeNvml([FakeGpu(gpu_uuid(0)), FakeGpu(gpu_uuid(1), free_bytes=128 * MiB)])
    device = open_device("cuda:0", nvml=nvml, env={"CUDA_VISIBLE_DEVICES": "1"},
                         mps_status=MpsStatus(False, "/tmp/nvidia-mps", "no MPS"))
    sock = Path(f"/tmp/fr-gpu-{id(tmp_path) % 10**6}.sock")
    manager = Manager(device, endpoint=Endpoint("unix", str(sock)), state_dir=tmp_path / "state",
                      memory_poll_ms=10.0, device_poll_ms=10.0)
    manager.start()
    yield manager, nvml
    manager.stop()


def test_an_nvml_failure_makes_the_manager_not_serving_with_the_reason_and_it_recovers(
    gpu_manager: tuple[Manager, FakeNvml],
) -> None:
    manager, nvml = gpu_manager
    with ControlClient(manager.endpoint) as client:
        stats = client.stats()
        assert gpu_uuid(1) in stats.device_info and stats.device_problem == ""  # cuda:0 of this job is GPU 1
        wait_for(lambda: health_status(manager.endpoint) == "SERVING", 10)
        nvml.fail = 18  # NVML_ERROR_LIB_RM_VERSION_MISMATCH: "Driver/library version mismatch"
        wait_for(lambda: health_status(manager.endpoint) == "NOT_SERVING", 10)
        stats = client.stats()
        assert "version mismatch" in stats.device_problem
        task = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=64 * MiB, working_dir=str(TESTS_DIR)))
        assert "the device cannot be read" in client.get(task.task_id).waiting_reason
        nvml.fail = 0
        wait_for(lambda: health_status(manager.endpoint) == "SERVING", 10)
        assert client.stats().device_problem == ""


def test_a_cap_below_the_measured_cuda_context_is_refused_at_submit_with_the_figure(
    gpu_manager: tuple[Manager, FakeNvml],
) -> None:
    manager, _ = gpu_manager
    manager.loop.core.context_bytes = 500 * MiB  # as the first worker on this GPU reported it
    with ControlClient(manager.endpoint) as client:
        with pytest.raises(RequestRejected, match=r"its CUDA context takes 500 MiB .* give at least 564 MiB"):
            client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=512 * MiB, working_dir=str(TESTS_DIR)))
        accepted = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=564 * MiB,
                                          working_dir=str(TESTS_DIR)))
        assert accepted.state == "SUBMITTED"


def test_a_cap_above_all_the_gpus_memory_is_refused_at_submit(gpu_manager: tuple[Manager, FakeNvml]) -> None:
    manager, _ = gpu_manager
    with ControlClient(manager.endpoint) as client, pytest.raises(
            RequestRejected, match=r"memory 100.0 GiB is more than cuda:0 has in all \(80.0 GiB\)"):
        client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=100 * 1024 * MiB,
                               working_dir=str(TESTS_DIR)))
