"""The files a running manager is reached by: one removed or replaced under it is said, once, as an error."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from freeride._manager.addresses import AddressWatch


def _files(tmp_path: Path) -> dict[str, Path]:
    files = {"socket": tmp_path / "cpu-0.sock", "events": tmp_path / "cpu-0.sock.events",
             "board": tmp_path / "cpu-0.sock.ends"}
    for path in files.values():
        path.write_bytes(b"")
    return files


def test_nothing_is_said_while_every_file_is_in_place(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watch = AddressWatch("cpu:0", _files(tmp_path))
    with caplog.at_level(logging.ERROR, logger="freeride"):
        assert watch.check() == [] and watch.check() == []
    assert caplog.text == ""


def test_a_removed_socket_is_said_once_with_what_fails_now_and_what_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    files = _files(tmp_path)
    watch = AddressWatch("cpu:0", files)
    files["socket"].unlink()
    with caplog.at_level(logging.ERROR, logger="freeride"):
        assert watch.check() == ["socket"]
        assert watch.check() == []  # once
    assert caplog.text.count("was removed") == 1
    assert f"its socket {files['socket']} was removed while this manager runs" in caplog.text
    assert "new trainers, clients and `freeride` commands cannot reach it" in caplog.text
    assert "restart the manager" in caplog.text


def test_a_file_put_back_in_its_place_is_a_replacement_not_the_managers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    files = _files(tmp_path)
    watch = AddressWatch("cpu:0", files)
    files["board"].unlink()
    files["board"].write_bytes(b"another manager's board")
    with caplog.at_level(logging.ERROR, logger="freeride"):
        assert watch.check() == ["board"]
    assert "its end board" in caplog.text and "replaced by another file" in caplog.text
    assert watch.lost == {"board": "replaced by another file (another manager's?)"}


def test_a_file_the_manager_never_made_is_not_watched(tmp_path: Path) -> None:
    files = _files(tmp_path)
    files["events"].unlink()  # no local event socket at start-up (said then)
    assert AddressWatch("cpu:0", files).check() == []
    with pytest.raises(ValueError, match="unknown manager files"):
        AddressWatch("cpu:0", {"sockets": tmp_path})
