"""End-to-end: ``freeride bench -- COMMAND`` with real managers, workers and jobs.

The job is ``tests/bench_job.py`` (a real ``BubbleReporter`` per device, no torch: it starts in a
blink), the side task ``sample_tasks:Counter``; one test runs the reference trainer under torchrun.
Figures are never asserted here, only what was counted and how the bench behaves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TESTS_DIR, cpu_devices, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COUNTER = ["--task", "sample_tasks:Counter", "--arg", "step_ms=2", "--arg", "log_steps=false", "--memory", "64MiB"]
QUICK = ["--min-trials", "2", "--max-trials", "2", "--warmup-runs", "0", "--standalone-s", "0.5"]


@pytest.fixture(autouse=True)
def _temporary_files_in_the_tests_own_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench that fails keeps its logs in its temporary directory (it says where): the test's own here. In /tmp,
    the suite's failing benches had left 157 ``freeride-bench-*`` folders on one machine (a stranger saw them)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _bench(*args: str, cwd: Path = TESTS_DIR, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING")
    return subprocess.run([sys.executable, "-m", "freeride.cli", "bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _job(devices: list[str], *extra: str) -> list[str]:
    return [sys.executable, str(TESTS_DIR / "bench_job.py"), "--devices", ",".join(devices), *extra]


def _nothing_left(marker: Path) -> None:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(marker) not in out, "a manager or job outlived the bench"


def test_bench_runs_trials_and_reports_overhead_bubbles_harvest_and_saving(tmp_path: Path) -> None:
    devices = cpu_devices(2)
    out = tmp_path / "bench.json"
    proc = _bench("--devices", ",".join(devices), *COUNTER, *QUICK, "--warmup-runs", "1", "--out", str(out),
                  "--keep", str(tmp_path / "runs"), "--", *_job(devices, "--iterations", "12", "--bubble-ms", "30"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["trials"] == 2 and summary["devices"] == 2
    assert set(summary["overhead"]) == {"managers", "tasks"}
    assert summary["bubbles_per_run"] == 12 * 2  # every bubble of both devices reached its manager
    assert summary["tasks"][0]["name"] == "counter" and summary["tasks"][0]["standalone_per_s"] > 0
    assert set(summary["saving"]) == {"1x", "5.5x", "22x"}
    modes = [(r["trial"], r["mode"]) for r in doc["runs"]]
    assert modes[0] == (-1, "alone")  # the warm-up run, not counted
    assert sorted(modes[1:]) == sorted((t, m) for t in (0, 1) for m in ("alone", "managers", "tasks"))
    tasks_runs = [r for r in doc["runs"] if r["mode"] == "tasks"]
    assert all(sorted(d["device"] for d in r["devices"]) == sorted(devices) for r in tasks_runs)
    assert all(len(d["tasks"]) == 1 for r in tasks_runs for d in r["devices"])  # the task on every device
    assert "training overhead" in proc.stdout and "saving = (value of the side work" in proc.stdout
    _nothing_left(tmp_path / "runs")


def test_a_failing_command_ends_the_bench_with_its_exit_code_and_output(tmp_path: Path) -> None:
    device = cpu_devices(1)[0]
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('out of data at step 7')\nsys.exit(3)\n")
    proc = _bench("--devices", device, "--", sys.executable, str(script))
    assert proc.returncode == 1
    assert "the command exited with code 3 (the warm-up run)" in proc.stderr
    assert "out of data at step 7" in proc.stderr


def test_a_hung_command_is_stopped_at_its_time_limit(tmp_path: Path) -> None:
    device = cpu_devices(1)[0]
    proc = _bench("--devices", device, "--run-timeout-s", "3", "--keep", str(tmp_path / "runs"), "--",
                  *_job([device], "--iterations", "2", "--hang"))
    assert proc.returncode == 1
    assert "did not finish within 3 s (the warm-up run)" in proc.stderr
    _nothing_left(tmp_path / "runs")


def test_a_job_that_reports_no_bubble_is_named_as_such() -> None:
    proc = _bench("--devices", cpu_devices(1)[0], *QUICK, "--", sys.executable, "-c", "pass")
    assert proc.returncode == 1
    assert "the managers saw no bubble from the command" in proc.stderr


def test_a_task_that_fails_alone_is_caught_before_any_run_with_its_error() -> None:
    device = cpu_devices(1)[0]
    # With a warm-up run: a stranger's task whose arguments broke its setup was found only after it.
    proc = _bench("--devices", device, "--task", "sample_tasks:SetupCrasher", "--memory", "64MiB", *QUICK,
                  "--warmup-runs", "1", "--", *_job([device]))
    assert proc.returncode == 1
    assert "warm-up" not in proc.stdout + proc.stderr
    assert f"side task setupcrasher failed alone on {device}" in proc.stderr and "cannot set up" in proc.stderr


def test_a_task_that_fails_under_its_manager_ends_the_bench_with_its_failure_record(tmp_path: Path) -> None:
    (tmp_path / "worker_only.py").write_text(textwrap.dedent("""
        import os
        from freeride import SideTask

        class FailsInWorker(SideTask):
            '''Works alone (normal priority); fails in a worker, which runs at nice 19.'''
            def setup(self, ctx):
                self.steps = 0
            def step(self):
                if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
                    raise RuntimeError("only in a worker")
                self.steps += 1
            def progress(self):
                return float(self.steps)
    """))
    device = cpu_devices(1)[0]
    proc = _bench("--devices", device, "--task", "worker_only:FailsInWorker", "--memory", "64MiB", *QUICK, "--",
                  *_job([device], "--iterations", "30"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "side task failsinworker" in proc.stderr and "only in a worker" in proc.stderr


def test_ctrl_c_stops_the_command_and_the_managers_and_exits_130(tmp_path: Path) -> None:
    device = cpu_devices(1)[0]
    started = tmp_path / "started"
    job = (f"import pathlib, time; pathlib.Path({str(started)!r}).write_text('x'); time.sleep(120)")
    bench = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "bench", "--devices", device, *COUNTER, *QUICK, "--keep",
         str(tmp_path / "runs"), "--", sys.executable, "-c", job],
        cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: started.exists() or bench.poll() is not None, 120)
        assert bench.poll() is None, bench.communicate()[1][-2000:]
        bench.send_signal(signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, stderr[-2000:]
    assert "interrupted (Ctrl-C)" in stdout and "no trial completed" in stdout
    _nothing_left(tmp_path / "runs")


@pytest.mark.timeout(900)
def test_bench_measures_the_reference_trainer_under_torchrun_on_the_devices_it_finds(tmp_path: Path) -> None:
    """The whole path with a real pipeline: devices from torchrun's --nproc-per-node, two ranks reporting
    through $XDG_RUNTIME_DIR to the bench's managers, a bundled side task on each core."""
    out = tmp_path / "bench.json"
    iterations = 4
    proc = _bench("--device-kind", "cpu", "--task", "side_tasks.graphs:PageRank", "--arg", "graph=rmat:10",
                  "--arg", "tol=0", "--memory", "640MiB", *QUICK, "--out", str(out), "--",
                  sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "-m", "freeride.workload", "--report", "--iterations", str(iterations), "--warmup", "1",
                  "--microbatches", "2", "--layers", "2", "--d-model", "32", "--seq-len", "16", "--vocab", "64",
                  timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the job's devices: cpu:" in proc.stderr and "from torchrun --nproc-per-node" in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["trials"] == 2 and doc["summary"]["devices"] == 2
    for run in doc["runs"]:
        if run["mode"] != "alone":  # 1F1B with 2 micro-batches: every rank waits at least once an iteration
            assert all(d["bubbles"] >= iterations for d in run["devices"]), run
