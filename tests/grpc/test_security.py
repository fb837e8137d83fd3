"""The security model, one test per claim (README, "Security model").

Owner-only sockets and runtime directory; TCP only with a token, compared in constant time, on
every service; no shell anywhere; argv run literally; task paths confined to the state directory
whatever the submitter names things; a worker cannot point the manager's signals or checkpoint
records outside its own task.
"""

from __future__ import annotations

import ast
import hmac
import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from conftest import TESTS_DIR, ManagerHarness, cpu_devices, wait_for

from freeride._channel import Checkpointed, ProcessGroup, ProtocolError
from freeride._manager import servicers
from freeride._manager.daemon import Manager
from freeride._wire import freeride_pb2 as pb
from freeride._wire import freeride_pb2_grpc as pb_grpc
from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint, default_endpoint, runtime_dir
from freeride.errors import ConfigError, RequestRejected, Unauthenticated
from freeride.messages import TaskSpec

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

REPO = Path(__file__).resolve().parents[2]


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ------------------------------------------------------------------ unix socket and runtime directory


def test_runtime_dir_is_created_owner_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert _mode(runtime_dir()) == 0o700


def test_runtime_dir_with_loose_permissions_is_tightened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "freeride").mkdir(mode=0o777)
    os.chmod(tmp_path / "freeride", 0o777)
    assert _mode(runtime_dir()) == 0o700


def test_runtime_dir_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    runtime_dir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(ConfigError, match="another user"):
        runtime_dir()


def test_default_endpoint_is_an_owner_only_socket_in_an_owner_only_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    manager = Manager(DEVICE, state_dir=tmp_path / "state")
    assert manager.endpoint == default_endpoint(DEVICE)
    manager.start()
    try:
        assert _mode(manager.endpoint.address) == 0o600
        assert _mode(Path(manager.endpoint.address).parent) == 0o700
        assert _mode(tmp_path / "state") == 0o700
    finally:
        manager.stop()


def test_socket_is_owner_only_from_the_moment_it_exists(tmp_path: Path) -> None:
    # The socket file appears when the port is added, before the server starts and before the
    # chmod after start: the umask must already make it 0600, or another user could connect first.
    sock = Path(f"/tmp/fr-umask-{os.getpid()}.sock")
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(sock)), state_dir=tmp_path / "s")
    old = os.umask(0)
    try:
        manager._bind()
        assert _mode(sock) == 0o600
    finally:
        os.umask(old)
        manager.server.stop(0)
        sock.unlink(missing_ok=True)


# ------------------------------------------------------------------ TCP and tokens


@pytest.mark.parametrize("token", [None, ""])
def test_tcp_without_a_token_is_refused_at_start(tmp_path: Path, token: str | None) -> None:
    with pytest.raises(ConfigError, match="token"):
        Manager(DEVICE, endpoint=Endpoint("tcp", "127.0.0.1:0"), state_dir=tmp_path / "s", token=token)


@pytest.fixture
def tcp_manager(tmp_path: Path) -> Any:
    manager = Manager(DEVICE, endpoint=Endpoint("tcp", "127.0.0.1:0"), state_dir=tmp_path / "s", token="s3cret")
    manager.start()
    yield SimpleNamespace(manager=manager, endpoint=Endpoint("tcp", f"127.0.0.1:{manager.port}"))
    manager.stop()


@pytest.mark.parametrize("token", [None, "", "s3cre", "s3creT", "s3cret ", "S3CRET", "x" * 4096])
def test_wrong_tokens_are_unauthenticated(tcp_manager: Any, token: str | None) -> None:
    with ControlClient(tcp_manager.endpoint, token=token) as client, pytest.raises(Unauthenticated):
        client.list()


