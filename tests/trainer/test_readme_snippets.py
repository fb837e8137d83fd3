"""The README's trainer code runs as written (``tests/snippets.py`` extracts and runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cpu_devices
from snippets import README, managers, run_torchrun, snippet, write_snippet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_torch_pipelining_snippet_reports_every_stages_bubbles_to_its_devices_manager(tmp_path: Path) -> None:
    devices = cpu_devices(2)  # the snippet puts stage k on the k-th core this job may use, as these are
    script = write_snippet("torch-pipelining", tmp_path, "train_pp.py")
    with managers(devices, tmp_path / "state") as running:
        done = run_torchrun(script, 2, running.env)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        for device in devices:
            with running.client(device) as client:
                stats = client.stats()
            # 100 iterations of a 2-stage 1F1B: every one has bubbles on both stages
            assert stats.bubbles >= 100, (device, stats)
            assert stats.events_rejected == 0, (device, stats)


def test_the_snippet_harness_finds_exactly_the_marked_block(tmp_path: Path) -> None:
    code = snippet("torch-pipelining")
    assert "InstrumentedSchedule(schedule, sink=reporter" in code and not code.startswith("```")
    doc = tmp_path / "doc.md"
    doc.write_text("text\n<!-- snippet: a -->\n```python\nprint(1)\n```\n<!-- snippet: b -->\nno fence\n")
    assert snippet("a", doc) == "print(1)\n"
    with pytest.raises(AssertionError, match="not followed by a ``` fence"):
        snippet("b", doc)
    with pytest.raises(AssertionError, match="0 blocks marked"):
        snippet("c", doc)
    assert README.exists()


def test_the_python_client_snippet_submits_a_checked_task_to_the_devices_manager(tmp_path: Path) -> None:
    import subprocess
    import sys

    device = cpu_devices(1)[0]
    code = snippet("python-client")
    assert code.count('"cuda:0"') == 1
    script = tmp_path / "submit.py"
    script.write_text(code.replace('"cuda:0"', repr(device)))
    with managers([device], tmp_path / "state") as running:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=running.env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        with running.client(device) as client:
            [task] = client.list()
    assert done.stdout.split()[0] == task.task_id == "pagerank-1"
    assert task.spec.memory_bytes == 2**30 and task.spec.args == {"graph": "rmat:12"}
