"""Standalone mode: run_standalone's report, task loading errors, and the run-task command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import TESTS_DIR, ManagerHarness, cpu_devices, wait_for

from freeride.cli import main
from freeride.errors import ConfigError, TaskLoadError
from freeride.messages import TaskSpec
from freeride.standalone import StandaloneReport, TaskRunError, load_task_class, percentile, run_standalone
from freeride.task import SideTask

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

REPO = Path(__file__).resolve().parents[1]


class EndlessTask(SideTask):
    """Never done; counts its steps (progress in the runtime's default unit)."""

    def __init__(self) -> None:
        self.count = 0

    def step(self) -> None:
        self.count += 1


class GrowsEachStep(SideTask):
    """Keeps 4 MiB more (touched, so resident) after every step."""

    def __init__(self) -> None:
        self.hoard: list[bytes] = []

    def step(self) -> None:
        self.hoard.append(b"\x01" * (4 << 20))


class DoneOnce(SideTask):
    """done() is true once, after the third step, and false ever after (ill-behaved, as a user's may be)."""

    def __init__(self) -> None:
        self.count = 0
        self.asked_when_done = 0

    def step(self) -> None:
        self.count += 1

    def done(self) -> bool:
        if self.count >= 3:
            self.asked_when_done += 1
        return self.asked_when_done == 1


class FailsOnThirdStep(SideTask):
    progress_unit: ClassVar[str] = "widgets"

    def __init__(self) -> None:
        self.count = 0

    def step(self) -> None:
        if self.count == 2:
            raise RuntimeError("widget jammed")
        self.count += 1

    def progress(self) -> float:
        return float(self.count)


class ExitsInItsThirdStep(EndlessTask):
    """Calls ``sys.exit(code)`` in its third step."""

    def __init__(self, code: int = 0) -> None:
        super().__init__()
        self.code = code

    def step(self) -> None:
        super().step()
        if self.count == 3:
            sys.exit(self.code)


class CallsOsExit(EndlessTask):
    """Calls ``os._exit(code)`` in its third step; before that, each step forks a child that ends with
    ``os._exit(5)``, as multiprocessing's children end."""

    def __init__(self, code: int = 7) -> None:
        super().__init__()
        self.code = code
        self.child_codes: list[int] = []

    def step(self) -> None:
        super().step()
        if self.count == 3:
            os._exit(self.code)
        pid = os.fork()
        if pid == 0:
            os._exit(5)
        self.child_codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        assert self.child_codes[-1] == 5, self.child_codes


class NaNProgress(EndlessTask):
    def progress(self) -> float:
        return float("nan")


class Unsaveable(EndlessTask):
    def state_dict(self) -> dict[str, Any]:
        return {"count": 1, "f": lambda: 0}


class RaisingEstimate(EndlessTask):
    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        return int(kwargs["size_mib"]) << 20


class NotATask:
    pass


def test_the_first_true_done_finishes_the_run_as_it_finishes_a_workers_task() -> None:
    # Stranger trial: a done() true once, then false, read "finished": false after 3 steps (asked twice).
    report = run_standalone(f"{__name__}:DoneOnce", {}, DEVICE, 30.0, 16 << 20, None)
    assert report.finished and report.steps == 3


def test_report_counts_progress_in_the_tasks_unit_until_done(tmp_path: Path) -> None:
    report = run_standalone(
        "side_tasks.graphs:PageRank", {"graph": "rmat:6", "max_iterations": 5, "tol": 0.0},
        DEVICE, 30.0, None, tmp_path,
    )  # fmt: skip
    assert report.finished and report.steps == 5 and report.progress == 5.0
    assert report.progress_unit == "iterations"
    assert report.step_ms_p50 <= report.step_ms_p90 <= report.step_ms_p99
    assert report.progress_per_s > 0 and report.steps_per_s > 0
    assert report.memory_measure == "rss_growth" and report.peak_memory_bytes >= 0
    assert report.memory_limit_bytes > 0  # from PageRank.estimate_memory
    assert (tmp_path / "result.npz").exists()


def test_report_is_frozen_and_serialises_to_json() -> None:
    report = run_standalone("side_tasks.graphs:BFS", {"graph": "rmat:5"}, DEVICE, 10.0, 1 << 30, None)
    with pytest.raises(AttributeError):
        report.steps = 3  # type: ignore[misc]
    data = json.loads(report.to_json())
    assert data["target"] == "side_tasks.graphs:BFS" and data["args"] == {"graph": "rmat:5"}
    assert set(data) == set(StandaloneReport.__dataclass_fields__)


def test_time_limit_stops_an_endless_task_and_progress_defaults_to_steps() -> None:
    report = run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 0.05, 1 << 20, None)
    assert not report.finished and report.steps > 0
    assert report.progress == report.steps and report.progress_unit == "steps"


