"""``freeride launch`` says on its terminal what its managers log at WARNING or above (their output goes to log files:
a stranger's launch printed only "logs in ..." while its managers warned that every core computed a rank)."""

from __future__ import annotations

import io
from pathlib import Path

from freeride._cli.launch import ManagedManager, WarningRelay
from freeride.endpoints import Endpoint


def _manager(tmp_path: Path, device: str) -> ManagedManager:
    return ManagedManager(device, Endpoint("unix", str(tmp_path / "m.sock")), None, tmp_path / f"{device}.log")


def test_the_managers_warnings_are_said_once_each_with_their_device_and_nothing_else(tmp_path: Path) -> None:
    first, second = _manager(tmp_path, "cpu:0"), _manager(tmp_path, "cpu:1")
    first.log_path.write_text(  # type: ignore[union-attr]
        "freeride manager for cpu:0 listening on unix:/x.sock; state in /s\n"
        "2026-11-30 16:00:00,001 INFO freeride._manager.loop: [cpu:0] layout\n"
        "2026-11-30 16:00:00,002 WARNING freeride._manager.loop: [cpu:0] every core this manager may run on (0) is "
        "a training rank's\n")
    out = io.StringIO()
    relay = WarningRelay([first, second], out=out)  # the second has written nothing yet
    relay.relay()
    assert out.getvalue().splitlines() == [
        "freeride launch: manager cpu:0: WARNING freeride._manager.loop: [cpu:0] every core this manager may run on "
        "(0) is a training rank's"]
    with first.log_path.open("a") as fh:  # type: ignore[union-attr]
        fh.write("2026-11-30 16:00:01,000 ERROR freeride._manager.loop: [cpu:0] core failed on an ev")  # half a line
    second.log_path.write_text("2026-11-30 16:00:01,500 WARNING freeride.x: [cpu:1] late\n")  # type: ignore[union-attr]
    relay.relay()
    assert out.getvalue().splitlines()[1:] == ["freeride launch: manager cpu:1: WARNING freeride.x: [cpu:1] late"]
    with first.log_path.open("a") as fh:  # type: ignore[union-attr]
        fh.write("ent\n")
    relay.close()  # a last read: the rest of the line, once whole
    assert out.getvalue().splitlines()[2:] == [
        "freeride launch: manager cpu:0: ERROR freeride._manager.loop: [cpu:0] core failed on an event"]


def test_a_manager_found_serving_has_no_log_here_and_is_left_out(tmp_path: Path) -> None:
    found = ManagedManager("cpu:0", Endpoint("unix", str(tmp_path / "m.sock")), None, None)
    out = io.StringIO()
    WarningRelay([found], out=out).close()
    assert out.getvalue() == ""
