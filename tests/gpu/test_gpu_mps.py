"""MPS on a real GPU, with a control daemon of the test's own: a live daemon is seen as live, a manager
with ``--mps require`` makes its workers clients at below-normal priority, and ``--mps off`` keeps them
out of the same daemon. Skipped where ``nvidia-cuda-mps-control`` cannot start."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BubbleFeeder
from daemons import socket_path, start_daemon
from gpu_support import GPU

from bench.gpu.mps_daemon import MpsDaemon
from freeride._wire.client import ControlClient
from freeride.devices.mps import probe_mps
from freeride.endpoints import Endpoint
from freeride.messages import TaskSpec

pytestmark = GPU
GiB = 2**30
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def mps(monkeypatch: pytest.MonkeyPatch) -> Iterator[MpsDaemon]:
    daemon = MpsDaemon(Path(f"/tmp/fr-test-mps-{os.getpid()}"))
    why = daemon.start()
    if why:
        pytest.skip(f"no MPS here: {why}")
    for key, value in daemon.env().items():
        monkeypatch.setenv(key, value)  # the managers started below see this daemon
    yield daemon
    daemon.stop()


@pytest.mark.parametrize("mode", ["require", "off"])
def test_workers_join_a_live_daemon_only_when_told_to(mps: MpsDaemon, tmp_path: Path, mode: str) -> None:
    assert probe_mps().live
    sock = socket_path(f"gpu-mps-{mode}")
    daemon = start_daemon(sock, tmp_path / "state", "--mps", mode, device="cuda:0")
    endpoint = Endpoint("unix", str(sock))
    try:
        with ControlClient(endpoint) as client:
            described = client.stats().device_info
            assert ("MPS client" in described) == (mode == "require"), described
            task = client.submit(TaskSpec(target="bench.gpu.tasks:KernelStorm", args={"size": 2048, "kernels": 4},
                                          memory_bytes=2 * GiB, working_dir=str(REPO))).task_id
            feeder = BubbleFeeder(endpoint, free_memory_bytes=40 * GiB)
            feeder.run_until(lambda: client.get(task).steps >= 3 or client.get(task).state == "FAILED",
                             length_ms=100, timeout_s=120)
            feeder.close()
            info = client.get(task)
        assert info.state != "FAILED", info.failure
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
