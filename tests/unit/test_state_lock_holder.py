"""Who holds a state directory, read without taking its lock; and what the CLI says when that manager's socket is
gone (a sweep of /tmp took it, and "start one" led a stranger to a second manager on the same device)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freeride._cli.tasks import _running_manager
from freeride._manager.state_lock import LOCK_NAME, StateDirLock, default_state_dir_of, lock_holder
from freeride.devices import parse_device_name
from freeride.endpoints import Endpoint


def test_the_holder_is_read_from_the_kernels_locks_and_none_once_released(tmp_path: Path) -> None:
    lock = StateDirLock(tmp_path, "unix:/tmp/x.sock")
    assert lock_holder(tmp_path) == f"pid {os.getpid()}, endpoint unix:/tmp/x.sock"
    lock.release()
    assert lock_holder(tmp_path) == ""  # the file stays, and says who held it last: not a holder
    StateDirLock(tmp_path, "next").release()  # reading it took nothing: the lock is free


def test_a_blocked_waiters_line_and_another_files_lock_are_not_holders(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("pid 1, endpoint unix:/a.sock\n")
    inode = os.stat(tmp_path / LOCK_NAME).st_ino
    table = tmp_path / "locks"
    table.write_text(f"1: FLOCK  ADVISORY  WRITE 77 08:01:{inode + 1} 0 EOF\n"
                     f"1: -> FLOCK  ADVISORY  WRITE 78 08:01:{inode} 0 EOF\n")
    assert lock_holder(tmp_path, locks=table) == ""
    table.write_text(f"2: FLOCK  ADVISORY  WRITE 79 00:2a:{inode} 0 EOF\n")
    assert lock_holder(tmp_path, locks=table) == "pid 1, endpoint unix:/a.sock"
    assert lock_holder(tmp_path / "none") == ""


def test_the_cli_says_a_manager_runs_whose_socket_is_gone_rather_than_to_start_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    endpoint = Endpoint("unix", str(tmp_path / "cpu-0.sock"))  # no socket there
    assert _running_manager("cpu:0", endpoint) == ""  # no manager: start one, as before
    lock = StateDirLock(default_state_dir_of(parse_device_name("cpu:0")), str(endpoint))
    try:
        said = _running_manager("cpu:0", endpoint)
        assert said.startswith(f"a manager of cpu:0 runs here (pid {os.getpid()}, endpoint {endpoint}) and its "
                               f"socket {endpoint.address} is gone")
        assert "rather than a second manager beside it" in said
        other = Endpoint("unix", str(tmp_path / "elsewhere.sock"))
        assert "it is stopping, or serves another endpoint" in _running_manager("cpu:0", other)
        assert _running_manager("cpu:0", Endpoint("tcp", "127.0.0.1:1")) == ""  # another host's, maybe
    finally:
        lock.release()