def test_max_steps_bounds_the_run() -> None:
    report = run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 60.0, 1 << 20, None, max_steps=7)
    assert report.steps == 7


def test_failing_step_is_reported_with_its_index() -> None:
    with pytest.raises(TaskRunError,
                       match=r"FailsOnThirdStep failed in a step, after 2 steps: RuntimeError: widget jammed") as info:
        run_standalone(f"{__name__}:FailsOnThirdStep", {}, DEVICE, 10.0, 1 << 20, None)
    assert info.value.step == 2 and "widget jammed" in info.value.traceback_text


@pytest.mark.parametrize("code", [0, 3])
def test_a_step_that_calls_sys_exit_fails_the_run_with_its_step_not_silently_with_its_code(code: int) -> None:
    # Stranger trial: run-task printed nothing and exited 0, or 3, which reads "no manager".
    with pytest.raises(TaskRunError, match=rf"failed in a step, after 2 steps: SystemExit: {code}") as info:
        run_standalone(f"{__name__}:ExitsInItsThirdStep", {"code": code}, DEVICE, 10.0, 1 << 20, None)
    assert info.value.step == 2


def test_a_step_that_calls_os_exit_fails_the_run_at_the_tasks_line_and_its_forks_still_exit() -> None:
    # run-task ended with the task's exit code and printed nothing: os._exit skips every handler.
    real = os._exit
    with pytest.raises(TaskRunError, match=r"failed in a step, after 2 steps: ProcessExitCalled: the task called "
                                          r"os\._exit\(7\): in a worker the process ends there, and the task FAILS "
                                          r"with exit code 7 "
                                          rf"\({__file__}:\d+\)") as info:
        run_standalone(f"{__name__}:CallsOsExit", {}, DEVICE, 10.0, 1 << 30, None)
    assert info.value.step == 2
    assert os._exit is real  # this process's own os._exit is back


def test_a_progress_that_is_not_a_finite_number_fails_the_run() -> None:
    with pytest.raises(TaskRunError, match=r"failed in progress\(\): ValueError: progress\(\) returned nan"):
        run_standalone(f"{__name__}:NaNProgress", {}, DEVICE, 10.0, 1 << 20, None, max_steps=3)


def test_a_state_a_manager_could_not_checkpoint_fails_the_run_naming_its_entry() -> None:
    # Stranger trial: run-task never checkpointed: a state holding a lambda ran 1391 steps, rc 0; in a manager the
    # task failed CHECKPOINT after 276 steps.
    with pytest.raises(TaskRunError, match=r"Unsaveable failed in its checkpoint \(state_dict\(\), saved as a manager "
                                          r"saves it\): TypeError: state_dict\(\)\['f'\] cannot be saved"):
        run_standalone(f"{__name__}:Unsaveable", {}, DEVICE, 10.0, 1 << 30, None, max_steps=3)


def test_a_cap_over_the_whole_device_is_refused_as_submit_refuses_it() -> None:
    # Stranger trial: run-task ran with a 1 TiB cap on a 24 GiB host; submit refused it.
    with pytest.raises(ConfigError, match=rf"memory 1.0 TiB is more than {DEVICE} has in all \(.* GiB\): the task "
                                          "could never be placed"):
        run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 10.0, 2**40, None, max_steps=1)


def test_an_estimate_memory_that_raises_is_a_one_line_config_error_as_submit_words_it() -> None:
    with pytest.raises(ConfigError, match=r"RaisingEstimate.estimate_memory raised KeyError: 'size_mib'"):
        run_standalone(f"{__name__}:RaisingEstimate", {}, DEVICE, 10.0, None, None, max_steps=3)


def test_configuration_that_cannot_fit_the_memory_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than its memory limit of 1.0 MiB"):
        run_standalone("side_tasks.graphs:PageRank", {"graph": "rmat:12"}, DEVICE, 1.0, 1 << 20, None)


