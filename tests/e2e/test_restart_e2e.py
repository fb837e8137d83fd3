"""End-to-end: a real manager daemon process, killed with SIGKILL mid-bubble and restarted, or drained."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import MS, TESTS_DIR, BubbleFeeder, holds_for, read_steps, wait_for
from daemons import alive, health, socket_path, start_daemon

from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint
from freeride.messages import BubbleStart, TaskSpec

pytestmark = pytest.mark.e2e

#: Long enough that a 1 ms step measured slow on a loaded machine (workers run at nice 19) still fits.
LONG_MS = 100.0


def test_kill_9_mid_bubble_then_restart_loses_no_task_resumes_from_the_checkpoint_and_leaves_no_orphan(
    tmp_path: Path,
) -> None:
    sock = socket_path("restart")
    state = tmp_path / "state"
    daemon = start_daemon(sock, state)
    endpoint = Endpoint("unix", str(sock))
    client = ControlClient(endpoint)
    try:
        spawner = client.submit(TaskSpec(target="sample_tasks:Spawner", memory_bytes=2**28,
                                         working_dir=str(TESTS_DIR), name="spawner"))
        waiting = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=2**28,
                                         working_dir=str(TESTS_DIR), priority=-1, name="second"))
        child_pid_file = state / "tasks" / spawner.task_id / "work" / "child.pid"
        feeder = BubbleFeeder(endpoint)
        feeder.run_until(child_pid_file.exists, length_ms=LONG_MS, timeout_s=60)
        # The counter comes later with a higher priority: it gets every grant from now on.
        counter = client.submit(TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0},
                                         memory_bytes=2**28, working_dir=str(TESTS_DIR),
                                         checkpoint_interval_s=0.05, priority=1))
        feeder.run_until(lambda: client.get(counter.task_id).checkpoint_step >= 30, length_ms=LONG_MS, timeout_s=60)
        workers = [client.get(t.task_id).pid for t in (counter, spawner, waiting)]
        child = int(child_pid_file.read_text())
        # Open a long bubble and kill the manager while the counter is stepping inside it.
        feeder.send(BubbleStart(0, 0, 10_000, 0, "test", time.monotonic_ns(), 5000 * MS, 8 * 2**30))
        wait_for(lambda: client.get(counter.task_id).state == "RUNNING", 10)
        checkpoint = client.get(counter.task_id).checkpoint_step
        harvested = client.get(counter.task_id).harvested_s
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
        feeder.stream.close()
        # Workers die with their manager (PDEATHSIG); what they spawned waits for the next manager.
        wait_for(lambda: not any(alive(pid) for pid in workers if pid), 10)

        daemon = start_daemon(sock, state)
        wait_for(lambda: not alive(child), 10)
        client.close()
        client = ControlClient(endpoint)
        tasks = {t.task_id: t for t in client.list()}
        assert set(tasks) == {counter.task_id, spawner.task_id, waiting.task_id}
        assert tasks[counter.task_id].restarts == 1
        assert tasks[counter.task_id].progress >= checkpoint
        # Its harvested time as of its last checkpoint survived too (it used to restart from 0), and the unit of
        # its progress (read before its new worker says it: a restart showed "621 steps" of an images task).
        assert 0 < tasks[counter.task_id].harvested_s <= harvested
        assert tasks[counter.task_id].progress_unit == "ticks"
        feeder = BubbleFeeder(endpoint)
        feeder.run_until(lambda: "resumed from" in (state / "tasks" / counter.task_id / "worker.log").read_text()
                         and client.get(counter.task_id).progress > checkpoint, length_ms=LONG_MS, timeout_s=60)
        feeder.close()
        resumed = client.get(counter.task_id)
        assert resumed.state in ("PARKED", "RUNNING", "FROZEN")  # alive; a step may overrun the last bubble
        # The restored counter continued from its checkpoint rather than from zero.
        assert resumed.progress >= checkpoint
    finally:
        client.close()
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0


def test_sigterm_mid_step_drains_within_the_stop_timeout_and_health_says_not_serving(tmp_path: Path) -> None:
    sock = socket_path("drain")
    state = tmp_path / "state"
    daemon = start_daemon(sock, state, "--stop-timeout-s", "1")
    endpoint = Endpoint("unix", str(sock))
    try:
        with ControlClient(endpoint) as client:
            counter = client.submit(TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0},
                                             memory_bytes=2**28, working_dir=str(TESTS_DIR)))
            feeder = BubbleFeeder(endpoint)
            feeder.run_until(lambda: client.get(counter.task_id).steps >= 10, length_ms=LONG_MS, timeout_s=60)
            # Submitted second: once frozen, the hanger holds every grant and the counter would never step.
            hanger = client.submit(TaskSpec(target="sample_tasks:Hanger", args={"hang_at": 3},
                                            memory_bytes=2**28, working_dir=str(TESTS_DIR), name="hanger"))
            feeder.run_until(lambda: client.get(hanger.task_id).state == "FROZEN", length_ms=LONG_MS, timeout_s=60)
            # The hanger is thawed into a long bubble and is mid-step (forever) when SIGTERM comes.
            feeder.send(BubbleStart(0, 0, 10_000, 0, "test", time.monotonic_ns(), 5000 * MS, 8 * 2**30))
            wait_for(lambda: client.get(hanger.task_id).state == "RUNNING", 10)
            hanger_pid = client.get(hanger.task_id).pid
    except BaseException:
        daemon.kill()
        raise

    statuses: list[str] = []

    def watch_health() -> None:
        while daemon.poll() is None:
            statuses.append(health(endpoint))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(30) == 0  # the hanger ignores its stop: killed after --stop-timeout-s
    watcher.join()
    feeder.stream.close()
    assert "NOT_SERVING" in statuses
    assert "SERVING" not in statuses[statuses.index("NOT_SERVING"):], "health went back to SERVING mid-drain"
    assert not sock.exists()
    assert not alive(hanger_pid)

    daemon = start_daemon(sock, state)
    try:
        with ControlClient(endpoint) as client:
            info = client.get(counter.task_id)
            assert info.state in ("SUBMITTED", "STARTING", "PARKED")
            # Parked and checkpointed by the drain at its last step, as its own log counts them. (Not the steps the
            # manager had before the SIGTERM: a counter frozen mid-grant on a loaded machine had reported 42 when it
            # had run 45, and the drain thawed it into its 45th.)
            assert info.checkpoint_step == len(read_steps(state / "tasks" / counter.task_id / "work")) > 0
            assert client.get(hanger.task_id).state in ("SUBMITTED", "STARTING", "PARKED")  # killed, not lost
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)



def test_drain_twice_then_sigterm_stops_the_daemon_and_repeated_sigterm_keeps_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # Regressions (issue 13): a second `freeride drain` waited out its timeout and exited 3 while the
    # manager ran; after a drain SIGTERM no longer stopped the manager; a second SIGTERM killed the
    # workers without their checkpoints.
    from freeride.cli import EXIT_OK, main

    sock = socket_path("drain2")
    state = tmp_path / "state"
    daemon = start_daemon(sock, state, "--stop-timeout-s", "120")
    endpoint = Endpoint("unix", str(sock))
    try:
        with ControlClient(endpoint) as client:
            task = client.submit(TaskSpec(target="sample_tasks:SlowCheckpoint", memory_bytes=2**28,
                                          working_dir=str(TESTS_DIR)))
            feeder = BubbleFeeder(endpoint)
            feeder.run_until(lambda: client.get(task.task_id).steps >= 3, length_ms=LONG_MS, timeout_s=60)
            feeder.close()
            work = state / "tasks" / task.task_id / "work"
            (work / "release").touch()
            for said in ("drained: ", "already drained by an earlier drain"):
                capsys.readouterr()
                assert main(["drain", "--endpoint", f"unix:{sock}", "--timeout-s", "30"]) == EXIT_OK
                assert capsys.readouterr().out.startswith(said)
            steps = client.get(task.task_id).steps
            assert client.get(task.task_id).checkpoint_step == steps
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0

        # SIGTERM, twice, while a task is writing its checkpoint: the manager waits for it.
        daemon = start_daemon(sock, state, "--stop-timeout-s", "120")
        (work / "release").unlink()
        (work / "checkpointing").unlink()
        with ControlClient(endpoint) as client:
            feeder = BubbleFeeder(endpoint)
            feeder.run_until(lambda: client.get(task.task_id).steps >= steps + 3, length_ms=LONG_MS, timeout_s=60)
            feeder.close()
            steps = client.get(task.task_id).steps
        daemon.send_signal(signal.SIGTERM)
        wait_for(lambda: (work / "checkpointing").exists(), what="the drain to begin the task's checkpoint")
        daemon.send_signal(signal.SIGTERM)
        holds_for(lambda: daemon.poll() is None, 0.5, "the manager waits for the checkpoint")
        (work / "release").touch()
        assert daemon.wait(30) == 0
        daemon = start_daemon(sock, state)
        with ControlClient(endpoint) as client:
            assert client.get(task.task_id).checkpoint_step == steps
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
