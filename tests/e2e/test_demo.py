"""End to end: ``freeride demo --quick`` (torchrun, two managers, three side tasks, real bubbles).

Checks what holds on any machine, however loaded: the summary is consistent (no device harvested
more than its bubble time, every task progressed, none failed), the files exist and are what they
claim to be, and no process the demo started is left. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _ours_alive(pid: int, marker: str) -> bool:
    """``pid`` is alive and still one of the demo's processes (not a reused pid)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return marker in " ".join(p.cmdline()) or marker in p.cwd()
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("demo") / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "freeride.cli", "demo", "--quick", "--json", "--out", str(out)],
        capture_output=True, text=True, timeout=540, env=env, cwd=str(REPO),
    )  # fmt: skip
    return proc, out


@pytest.mark.timeout(600)
def test_the_quick_demo_completes_with_a_consistent_summary(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = demo
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    summary: dict[str, Any] = json.loads(proc.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["consistent"] and summary["problems"] == []
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    for stage in summary["stages"]:
        assert stage["iterations"] == summary["iterations"]
        assert 0 < stage["bubble_fraction"] < 1
    assert {d["device"] for d in summary["device_figures"]} == set(summary["devices"])
    for device in summary["device_figures"]:
        # Recomputed here rather than trusting the summary's own verdict.
        assert device["harvested_s"] <= device["manager_bubble_s"]
        assert 0 < device["bubble_s"] <= device["manager_bubble_s"]  # the window after the warm-up
        assert device["manager_bubbles"] > 0
        assert sum(device["breakdown"].values()) == pytest.approx(1.0)
    assert {t["name"] for t in summary["tasks"]} == {"lstm", "pagerank", "watermark"}
    for task in summary["tasks"]:
        assert task["progress"] > 0, task
        assert task["state"] != "FAILED", task["failure"]
        assert task["standalone_per_s"] and task["standalone_per_s"] > 0
    assert summary["baseline_s"] > 0 and summary["with_tasks_s"] > 0
    assert "1/5 baseline" in proc.stderr and "4/5 training" in proc.stderr


@pytest.mark.timeout(600)
def test_the_quick_demo_writes_a_perfetto_trace_and_a_timeline_picture(
    demo: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "trace.json").read_text())
    events = doc["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts"} <= e.keys(), e
        if e["ph"] == "X":
            assert e["dur"] >= 0
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "training" in threads
    assert {name.split(" ")[0] for name in threads} >= {"lstm", "pagerank", "watermark"}
    assert any(e.get("cat") == "step" for e in events)
    assert any(e.get("cat") == "bubble" for e in events)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(600)
def test_the_quick_demo_leaves_no_process_behind(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    pids = summary["processes"]
    assert {"baseline trainer", "trainer with side tasks", "manager for cpu:0", "manager for cpu:1"} <= pids.keys()
    assert sum(name.startswith("worker ") for name in pids) == 3
    marker = str(out)
    assert [name for name, pid in pids.items() if _ours_alive(pid, marker)] == []
    strays = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            if marker in " ".join(p.info["cmdline"] or ()) or marker in (p.info["cwd"] or ""):
                strays.append((p.pid, p.info["cmdline"]))
        except psutil.Error:
            pass
    assert strays == []