def test_going_over_the_memory_limit_fails_the_run_as_a_worker_would() -> None:
    limit_message = r"over its limit of 16(\.0+)? MiB \(a worker would fail with MEMORY_LIMIT\)"
    with pytest.raises(TaskRunError, match=limit_message) as info:
        run_standalone(f"{__name__}:GrowsEachStep", {}, DEVICE, 30.0, 16 << 20, None)
    # 16 MiB takes at least 4 steps of 4 MiB; more when the heap reuses what earlier tests freed.
    assert info.value.phase == "step" and info.value.step >= 3
    # It grew while stepping: not told to move its imports (a stranger's leaking task was).
    assert f"it grew while stepping, after {info.value.step} steps" in str(info.value)
    assert "module level" not in str(info.value)


def test_a_fast_task_is_measured_at_its_own_rate_not_at_the_memory_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stranger trial: memory was read (a psutil call, ~30 us) after every step: a 21 us step ran at a sixth of
    # its rate, and freeride bench, which divides by this rate, overstated the work done in bubbles.
    from freeride import standalone

    reads = []
    sample = standalone.MemoryProbe.sample
    monkeypatch.setattr(standalone.MemoryProbe, "sample", lambda self: reads.append(1) or sample(self))
    report = run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 0.3, 256 << 20, None)
    assert report.steps > 20 * len(reads)
    assert len(reads) <= 2 + 0.3 / standalone.SAMPLE_EVERY_S + 1


def test_the_runs_own_record_of_step_times_is_not_charged_to_the_tasks_memory() -> None:
    # Stranger trial: a task that allocates nothing failed a 2 MiB cap after 55,540 steps: the run's list of
    # step times grew by 32 bytes a step inside the measured process.
    report = run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 60.0, 2 << 20, max_steps=400_000)
    assert report.steps == 400_000 and report.peak_memory_bytes < 2 << 20


def test_unknown_constructor_argument_is_worded_as_submit_words_it() -> None:
    with pytest.raises(ConfigError, match=r"arguments do not fit side_tasks.graphs:PageRank: unknown argument "
                                          r"'colour' \(it takes: graph, damping"):
        run_standalone("side_tasks.graphs:PageRank", {"graph": "rmat:4", "colour": 1}, DEVICE, 1.0, None, None)


def test_a_value_that_is_not_what_its_parameter_is_annotated_to_take_is_named_before_the_constructor_runs() -> None:
    # Stranger trial: --arg damping=banana reached PageRank's range check as a bare TypeError naming no argument.
    with pytest.raises(ConfigError, match=r"'damping' must be a number, got 'banana'; 'max_iterations' must be a "
                                          r"whole number, got 2.5; 'directed' must be true or false, got 'yes'"):
        run_standalone("side_tasks.graphs:PageRank", {"graph": "rmat:4", "damping": "banana", "max_iterations": 2.5,
                                                      "directed": "yes"}, DEVICE, 1.0, None, None)
    # A whole number is a number (JSON writes 1.0 as 1 as often as not); a boolean is not a whole number.
    from freeride._loading import construct_task

    pagerank = load_task_class("side_tasks.graphs:PageRank")
    assert construct_task(pagerank, "p:P", {"graph": "rmat:4", "tol": 1}).tol == 1.0
    with pytest.raises(ConfigError, match="'code' must be a whole number, got True"):
        construct_task(ExitsInItsThirdStep, "e:E", {"code": True})


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("side_tasks.graphs.PageRank", "expected package.module:ClassName"),
        ("no_such_module_xyz:Task", "unknown module 'no_such_module_xyz'"),
        ("side_tasks.graphs:NoSuchTask", "has no class 'NoSuchTask'"),
        (f"{__name__}:NotATask", "is not a subclass of freeride.SideTask"),
    ],
    ids=["syntax", "module", "class", "not-a-task"],
)
def test_load_task_class_gives_one_line_errors(target: str, message: str) -> None:
    with pytest.raises(TaskLoadError, match=message) as info:
        load_task_class(target)
    assert "\n" not in str(info.value)


def test_load_task_class_returns_the_class() -> None:
    from side_tasks.images import ImageWatermark

    assert load_task_class("side_tasks.images:ImageWatermark") is ImageWatermark


