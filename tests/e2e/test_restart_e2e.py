"""End-to-end: a real manager daemon process, killed with SIGKILL and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import TESTS_DIR, BubbleFeeder, wait_for

from freeride._wire.client import ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.messages import TaskSpec

pytestmark = pytest.mark.e2e


def start_daemon(sock: Path, state: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", "cpu:0", "--endpoint", f"unix:{sock}",
         "--state-dir", str(state)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    endpoint = Endpoint("unix", str(sock))

    def serving() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "manager exited"
        try:
            return health_status(endpoint, timeout_s=1) == "SERVING"
        except ManagerUnavailable:
            return False

    wait_for(serving, 30)
    return proc


def test_kill_9_then_restart_loses_no_task_and_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    sock = Path(f"/tmp/fr-restart-{os.getpid()}.sock")
    state = tmp_path / "state"
    daemon = start_daemon(sock, state)
    endpoint = Endpoint("unix", str(sock))
    client = ControlClient(endpoint)
    try:
        counter = client.submit(TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0},
                                         memory_bytes=2**29, working_dir=str(TESTS_DIR),
                                         checkpoint_interval_s=0.05))
        waiting = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=2**29,
                                         working_dir=str(TESTS_DIR), priority=-1, name="second"))
        feeder = BubbleFeeder(endpoint)
        feeder.run_until(lambda: client.get(counter.task_id).checkpoint_step >= 30, length_ms=25)
        checkpoint = client.get(counter.task_id).checkpoint_step
        worker_pid = client.get(counter.task_id).pid
        daemon.send_signal(signal.SIGKILL)  # mid-stream, with bubbles still coming
        daemon.wait(10)
        feeder.stream.close()
        wait_for(lambda: not psutil.pid_exists(worker_pid) or psutil.Process(worker_pid).status() == "zombie", 10)

        daemon = start_daemon(sock, state)
        client.close()
        client = ControlClient(endpoint)
        tasks = {t.task_id: t for t in client.list()}
        assert set(tasks) == {counter.task_id, waiting.task_id}
        assert tasks[counter.task_id].restarts == 1
        feeder = BubbleFeeder(endpoint)
        feeder.run_until(lambda: client.get(counter.task_id).steps > checkpoint, length_ms=25)
        feeder.close()
        resumed = client.get(counter.task_id)
        assert resumed.state in ("PARKED", "RUNNING")
        log = (state / "tasks" / counter.task_id / "worker.log").read_text()
        assert f"resumed from ckpt-{checkpoint}.pt" in log or "resumed from ckpt-" in log
        # The restored counter continued from its checkpoint rather than from zero.
        assert resumed.progress >= checkpoint
    finally:
        client.close()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0


def test_sigterm_drains_and_the_next_manager_resumes(tmp_path: Path) -> None:
    sock = Path(f"/tmp/fr-drain-{os.getpid()}.sock")
    state = tmp_path / "state"
    daemon = start_daemon(sock, state)
    endpoint = Endpoint("unix", str(sock))
    with ControlClient(endpoint) as client:
        task = client.submit(TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0}, memory_bytes=2**29,
                                      working_dir=str(TESTS_DIR)))
        feeder = BubbleFeeder(endpoint)
        feeder.run_until(lambda: client.get(task.task_id).steps >= 10)
        feeder.close()
        steps = client.get(task.task_id).steps
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    assert not sock.exists()
    daemon = start_daemon(sock, state)
    try:
        with ControlClient(endpoint) as client:
            info = client.get(task.task_id)
            assert info.state in ("SUBMITTED", "STARTING", "PARKED")
            assert info.checkpoint_step == steps
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