@pytest.mark.parametrize("header", ["Bearer s3cret", "s3cret", "bearer  s3cret", "basic s3cret"])
def test_authorization_header_must_be_exactly_bearer_token(tcp_manager: Any, header: str) -> None:
    with grpc.insecure_channel(tcp_manager.endpoint.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.ControlStub(channel).List(pb.ListRequest(), metadata=(("authorization", header),), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_trainer_stream_without_the_token_is_refused_and_counts_nothing(tcp_manager: Any) -> None:
    event = pb.BubbleEvent(start=pb.BubbleStart(start_ns=1, predicted_ns=1))
    with grpc.insecure_channel(tcp_manager.endpoint.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.TrainerStub(channel).StreamBubbles(iter([event] * 3), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with ControlClient(tcp_manager.endpoint, token="s3cret") as client:
        stats = client.stats()
    assert (stats.events_received, stats.events_rejected) == (0, 0)


def test_token_is_compared_in_constant_time(tcp_manager: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(servicers.hmac, "compare_digest", spy)
    with ControlClient(tcp_manager.endpoint, token="wrong") as client, pytest.raises(Unauthenticated):
        client.list()
    assert (b"bearer wrong", b"bearer s3cret") in calls


# ------------------------------------------------------------------ no shell


_SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
                ("asyncio", "create_subprocess_shell")}


def _shell_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                (func.value.id, func.attr) in _SHELL_CALLS:
            found.append(f"{path}:{node.lineno} {func.value.id}.{func.attr}")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{path}:{node.lineno} shell={ast.unparse(kw.value)}")
    return found


_SHELLS = {"sh", "/bin/sh", "bash", "/bin/bash", "/usr/bin/bash", "dash", "/bin/dash"}


def _shell_argvs(path: Path) -> list[str]:
    """Every argv list that starts a shell with ``-c``, as ``file: script``: the script is a constant's name, or
    ``<not a constant>`` (a string built at run time: what the README promises never happens)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.List) or len(node.elts) < 3:
            continue
        first, flag, script = node.elts[:3]
        if isinstance(first, ast.Constant) and first.value in _SHELLS and isinstance(flag, ast.Constant) and \
                flag.value == "-c":
            name = script.id if isinstance(script, ast.Name) and script.id.lstrip("_").isupper() else "<not a constant>"
            found.append(f"{path.relative_to(REPO)}: {name}")
    return found


def _project_files() -> list[Path]:
    return [p for d in ("freeride", "side_tasks", "bench", "examples", "scripts") for p in (REPO / d).rglob("*.py")
            if "_pb2" not in p.name]


def test_no_code_path_hands_a_string_to_a_shell() -> None:
    files = _project_files()
    assert len(files) > 20
    assert [use for p in files for use in _shell_uses(p)] == []


def test_the_one_shell_freeride_starts_runs_a_fixed_script() -> None:
    # Stranger trial: the README said nothing in freeride calls a shell; the group watch is one (a fixed script
    # whose only argument is a process group id). The README says so now, and this keeps it true.
    found = [use for p in _project_files() for use in _shell_argvs(p)]
    assert found == ["freeride/_task_process.py: _GROUP_WATCH_SCRIPT"]


@pytest.mark.e2e
def test_command_arguments_with_shell_syntax_run_literally(harness: ManagerHarness, tmp_path: Path) -> None:
    out = tmp_path / "argv.json"
    literal = ["a;b", "$(touch pwned)", "`touch pwned`", "$HOME", "*", "| cat", "&& true", "'quoted'", "\\n"]
    script = f"import json, sys; open({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))"
    info = harness.client.submit(TaskSpec(command=(sys.executable, "-c", script, *literal), memory_bytes=256 * 2**20,
                                          working_dir=str(tmp_path)))
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(info.task_id).state in ("FINISHED", "FAILED"), length_ms=30)
    feeder.close()
    assert harness.client.get(info.task_id).state == "FINISHED", harness.client.get(info.task_id).failure
    assert json.loads(out.read_text()) == literal
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("program", "says"), [
    ("/nonexistent/prog", r"program '/nonexistent/prog' is not an executable file on the manager's host"),
    ("no-such-program-on-this-path", r"program 'no-such-program-on-this-path' is not on the manager's PATH"),
])
def test_a_command_whose_program_this_host_lacks_is_refused_at_submit(
    harness: ManagerHarness, program: str, says: str
) -> None:
    # Stranger trial: it was accepted, and the task failed in setup with a traceback through freeride's code.
    with pytest.raises(RequestRejected, match=says):
        harness.client.submit(TaskSpec(command=(program, "--flag"), memory_bytes=256 * 2**20))
    assert harness.client.list() == []


@pytest.mark.e2e
def test_a_command_whose_relative_program_is_missing_fails_in_setup_in_one_line(harness: ManagerHarness) -> None:
    # A relative path runs from the task's work directory, made at its start: only setup can tell.
    info = harness.client.submit(TaskSpec(command=("./not-here", "x"), memory_bytes=256 * 2**20))
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(info.task_id).state == "FAILED", length_ms=30)
    feeder.close()
    failure = harness.client.get(info.task_id).failure
    assert failure is not None and failure.kind == "CONFIG", failure
    assert "cannot run './not-here'" in failure.message and "No such file or directory" in failure.message


# ------------------------------------------------------------------ paths stay inside the state directory

HOSTILE_NAMES = ["../../x", "..", "/etc/passwd", "a/../../b", "..\\..\\x", "ü", "~root", "a" * 31 + " b",
                 "-", ".hidden", "tasks.db", "CON", "x\u2215y"]


def test_task_names_cannot_steer_paths_out_of_the_state_dir(make_manager: Any) -> None:
    h: ManagerHarness = make_manager(headroom_bytes=2**62)
    tasks_root = (h.manager.state_dir / "tasks").resolve()
    for name in HOSTILE_NAMES:
        info = h.client.submit(TaskSpec(target="a:B", name=name, memory_bytes=2**20,
                                        args={"path": "../../../etc", "name": name}))
        path = h.manager.loop.task_dir(info.task_id).resolve()
        assert path.parent == tasks_root, (name, info.task_id)
        assert "/" not in info.task_id and ".." not in info.task_id


@pytest.mark.parametrize("task_id", ["../x", "..", "", "a/b", "/etc", "x\n", "A-1", "tasks/../../y", ".x", "-x"])
def test_task_dir_refuses_ids_the_manager_did_not_make(harness: ManagerHarness, task_id: str) -> None:
    with pytest.raises(ValueError, match="manager-made"):
        harness.manager.loop.task_dir(task_id)


@pytest.mark.e2e
def test_task_with_a_traversal_name_keeps_its_files_in_its_own_dir(harness: ManagerHarness) -> None:
    info = harness.submit("sample_tasks:Counter", memory_mib=64, name="../../escape", args={"step_ms": 1.0})
    assert info.task_id == "escape-1"
    harness.wait_state(info.task_id, "PARKED")
    task_dir = harness.manager.loop.task_dir(info.task_id)
    assert task_dir == harness.manager.state_dir / "tasks" / "escape-1"
    assert (task_dir / "worker.log").exists() and (task_dir / "work").is_dir()
    assert sorted(p.name for p in harness.manager.state_dir.iterdir() if p.is_dir()) == ["tasks"]


def test_checkpoint_records_outside_the_task_dir_are_protocol_violations(harness: ManagerHarness) -> None:
    loop = harness.manager.loop
    handle = SimpleNamespace(task_id="counter-1")
    inside = loop.task_dir("counter-1") / "checkpoints"
    inside.mkdir(parents=True)
    (inside / "link").symlink_to("/etc")
    for path in ("/etc/passwd", str(inside / ".." / ".." / "other-2" / "ckpt"), str(inside / "link" / "passwd")):
        msg = Checkpointed(path=path, step=1, progress=1.0)
        with pytest.raises(ProtocolError, match="outside the task's directory"):
            loop.workers.on_message(handle, msg)


@pytest.mark.parametrize("pgid", [0, -1, 1, "own"])
def test_worker_cannot_name_a_process_group_it_did_not_make(harness: ManagerHarness, pgid: int | str) -> None:
    # The manager SIGKILLs a command task's group when its worker exits. Group 0 is the manager's
    # own; a negative one made killpg raise EINVAL on the loop thread, which ended the loop.
    handle = SimpleNamespace(task_id="counter-1", extra_pgids=[])
    with pytest.raises(ProtocolError, match="process group"):
        loop_pgid = os.getpgrp() if pgid == "own" else pgid
        harness.manager.loop.workers.on_message(handle, ProcessGroup(pgid=int(loop_pgid)))
    assert handle.extra_pgids == []


# ------------------------------------------------------------------ code execution is by design, but contained


@pytest.mark.e2e
def test_os_system_as_a_target_fails_to_load_and_runs_nothing(harness: ManagerHarness, tmp_path: Path) -> None:
    # A reference is code execution by design (the module is imported in the worker), but only a
    # SideTask subclass is ever called: os.system is refused, its "argument" never reaches a shell.
    marker = tmp_path / "pwned"
    info = harness.client.submit(TaskSpec(target="os:system", args={"command": f"touch {marker}"},
                                          memory_bytes=64 * 2**20, working_dir=str(TESTS_DIR)))
    final = harness.wait_state(info.task_id, "FAILED")
    assert final.failure is not None and final.failure.kind == "IMPORT"
    assert "not a subclass of freeride.SideTask" in final.failure.message
    assert not marker.exists()
    wait_for(lambda: harness.client.stats().tasks_by_state == {"FAILED": 1})