def test_bad_device_and_seconds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown device"):
        run_standalone(f"{__name__}:EndlessTask", {}, "gpu0", 1.0, None, None)
    with pytest.raises(ConfigError, match="seconds must be a positive number"):
        run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 0, None, None)


def test_percentile_uses_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (50.0, 90.0, 99.0)
    assert percentile([], 50) == 0.0 and percentile([3.0], 99) == 3.0


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["run-task", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the run itself: the CLI would pin and renice the test process."""
    seen: dict[str, Any] = {}

    def fake(target: str, args: dict[str, Any], device: str, seconds: float, limit: int | None, work_dir: Any,
             **kwargs: Any) -> StandaloneReport:  # fmt: skip
        seen.update(target=target, args=args, device=device, seconds=seconds, limit=limit, **kwargs)
        return StandaloneReport(target, device, 4, 40.0, "images", True, 0.01, 2.0, 20.0, 2.0, 1.0, 2.0, 3.0,
                                1 << 20, "rss_growth", limit or 0, args)  # fmt: skip

    monkeypatch.setattr("freeride._cli.run_task.run_standalone", fake)
    return seen


def test_cli_arg_values_parse_as_json_else_string(capsys: pytest.CaptureFixture[str], fake_run: dict) -> None:
    code, out, _ = _cli(
        capsys, "pkg.mod:Task", "--args-json", '{"a": 1, "b": "x"}', "--arg", "b=2", "--arg", "flip=true",
        "--arg", "name=rmat:3", "--arg", 'list=[1, 2]', "--memory", "2GiB", "--seconds", "3", "--device", DEVICE,
    )  # fmt: skip
    assert code == 0
    assert fake_run["args"] == {"a": 1, "b": 2, "flip": True, "name": "rmat:3", "list": [1, 2]}
    assert fake_run["limit"] == 2 << 30 and fake_run["seconds"] == 3.0 and fake_run["prepare_device"] is True
    assert "throughput  20 images/s, 2 steps/s" in out and "p99 3.0 ms" in out


def test_cli_json_output_is_the_report(capsys: pytest.CaptureFixture[str], fake_run: dict) -> None:
    code, out, _ = _cli(capsys, "pkg.mod:Task", "--json")
    assert code == 0 and json.loads(out)["progress_unit"] == "images"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pkg.mod:Task", "--arg", "novalue"], "bad --arg 'novalue'"),
        (["pkg.mod:Task", "--args-json", "[1]"], "--args-json must be a JSON object"),
        (["pkg.mod:Task", "--args-json", "{"], "--args-json is not valid JSON"),
        (["pkg.mod:Task", "--memory", "lots"], "cannot parse --memory 'lots'"),
        (["pkg.mod.Task"], "expected package.module:ClassName"),
    ],
    ids=["arg", "json-type", "json-syntax", "memory", "target"],
)
def test_cli_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], fake_run: dict, argv: list[str], message: str
) -> None:
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_cli_with_json_prints_an_error_as_json_on_stdout_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(*args: Any, **kwargs: Any) -> StandaloneReport:  # the run itself would pin this process
        raise TaskRunError("m:T", "step", 2, SystemExit(0))

    monkeypatch.setattr("freeride._cli.run_task.run_standalone", fails)
    code, out, err = _cli(capsys, "m:T", "--json")
    assert (code, err) == (1, "freeride: error: m:T failed in a step, after 2 steps: SystemExit: 0\n")
    assert json.loads(out) == {"error": "m:T failed in a step, after 2 steps: SystemExit: 0", "exit_code": 1}


def test_cli_runs_a_real_task_in_a_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "freeride.cli", "run-task", "monte_carlo_pi:MonteCarloPi",
         "--arg", "total_samples=2000", "--arg", "batch=500", "--json"],
        cwd=REPO / "examples", env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["finished"] and report["steps"] == 4 and report["progress"] == 2000.0
    unknown = subprocess.run(
        [sys.executable, "-m", "freeride.cli", "run-task", "nowhere_xyz:Task"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == (f"freeride: error: unknown module 'nowhere_xyz' in 'nowhere_xyz:Task': no "
                                      f"nowhere_xyz.py in {tmp_path} (searched first) nor on the Python path")


def _run_task(*argv: str, cwd: Path = TESTS_DIR, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "freeride.cli", "run-task", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_ctrl_c_on_a_step_that_never_returns_says_which_step_it_stopped(tmp_path: Path) -> None:
    # Stranger trial: Ctrl-C on a hung run-task exited 130 and printed nothing.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "freeride.cli", "run-task", "sample_tasks:Hanger", "--arg",
                             "hang_at=3", "--arg", "log_steps=false", "--memory", "64MiB", "--device", DEVICE,
                             "--work-dir", str(tmp_path), "--seconds", "600"],
                            cwd=TESTS_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for((tmp_path / "fault_at").exists, 120, what="the hanging step")
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "freeride: interrupted in a step of sample_tasks:Hanger, after 3 steps," in err
    assert "run-task has no step timeout" in err


def test_run_task_runs_the_task_in_a_process_set_up_as_a_workers(harness: ManagerHarness, tmp_path: Path) -> None:
    """The regression: run-task imported the task (and torch sized its thread pool, one thread per core)
    before the worker's thread settings and pinning; a small torch task's steps took 14-65x a worker's."""
    in_worker, in_run_task = tmp_path / "worker.json", tmp_path / "run-task.json"
    harness.client.submit(TaskSpec(target="process_probe:ProcessProbe", args={"out": str(in_worker)},
                                   memory_bytes=64 << 20, working_dir=str(TESTS_DIR)))
    done = _run_task("process_probe:ProcessProbe", "--arg", f"out={in_run_task}", "--memory", "64MiB",
                     "--device", harness.manager.device.name.__str__(), "--seconds", "1")
    assert done.returncode == 0, done.stderr
    wait_for(in_worker.exists, 120, what="the worker's probe")
    worker, run_task = json.loads(in_worker.read_text()), json.loads(in_run_task.read_text())
    assert run_task == worker
    assert worker["torch_threads"] == 1 and worker["omp_num_threads"] == "1" and worker["nice_when_built"] == 19
    assert worker["cores"] == [harness.manager.device.name.index]


def test_run_task_warns_when_other_processes_take_its_core(tmp_path: Path) -> None:
    core = int(DEVICE.split(":")[1])
    # The rival spins until 3 s after the task's first step (its log appears), then lets the rest of the run
    # (at nice 19: a few percent of a busy core) finish at full speed: spinning for the whole run made the test
    # take 30-120 s.
    log = tmp_path / "work" / "steps.log"
    spin = (f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.monotonic() + 600\n"
            "while time.monotonic() < end:\n"
            f"    if end - time.monotonic() > 3 and os.path.exists({str(log)!r}):\n"
            "        end = time.monotonic() + 3\n")
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        done = _run_task("sample_tasks:Counter", "--arg", "step_ms=0.2", "--memory", "16MiB", "--device", DEVICE,
                         "--seconds", "1", "--work-dir", str(tmp_path / "work"), "--json")
    finally:
        busy.kill()
        busy.wait()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["core_busy_share"] > 0.5
    assert "warning: other processes took" in done.stderr and f"of {DEVICE} during the run" in done.stderr


def test_a_run_not_pinned_to_its_core_reports_no_load_of_it(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this process runs on one core: it is pinned to its device's whatever it does")
    report = run_standalone(f"{__name__}:EndlessTask", {}, DEVICE, 0.2, 1 << 20, None)
    # Measured only where the run made itself a worker (the CLI) or runs pinned to the core (bench's yardstick):
    # unpinned, its own CPU time, which the load leaves out, may have been another core's.
    assert report.core_busy_share is None


def test_the_benchs_yardstick_warns_when_other_processes_take_its_core(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Stranger trial: the yardstick ran without the check run-task makes; its rate swung 2x between trials.
    from freeride._cli.bench_runs import BenchTask, Runner

    core = int(DEVICE.split(":")[1])
    spin = (f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.monotonic() + 600\n"
            "while time.monotonic() < end:\n    pass\n")
    task = BenchTask("counter", TaskSpec(target="sample_tasks:Counter", args={"step_ms": 0.2, "log_steps": False},
                                         memory_bytes=16 << 20, working_dir=str(TESTS_DIR)))
    runner = Runner(command=("true",), devices=(DEVICE,), env=dict(os.environ), work_dir=tmp_path, tasks=(task,))
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        rates = runner.standalone_rates(0, 1.0)
    finally:
        busy.kill()
        busy.wait()
    assert rates["counter"] > 0
    assert f"% of {DEVICE} while side task counter was measured alone" in caplog.text
