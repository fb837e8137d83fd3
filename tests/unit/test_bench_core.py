"""bench.bench_core's baseline: a core read from git loads and replays the events this tree's core takes."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_core
from freeride._manager import core as C


def _in_a_git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=bench_core.REPO, capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_a_git_checkout(), reason="the baseline is read from git")
def test_the_committed_core_package_loads_as_the_baseline_and_decides_as_this_one() -> None:
    old = bench_core.load_baseline("HEAD")
    assert old.__name__ == "baseline_core" and old.SchedulerCore is not C.SchedulerCore
    events = bench_core.Device(old, seed=1, chaos=False).run(60)
    assert bench_core.check_same(events, old, "freeride") == len(events) > 0


@pytest.mark.skipif(not _in_a_git_checkout(), reason="the baseline is read from git")
def test_the_baselines_folder_is_gone_once_its_process_exits() -> None:
    code = "from bench import bench_core; print(bench_core.load_baseline('HEAD').__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=bench_core.REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = Path(done.stdout.strip())
    assert loaded.name == "__init__.py" and loaded.parent.name == "baseline_core"
    assert not loaded.parent.parent.exists()  # the freeride-core-baseline-* folder


@dataclasses.dataclass(frozen=True)
class _Older:
    task_id: str
    device_bytes: int = 0


def test_a_field_the_other_core_lacks_is_dropped_at_its_default_and_refused_when_set() -> None:
    class Newer:  # the other core's module, whose event has lost the field
        @dataclasses.dataclass(frozen=True)
        class _Older:
            task_id: str

    [(event, now)] = bench_core.translate([(_Older("t"), 5)], Newer)  # type: ignore[arg-type]
    assert (event, now) == (Newer._Older("t"), 5)
    with pytest.raises(ValueError, match="device_bytes=7: no such field"):
        bench_core.translate([(_Older("t", 7), 5)], Newer)  # type: ignore[arg-type]
