"""gRPC tests against a real in-process server: validation, auth, permissions, health."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
from conftest import TESTS_DIR, ManagerHarness, cpu_devices, wait_for

from freeride._boards import end_board_path
from freeride._manager.daemon import Manager
from freeride._manager.state_lock import LOCK_NAME
from freeride._wire import freeride_pb2 as pb
from freeride._wire import freeride_pb2_grpc as pb_grpc
from freeride._wire.client import ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import (
    ConfigError,
    ManagerUnavailable,
    RequestRejected,
    TaskLoadError,
    TaskNotFound,
    Unauthenticated,
)
from freeride.messages import TaskSpec

HOST_MEMORY = int(psutil.virtual_memory().total)
DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers


def _raw_submit(endpoint: Endpoint, **fields: object) -> grpc.RpcError:
    with grpc.insecure_channel(endpoint.grpc_target) as channel:
        stub = pb_grpc.ControlStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Submit(pb.SubmitRequest(**fields), timeout=5)  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target": "", "memory_bytes": 1}, "exactly one of"),
        ({"target": "a:B", "command": ["x"], "memory_bytes": 1}, "exactly one of"),
        ({"target": "../../etc/passwd:X", "memory_bytes": 1}, "bad task reference"),
        ({"target": "os:system; rm", "memory_bytes": 1}, "bad task reference"),
        ({"target": "a:B", "memory_bytes": 0}, "memory 0 is below what a task can run in"),
        ({"target": "a:B", "memory_bytes": 5}, "memory 5 B is below what a task can run in: at least 1.0 MiB"),
        ({"target": "a:B", "memory_bytes": 1, "args_json": "{nope"}, "not valid JSON"),
        ({"target": "a:B", "memory_bytes": 1, "args_json": "[1, 2]"}, "JSON object"),
        ({"target": "a:B", "memory_bytes": 1, "args_json": '{"__class__ x": 1}'}, "identifiers"),
        ({"target": "a:B", "memory_bytes": 1, "working_dir": "relative/dir"}, "working directory"),
        ({"target": "a:B", "memory_bytes": 1, "checkpoint_interval_s": float("nan")}, "finite"),
        ({"target": "a:B", "memory_bytes": 1, "priority": 10**8}, "priority"),
        ({"command": ["ok", "bad\x00arg"], "memory_bytes": 1}, "NUL"),
    ],
)
def test_malformed_submission_is_invalid_argument_and_changes_nothing(
    harness: ManagerHarness, fields: dict[str, object], message: str
) -> None:
    error = _raw_submit(harness.endpoint, **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (error.details() or "")
    assert harness.client.list() == []


def test_client_maps_status_codes_to_the_error_tree(harness: ManagerHarness) -> None:
    with pytest.raises(RequestRejected):
        harness.client.submit(TaskSpec(target="a:B", memory_bytes=-1))
    with pytest.raises(TaskNotFound):
        harness.client.get("nope-1")
    with pytest.raises(TaskNotFound):
        harness.client.cancel("nope-1")


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (TaskSpec(target="sample_tasks:Counter", args={"step_mss": 1}, memory_bytes=2**26), ConfigError,
         "'step_mss' (did you mean 'step_ms'?)"),
        (TaskSpec(target="no_such_module:Task", memory_bytes=2**26), TaskLoadError, "unknown module"),
        (TaskSpec(target="sample_tasks:Counter", memory_bytes=0), ConfigError, "needs a memory cap"),
        (TaskSpec(target="sample_tasks:Counter", memory_bytes=5), RequestRejected, "below what a task can run in"),
    ],
)
def test_a_client_submit_that_checks_refuses_a_bad_task_here_in_one_line_and_sends_nothing(
    harness: ManagerHarness, spec: TaskSpec, error: type[Exception], message: str
) -> None:
    # Unchecked, the manager takes the first three (it never imports user code), and they fail in the worker.
    spec = dataclasses.replace(spec, working_dir=str(TESTS_DIR))
    with pytest.raises(error, match=re.escape(message)):
        harness.client.submit(spec, check=True)
    assert harness.client.list() == []


def test_a_client_submit_that_checks_takes_the_class_memory_estimate_for_a_cap_of_zero(
    harness: ManagerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    info = harness.client.submit(TaskSpec(target="sample_tasks:Estimated", args={"mib": 96}), check=True)
    assert info.spec.memory_bytes == 96 * 2**20


def test_submit_then_get_list_and_cancel_round_trip(harness: ManagerHarness) -> None:
    info = harness.submit("sample_tasks:Counter", memory_mib=64, priority=3, name="ticker")
    assert info.task_id == "ticker-1"
    assert info.spec.priority == 3
    assert [t.task_id for t in harness.client.list()] == ["ticker-1"]
    assert harness.client.cancel("ticker-1").state == "CANCELLED"
    assert harness.client.list(include_finished=False) == []
    assert harness.client.stats().tasks_by_state == {"CANCELLED": 1}


def test_the_package_exports_control_client_and_it_takes_an_endpoint_as_text(harness: ManagerHarness) -> None:
    import freeride

    with freeride.ControlClient(f"unix:{harness.endpoint.address}") as client:
        assert client.stats().device == harness.client.stats().device
    with pytest.raises(freeride.ConfigError, match="cannot parse endpoint"):
        freeride.ControlClient("nowhere")


def test_a_cap_above_all_the_hosts_memory_is_refused_at_submit_not_left_waiting(harness: ManagerHarness) -> None:
    # Third trial: --memory 10TiB was accepted and waited forever for a budget it could never get.
    with pytest.raises(RequestRejected, match=r"is more than cpu:\d+ has in all .* could never be placed"):
        harness.client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=10 * 2**40,
                                       working_dir=str(TESTS_DIR)))
    assert harness.client.list() == []


def test_importing_freeride_for_a_side_task_does_not_load_grpc() -> None:
    code = "import sys, freeride; from freeride import SideTask; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_unix_socket_is_owner_only_and_health_says_serving(harness: ManagerHarness) -> None:
    mode = stat.S_IMODE(os.stat(harness.endpoint.address).st_mode)
    assert mode & 0o077 == 0
    assert health_status(harness.endpoint) == "SERVING"


def test_second_manager_on_the_same_socket_is_refused(harness: ManagerHarness, tmp_path: Path) -> None:
    second = Manager(DEVICE, endpoint=harness.endpoint, state_dir=tmp_path / "other")
    with pytest.raises(ConfigError, match="already listening"):
        second.start()
    assert health_status(harness.endpoint) == 'SERVING'


def test_a_second_manager_command_at_a_busy_socket_says_its_refusal_and_nothing_of_its_priority_first(
    harness: ManagerHarness, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:
    # Stranger trial: the refusal came after a warning about the manager's autogroup priority, which never applied.
    from freeride.cli import main

    with caplog.at_level(logging.INFO):
        code = main(["manager", "--device", DEVICE, "--endpoint", f"unix:{harness.endpoint.address}",
                     "--state-dir", str(tmp_path / "other"), "--autogroup-nice", "5"])
    assert code == 2 and "already listening" in capsys.readouterr().err
    assert not [r.getMessage() for r in caplog.records if "autogroup" in r.getMessage()]
    assert health_status(harness.endpoint) == "SERVING"


def test_a_second_manager_on_the_same_state_dir_is_refused_and_the_first_ones_task_goes_on(
    harness: ManagerHarness, tmp_path: Path
) -> None:
    # Stranger trials: the default state directory depends on the device only; a second manager of it (another
    # endpoint) recovered the first one's tasks as its own and killed their workers as a dead manager's.
    task = harness.submit("sample_tasks:Counter")
    pid = harness.wait_state(task.task_id, "PARKED").pid
    other = Endpoint("unix", f"/tmp/fr-second-{os.getpid()}.sock")
    refusal = (rf"another manager \(pid {os.getpid()}, endpoint {harness.endpoint}\) uses the state directory .*: "
               r"stop it first, or give this one its own --state-dir")
    with pytest.raises(ConfigError, match=refusal):
        Manager(DEVICE, endpoint=other, state_dir=harness.manager.state_dir)
    assert not os.path.exists(other.address)
    os.kill(pid, 0)  # its worker lives
    info = harness.client.get(task.task_id)
    assert info.state == "PARKED" and info.pid == pid and health_status(harness.endpoint) == "SERVING"


def test_a_state_dir_removed_under_a_running_manager_is_made_again_guarded_and_kept_across_a_restart(
    tmp_path: Path,
) -> None:
    # A stranger's trial: the manager whose state directory was deleted kept serving, wrote its records into the
    # removed files and left the directory unguarded, so a second manager could take it.
    sock, state = Endpoint("unix", f"/tmp/fr-removed-{os.getpid()}.sock"), tmp_path / "state"
    manager = Manager(DEVICE, endpoint=sock, state_dir=state)
    manager.start()
    try:
        with ControlClient(sock) as client:
            spec = TaskSpec(target="sample_tasks:Counter", memory_bytes=512 * 2**20, working_dir=str(TESTS_DIR))
            first = client.submit(spec)
            wait_for(lambda: client.get(first.task_id).state == "PARKED", 30)
            pid = client.get(first.task_id).pid
            shutil.rmtree(state)
            task_dir = state / "tasks" / first.task_id
            wait_for((task_dir / "work").is_dir, 30, what="the state directory made again")  # made last
            assert (state / LOCK_NAME).exists() and (state / "tasks.db").exists()
            assert (task_dir / "checkpoints").is_dir()
            # The live worker's log is written there again (it went to the removed file until it started again).
            wait_for((task_dir / "worker.log").exists, 30, what="the worker's log opened again")
            with pytest.raises(ConfigError, match="another manager"):
                Manager(DEVICE, endpoint=Endpoint("unix", f"/tmp/fr-removed2-{os.getpid()}.sock"), state_dir=state)
            second = client.submit(spec)
            assert second.task_id != first.task_id and client.get(first.task_id).pid == pid  # its worker lives
    finally:
        manager.stop()
    again = Manager(DEVICE, endpoint=sock, state_dir=state)
    again.start()
    try:
        with ControlClient(sock) as client:
            assert sorted(t.task_id for t in client.list()) == sorted([first.task_id, second.task_id])
    finally:
        again.stop()


def test_a_socket_removed_under_a_running_manager_is_said_and_what_is_connected_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # The clean-up of old files in /tmp took a running manager's socket and end board: new trainers and clients
    # could not reach it, and it said nothing.
    sock = Endpoint("unix", f"/tmp/fr-gone-{os.getpid()}.sock")
    manager = Manager(DEVICE, endpoint=sock, state_dir=tmp_path / "state")
    manager.start()
    try:
        with caplog.at_level(logging.ERROR, logger="freeride"), ControlClient(sock) as client:
            client.list()  # connected before the removal
            os.unlink(sock.address)
            os.unlink(end_board_path(sock.address))
            wait_for(lambda: "its end board" in caplog.text and "its socket" in caplog.text, 30,
                     what="the manager to say its files are gone")
            assert client.list() == []  # the connection made before goes on
        assert f"its socket {sock.address} was removed while this manager runs" in caplog.text
    finally:
        manager.stop()


def test_a_second_manager_of_the_device_is_refused_while_the_first_runs_without_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A stranger, told that no manager answered once the socket was swept away, started another with its own state
    # directory: two managers granted the same device's bubbles.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    sock = Endpoint("unix", f"/tmp/fr-second-{os.getpid()}.sock")
    first = Manager(DEVICE, endpoint=sock)  # the device's default state directory
    first.start()
    try:
        os.unlink(sock.address)
        with pytest.raises(ConfigError, match=f"a manager of {DEVICE} runs here \\(pid {os.getpid()}.*was removed "
                                              "under it: stop it first"):
            Manager(DEVICE, endpoint=sock, state_dir=tmp_path / "other")
        assert not (tmp_path / "other").exists()  # refused before its state directory was made
    finally:
        first.stop()
    third = Manager(DEVICE, endpoint=sock, state_dir=tmp_path / "other")  # once it is stopped: served again
    third.start()
    third.stop()


def test_a_stopped_managers_state_dir_is_taken_by_the_next_one(tmp_path: Path) -> None:
    first = Manager(DEVICE, endpoint=Endpoint("unix", f"/tmp/fr-next-{os.getpid()}.sock"), state_dir=tmp_path / "s")
    first.start()
    first.stop()
    second = Manager(DEVICE, endpoint=first.endpoint, state_dir=tmp_path / "s")
    second.start()
    try:
        assert health_status(second.endpoint) == "SERVING"
    finally:
        second.stop()


def _serves_at(sock: Path, state_dir: Path) -> None:
    """A manager started at ``sock`` serves; it is stopped again."""
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(sock)), state_dir=state_dir)
    manager.start()
    try:
        assert health_status(manager.endpoint) == "SERVING"
    finally:
        manager.stop()


def test_stale_socket_of_a_dead_manager_is_replaced(tmp_path: Path) -> None:
    sock = Path(f"/tmp/fr-stale-{os.getpid()}.sock")
    sock.write_text("")  # a leftover file nobody listens on
    _serves_at(sock, tmp_path / "s")


def test_a_call_the_stopping_server_cancels_reads_as_manager_unavailable() -> None:
    # Regression: a health check that reached the manager as it stopped raised a bare FreerideError
    # ("manager error (CANCELLED)"): gRPC's server answers CANCELLED to a call that arrives while it
    # shuts down (about 1 call in 600 of a client polling through the stop). That race is rare, so a
    # real server here answers the same status every time.
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    class _Stopping(health.HealthServicer):
        def Check(self, request: object, context: grpc.ServicerContext) -> object:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    sock = Path(f"/tmp/fr-cancel-{os.getpid()}.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(_Stopping(), server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        with pytest.raises(ManagerUnavailable, match="it is stopping"):
            health_status(Endpoint("unix", str(sock)), timeout_s=30)
    finally:
        server.stop(grace=0).wait(30)
        sock.unlink(missing_ok=True)


def test_a_unix_endpoint_two_missing_directories_deep_is_refused_not_made(tmp_path: Path) -> None:
    # Stranger trial: --endpoint unix:/nonexistent/dir/m.sock made /nonexistent/dir and served there.
    typo = tmp_path / "no-such" / "dir" / "m.sock"
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(typo)), state_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match=f"cannot listen at unix:{typo}: {typo.parent.parent} does not exist"):
        manager.start()
    assert not typo.parent.parent.exists()
    _serves_at(tmp_path / "made" / "m.sock", tmp_path / "s2")  # one level is made, as a runtime dir's freeride/ is


def test_a_tcp_port_in_use_is_refused_in_freerides_one_line_without_grpcs_log(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Stranger trial: a taken port printed gRPC's C-core line (E... add_port.cc ... Failed to add port) first.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        manager = Manager(DEVICE, endpoint=Endpoint("tcp", f"127.0.0.1:{port}"), state_dir=tmp_path / "s",
                          token="s3cret")
        with pytest.raises(ConfigError, match=rf"cannot listen on tcp://127.0.0.1:{port}: port {port} is in use"):
            manager.start()
    assert "add_port" not in capfd.readouterr().err
    manager = Manager(DEVICE, endpoint=Endpoint("tcp", f"127.0.0.1:{port}"), state_dir=tmp_path / "s",
                      token="s3cret")
    manager.start()  # the state directory's lock went with the refusal; the freed port serves
    try:
        assert manager.port == port
    finally:
        manager.stop()


def test_tcp_endpoint_requires_a_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token"):
        Manager(DEVICE, endpoint=Endpoint("tcp", "127.0.0.1:0"), state_dir=tmp_path / "s")


def test_tcp_calls_without_the_right_token_are_unauthenticated(tmp_path: Path) -> None:
    manager = Manager(DEVICE, endpoint=Endpoint("tcp", "127.0.0.1:0"), state_dir=tmp_path / "s", token="s3cret")
    manager.start()
    endpoint = Endpoint("tcp", f"127.0.0.1:{manager.port}")
    try:
        for token in (None, "wrong", "s3cret-but-longer"):
            with ControlClient(endpoint, token=token) as client, pytest.raises(Unauthenticated):
                client.list()
        with pytest.raises(Unauthenticated):
            health_status(endpoint, token="wrong")
        with ControlClient(endpoint, token="s3cret") as client:
            assert client.list() == []
    finally:
        manager.stop()


def test_oversized_message_is_refused_not_fatal(harness: ManagerHarness) -> None:
    big = "x" * (5 * 2**20)
    with pytest.raises(RequestRejected):
        harness.client.submit(TaskSpec(target="a:B", args={"blob": big}, memory_bytes=1))
    assert harness.client.stats().device == DEVICE


def test_watch_streams_task_state_changes(harness: ManagerHarness) -> None:
    import threading

    seen: list[str] = []

    def watch() -> None:
        with ControlClient(harness.endpoint) as client:
            for event in client.watch():
                if event.task is not None:
                    seen.append(event.task.state)
                    if event.task.state == "CANCELLED":
                        return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    # The subscription is open once the manager's loop counts a subscriber: only then can no event be missed.
    wait_for(lambda: len(harness.manager.loop.watchers.queues) == 1, 10)
    info = harness.submit("sample_tasks:Counter", memory_mib=64)
    harness.client.cancel(info.task_id)
    thread.join(10)
    assert "SUBMITTED" in seen and seen[-1] == "CANCELLED"


def test_submitted_task_survives_a_manager_restart_with_the_same_state(tmp_path: Path) -> None:
    sock = Path(f"/tmp/fr-persist-{os.getpid()}.sock")
    state = tmp_path / "state"
    for round_ in range(2):
        manager = Manager(DEVICE, endpoint=Endpoint("unix", str(sock)), state_dir=state)
        manager.start()
        try:
            with ControlClient(manager.endpoint) as client:
                if round_ == 0:
                    # All of the host's memory: accepted, and never placed (the budget keeps a headroom).
                    client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=HOST_MEMORY,
                                           working_dir=str(TESTS_DIR)))
                tasks = client.list()
                assert [(t.task_id, t.state) for t in tasks] == [("counter-1", "SUBMITTED")]
                assert f"needs {HOST_MEMORY / 2**20:.0f} MiB" in tasks[0].waiting_reason
        finally:
            manager.stop()
