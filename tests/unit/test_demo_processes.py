"""How the demo stops what it started: group SIGTERM, a deadline, SIGKILL, and a sweep for orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_for

from freeride._demo.processes import Children, DemoInterrupted, Signals

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_child_that_ignores_sigterm_is_killed_at_the_deadline(tmp_path: Path) -> None:
    children = Children(Signals())
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")
    child = children.start("stubborn", [sys.executable, "-c", code], tmp_path / "stubborn.log")
    wait_for(lambda: "ready" in child.log_path.read_text(), 30)
    children.stop_all(timeout_s=0.5)
    assert child.proc.returncode == -signal.SIGKILL  # killed at the deadline, not left to its 60 s


def test_the_wait_loop_turns_a_recorded_signal_into_demo_interrupted(tmp_path: Path) -> None:
    with Signals() as signals:
        children = Children(signals)
        child = children.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log")
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
        with pytest.raises(DemoInterrupted) as exc:
            children.wait(child, timeout_s=30)
        assert exc.value.signum == signal.SIGTERM
        children.stop_all(timeout_s=5)
    assert child.proc.returncode is not None


def _sweep_an_orphan(tmp_path: Path, orphan_sleep_s: float, settle_s: float) -> tuple[dict[str, Any], str]:
    """A demo's child leaves a grandchild in a session of its own (sleeping ``orphan_sleep_s``), and dies; the demo
    sweeps. Run in a child interpreter (the demo makes itself a subreaper): what it swept, and its stderr."""
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from freeride._demo.processes import Children, Signals, become_subreaper
        become_subreaper()
        children = Children(Signals())
        code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep({orphan_sleep_s})'], start_new_session=True); print(p.pid, flush=True); "
                "time.sleep(120)")
        parent = children.start("parent", [sys.executable, "-c", code], Path({str(tmp_path)!r}) / "parent.log")
        while not parent.log_path.read_text().strip():
            time.sleep(0.05)
        orphan = int(parent.log_path.read_text().split()[0])
        children.stop_all(timeout_s=5)  # the parent's group only: the orphan lives on
        left = children.sweep(timeout_s=5, settle_s={settle_s})
        print(json.dumps({{"orphan": orphan, "left": left}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_orphans_that_left_the_process_group_are_swept(tmp_path: Path) -> None:
    # Like torchrun's ranks and a manager's workers: a grandchild in a session of its own, whose
    # parent dies without stopping it.
    result, _ = _sweep_an_orphan(tmp_path, orphan_sleep_s=120, settle_s=0.2)
    assert len(result["left"]) == 1 and result["left"][0].startswith(str(result["orphan"]))
    assert not _alive(result["orphan"])


def test_orphans_that_end_by_themselves_are_reaped_not_named_as_left_behind(tmp_path: Path) -> None:
    # Stranger trial: a sweep right after the managers stopped named four workers' group watches "left behind";
    # each ends within a tenth of a second of its worker.
    result, err = _sweep_an_orphan(tmp_path, orphan_sleep_s=0.3, settle_s=30)
    assert result["left"] == [] and "left behind" not in err
    assert not _alive(result["orphan"])
