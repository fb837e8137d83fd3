"""The ``freeride`` command line against a real in-process manager (and one real daemon).

Commands run through :func:`freeride.cli.main` with captured output; a few run as real
subprocesses (``python -m freeride.cli``). Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices, wait_for

from freeride._manager.daemon import Manager
from freeride._wire.client import BubbleStream, ControlClient, health_status
from freeride.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NO_MANAGER, EXIT_NOT_FOUND, EXIT_OK, main
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers
UNUSABLE = f"cpu:{max(os.sched_getaffinity(0)) + 1}"  # past every core this process may use

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
COUNTER = "sample_tasks:Counter"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are limited to about 100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="frcli-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager(short_dir: Path, tmp_path: Path) -> Iterator[Manager]:
    m = Manager(DEVICE, endpoint=Endpoint("unix", str(short_dir / "m.sock")), state_dir=tmp_path / "state")
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def ep(manager: Manager) -> list[str]:
    """``--endpoint`` arguments for the manager under test."""
    return ["--endpoint", str(manager.endpoint)]


@pytest.fixture
def in_tests_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Submit from the tests directory, so ``sample_tasks`` resolves here and in the worker."""
    monkeypatch.chdir(TESTS_DIR)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def bubbles(stop: threading.Event, length_ms: float = 20.0) -> Iterator[BubbleEvent]:
    """Bubbles of one stage, back to back with short compute gaps, until ``stop`` is set."""
    iteration = 0
    while not stop.is_set():
        start = time.monotonic_ns()
        yield BubbleStart(0, 0, iteration, 0, "cooldown", start, int(length_ms * 1e6))
        stop.wait(length_ms / 1000)
        yield BubbleEnd(0, 0, iteration, 0, time.monotonic_ns())
        stop.wait(0.005)
        iteration += 1


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("FREERIDE_ENDPOINT", None)
    return env


# ------------------------------------------------------------------ round trip


def test_submit_ls_show_cancel_stats_round_trip(
    manager: Manager, ep: list[str], in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys,
        "submit",
        COUNTER,
        *ep,
        "--memory",
        "64MiB",
        "--arg",
        "step_ms=1",
        "--arg",
        "total=0",
        "--name",
        "counter",
        "--priority",
        "3",
    )
    assert code == EXIT_OK, err
    task_id = out.strip()
    assert task_id and "\n" not in task_id

    code, out, err = run_cli(capsys, "ls", *ep)
    assert code == EXIT_OK, err
    header, *rows = out.strip().splitlines()
    assert header.split()[:5] == ["ID", "NAME", "STATE", "PRIO", "MEMORY"]
    assert "WHY" in header
    assert any(row.startswith(task_id) and "counter" in row and "64.0 MiB" in row for row in rows)

    with ControlClient(manager.endpoint) as client:
        wait_for(lambda: client.get(task_id).state == "PARKED", what="the worker to start")
    code, out, err = run_cli(capsys, "show", task_id, *ep)
    assert code == EXIT_OK, err
    assert f"task:       {task_id}" in out
    assert "target:     sample_tasks:Counter" in out
    assert "priority:   3" in out
    assert "waiting:    no bubble reported yet" in out
    assert "failure:" not in out
    # Stranger trial: no command said where a task's outputs and log are.
    task_dir = manager.loop.task_dir(task_id)
    assert f"outputs:    {task_dir}/work\n" in out and f"log:        {task_dir}/worker.log\n" in out
    assert (task_dir / "worker.log").exists() and (task_dir / "work").is_dir()
    code, out, err = run_cli(capsys, "show", task_id, *ep, "--json")
    assert json.loads(out)["task_dir"] == str(task_dir)

    code, out, err = run_cli(capsys, "cancel", task_id, *ep)
    assert code == EXIT_OK, err
    assert out.startswith(task_id)

    with ControlClient(manager.endpoint) as client:
        wait_for(lambda: client.get(task_id).state == "CANCELLED", what="the task to be cancelled")

    code, out, _ = run_cli(capsys, "ls", *ep)
    assert task_id not in out  # finished tasks only with --all
    code, out, _ = run_cli(capsys, "ls", "--all", *ep)
    assert task_id in out and "CANCELLED" in out

    code, out, err = run_cli(capsys, "stats", *ep)
    assert code == EXIT_OK, err
    for label in (
        "bubbles:",
        "bubble time:",
        "harvested:",
        "overruns:",
        "grant lat.:",
        "park lat.:",
        "mem budget:",
        "tasks:",
        "events:",
    ):
        assert label in out
    assert "CANCELLED 1" in out


def test_json_outputs_parse(
    manager: Manager, ep: list[str], in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys,
        "submit",
        COUNTER,
        *ep,
        "--json",
        "--memory",
        "32MiB",
        "--args-json",
        '{"step_ms": 2}',
        "--arg",
        "total=7",
        "--checkpoint-interval-s",
        "5",
        "--step-time-hint-ms",
        "1.5",
    )
    assert code == EXIT_OK, err
    task = json.loads(out)
    assert task["spec"]["args"] == {"step_ms": 2, "total": 7}
    assert task["spec"]["memory_bytes"] == 32 * 2**20
    task_id = task["task_id"]

    _, out, _ = run_cli(capsys, "ls", "--json", *ep)
    assert [t["task_id"] for t in json.loads(out)] == [task_id]
    _, out, _ = run_cli(capsys, "show", task_id, "--json", *ep)
    assert json.loads(out)["task_id"] == task_id
    # Stranger trial: show --json said 0.0, "" and 0.0 of what the task was submitted with.
    assert {key: json.loads(out)["spec"][key] for key in ("checkpoint_interval_s", "step_time_hint_ms",
                                                         "working_dir")} == {
        "checkpoint_interval_s": 5.0, "step_time_hint_ms": 1.5, "working_dir": str(TESTS_DIR)}
    _, out, _ = run_cli(capsys, "show", task_id, *ep)
    assert "ckpt every: 5 s" in out and f"directory:  {TESTS_DIR}" in out and "step hint:  1.5 ms" in out
    _, out, _ = run_cli(capsys, "stats", "--json", *ep)
    stats = json.loads(out)
    assert stats["device"] == DEVICE and "overrun_ms" in stats and "harvested_ratio" in stats
    _, out, _ = run_cli(capsys, "health", "--json", *ep)
    assert json.loads(out)["status"] == "SERVING"
    _, out, _ = run_cli(capsys, "cancel", task_id, "--json", *ep)
    assert json.loads(out)["task_id"] == task_id


def test_string_args_stay_strings_and_command_tasks_submit(
    manager: Manager, ep: list[str], in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "submit", "--json", "--memory", "16MiB", *ep, "--command", "--", "sleep", "--not-an-option", "5"
    )
    assert code == EXIT_OK, err
    task = json.loads(out)
    assert task["spec"]["command"] == ["sleep", "--not-an-option", "5"]
    assert task["spec"]["target"] == ""

    from freeride._cli.submission import parse_task_args

    assert parse_task_args(["a=1", "b=hello", "c=[1, 2]", "d=", "e=null"], None) == {
        "a": 1,
        "b": "hello",
        "c": [1, 2],
        "d": "",
        "e": None,
    }


def test_a_command_given_by_a_relative_path_is_taken_from_the_directory_submitted_from(
    manager: Manager, ep: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stranger trial: `submit --command -- ./counter.sh` was accepted, then failed in setup ("cannot run
    # './counter.sh'"): it ran from the task's work directory, which does not exist at submit.
    script = tmp_path / "counter.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    (tmp_path / "plain.txt").write_text("not a program")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "submit", "--json", "--memory", "16MiB", *ep, "--command", "--", "./counter.sh")
    assert code == EXIT_OK, err
    assert json.loads(out)["spec"]["command"] == [str(script)]
    code, _, err = run_cli(capsys, "submit", "--memory", "16MiB", *ep, "--command", "--", "./plain.txt")
    assert code == EXIT_BAD_INPUT and "is not an executable file" in err  # refused at submit, as an absolute path is


def test_drain_stops_submissions_and_health_reports_it(
    manager: Manager, ep: list[str], in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "drain", "--timeout-s", "10", *ep)
    assert code == EXIT_OK, err
    assert out.startswith("drained: 0 task(s) parked")
    code, _, err = run_cli(capsys, "submit", COUNTER, "--memory", "1MiB", *ep)
    assert code == EXIT_BAD_INPUT and "draining" in err
    code, out, _ = run_cli(capsys, "health", *ep)
    assert code == EXIT_FAILED and out.strip() == "NOT_SERVING"
    code, out, err = run_cli(capsys, "drain", "--timeout-s", "10", *ep)  # a second drain says so
    assert code == EXIT_OK, err
    assert out.startswith("already drained by an earlier drain")


# ------------------------------------------------------------------ exit codes


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit", COUNTER, "--memory", "lots"], "cannot parse --memory 'lots'"),
        (["submit", "no_such_module_xyz:Task", "--memory", "1GiB"], "unknown module"),
        (["submit", "sample_tasks:NoSuchClass", "--memory", "1GiB"], "no class"),
        (["submit", COUNTER, "--memory", "1GiB", "--arg", "not-an-assignment"], "bad --arg"),
        (["submit", COUNTER, "--memory", "1GiB", "--args-json", "{nope"], "not valid JSON"),
        (["submit", COUNTER], "--memory"),
        (["submit", "--command", "--memory", "1GiB"], "--command needs"),
        (["ls", "--device", "gpu0"], "unknown device"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], needle: str, short_dir: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, *argv, "--endpoint", f"unix:{short_dir}/none.sock")
    assert code == EXIT_BAD_INPUT
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("freeride: error: ") and needle in lines[0], err


@pytest.mark.parametrize(("variable", "needle"), [
    ("", "SystemExit: 7"), ("FR_TEST_INTERRUPT", "KeyboardInterrupt"),
    ("FR_TEST_OS_EXIT", "ProcessExitCalled: the task called os._exit(7)"),
])
def test_submit_of_a_module_that_exits_at_import_exits_2_saying_so(
    variable: str, needle: str, short_dir: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 13: `freeride submit` exited 7 (the module's own code) with nothing on stderr; so did an os._exit(7).
    if variable:
        monkeypatch.setenv(variable, "1")
    monkeypatch.delitem(sys.modules, "exits_at_import", raising=False)
    code, out, err = run_cli(capsys, "submit", "exits_at_import:Task", "--memory", "1MiB",
                             "--endpoint", f"unix:{short_dir}/none.sock")
    assert code == EXIT_BAD_INPUT and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "failed to import" in lines[0] and needle in lines[0], err


@pytest.mark.parametrize("queue", [False, True], ids=["manager", "queue"])
def test_submit_with_an_argument_the_constructor_does_not_take_exits_2_before_anything_is_sent(
    queue: bool, short_dir: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str],
) -> None:
    # Stranger trial: `submit ... --arg colour=1` was accepted, then failed in the worker as CONFIG.
    where = ["--queue", "redis://127.0.0.1:1/0"] if queue else ["--endpoint", f"unix:{short_dir}/none.sock"]
    code, out, err = run_cli(capsys, "submit", "sample_tasks:Counter", "--memory", "1MiB",
                             "--arg", "colour=1", "--arg", "step_m=2", *where)
    assert code == EXIT_BAD_INPUT and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "arguments do not fit sample_tasks:Counter: unknown argument 'colour'" in lines[0]
    assert "unknown argument 'step_m' (did you mean 'step_ms'?)" in lines[0]  # every one named
    assert "(it takes: step_ms, total, log_steps, cpu_time)" in lines[0]


@pytest.mark.parametrize("argv", [["ls"], ["show", "x-1"], ["cancel", "x-1"],
                                  ["submit", "sample_tasks:Counter", "--memory", "1MiB"]],
                         ids=["ls", "show", "cancel", "submit"])
@pytest.mark.parametrize("manager", [["--device", "cpu:1"], ["--endpoint", "unix:/tmp/m.sock"],
                                     ["--token-file", "/tmp/token"]], ids=["device", "endpoint", "token-file"])
def test_an_option_naming_one_manager_is_refused_beside_the_queue_not_ignored(
    argv: list[str], manager: list[str], in_tests_dir: None, capsys: pytest.CaptureFixture[str],
) -> None:
    # Stranger trial: `ls --queue URL --device cpu:1` listed every device's tasks without a word. The queue's
    # URL is unreachable here: the refusal comes before any connection.
    code, out, err = run_cli(capsys, *argv, "--queue", "redis://127.0.0.1:1/0", *manager)
    assert code == EXIT_BAD_INPUT and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{manager[0]} names one manager" in lines[0] and "DEVICE column" in lines[0], err


@pytest.mark.parametrize("command", [["bench", "--task", "sample_tasks:Counter", "--memory", "64MiB"], ["launch"]],
                         ids=["bench", "launch"])
def test_a_cpu_core_this_process_cannot_run_on_exits_2_before_any_run(
    command: list[str], tmp_path: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str],
) -> None:
    # Stranger trial: `bench --devices cpu:7` on two cores ran the warm-up, then died in sched_setaffinity.
    absent = f"cpu:{max(os.sched_getaffinity(0)) + 1}"
    marker = tmp_path / "ran"
    code, out, err = run_cli(capsys, *command, "--devices", f"{DEVICE},{absent}", "--",
                             sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert code == EXIT_BAD_INPUT and not marker.exists()
    assert err.strip().splitlines()[-1] == f"freeride: error: unknown device {absent}: this machine offers CPU cores " \
        + ", ".join(f"cpu:{c}" for c in sorted(os.sched_getaffinity(0)))


def test_submit_of_values_the_constructor_refuses_exits_2_before_anything_is_sent(
    short_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stranger trial: total_samples=0 was accepted and failed later in the worker as CONFIG.
    monkeypatch.chdir(REPO_ROOT / "examples")
    code, out, err = run_cli(capsys, "submit", "monte_carlo_pi:MonteCarloPi", "--arg", "total_samples=0",
                             "--endpoint", f"unix:{short_dir}/none.sock")
    assert code == EXIT_BAD_INPUT and out == ""
    assert "monte_carlo_pi:MonteCarloPi refused its arguments: ConfigError: total_samples and batch" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["sample_tasks:UnprintableRefusal"], "refused its arguments: _Unprintable: <unprintable>"),
        (["sample_tasks:PositionalOnly"], "parameter 'step_ms' is positional-only"),
        (["sample_tasks:PositionalOnly", "--arg", "step_ms=1"], "'step_ms' is positional-only"),
    ],
    ids=["unprintable", "positional-only", "positional-only-given"],
)
def test_odd_constructors_are_refused_at_submit_with_exit_2_and_one_line(
    argv: list[str], needle: str, short_dir: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, "submit", *argv, "--memory", "1MiB", "--endpoint", f"unix:{short_dir}/none.sock")
    assert code == EXIT_BAD_INPUT and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def test_what_a_constructor_prints_at_submit_goes_to_stderr_not_into_the_output(
    short_dir: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str],
) -> None:
    # Third trial: `id=$(freeride submit ...)` and --json got the constructor's print first.
    code, out, err = run_cli(capsys, "submit", "sample_tasks:PrintsInConstructor", "--memory", "1MiB",
                             "--endpoint", f"unix:{short_dir}/none.sock")
    assert code == 3  # no manager there: the check passed and the submission went out
    assert "HELLO FROM THE CONSTRUCTOR" in err and "HELLO" not in out


def test_ctrl_c_during_a_slow_constructor_at_submit_exits_130(short_dir: Path) -> None:
    marker = short_dir / "constructing"
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "submit", "sample_tasks:SlowConstructor", "--arg",
         f"marker={marker}", "--memory", "1MiB", "--endpoint", f"unix:{short_dir}/none.sock"],
        cwd=TESTS_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(marker.exists, 60, what="the constructor to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err


def test_manager_unknown_device_exits_2(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(
        capsys,
        "manager",
        "--device",
        UNUSABLE,
        "--endpoint",
        f"unix:{short_dir}/m.sock",
        "--state-dir",
        str(short_dir / "state"),
    )
    assert code == EXIT_BAD_INPUT
    assert len(err.strip().splitlines()) == 1 and UNUSABLE in err


def test_manager_bad_options_exit_2(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["manager", "--device", DEVICE, "--state-dir", str(short_dir / "state")]
    code, _, err = run_cli(capsys, *base, "--endpoint", "tcp://127.0.0.1:1")
    assert code == EXIT_BAD_INPUT and "token" in err
    code, _, err = run_cli(capsys, *base, "--endpoint", f"unix:{short_dir}/m.sock", "--grace-ms", "-1")
    assert code == EXIT_BAD_INPUT and "--grace-ms" in err
    code, _, err = run_cli(capsys, *base, "--endpoint", f"unix:{short_dir}/m.sock", "--headroom", "much")
    assert code == EXIT_BAD_INPUT and "cannot parse size" in err
    code, _, err = run_cli(capsys, *base, "--endpoint", f"unix:{short_dir}/m.sock", "--step-timeout-s", "0")
    assert code == EXIT_BAD_INPUT and "--step-timeout-s" in err
    for spin in ("-1", "nan", "100001"):
        code, _, err = run_cli(capsys, *base, "--endpoint", f"unix:{short_dir}/m.sock", "--event-spin-us", spin)
        assert code == EXIT_BAD_INPUT and "--event-spin-us must be a number 0..100000" in err, spin
    for every in ("-1", "inf", "101"):
        code, _, err = run_cli(capsys, *base, "--endpoint", f"unix:{short_dir}/m.sock", "--idle-read-ms", every)
        assert code == EXIT_BAD_INPUT and "--idle-read-ms must be a number 0..100" in err, every


def test_manager_refuses_a_bad_paper_profile_with_exit_2(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["manager", "--device", DEVICE, "--state-dir", str(short_dir / "state"),
            "--endpoint", f"unix:{short_dir}/m.sock"]
    profile = short_dir / "profile.json"
    profile.write_text('{"slots": [{"stage": 0, "slot": 1, "min_ns": 5000000}]}')
    code, _, err = run_cli(capsys, *base, "--paper-profile", str(profile))
    assert code == EXIT_BAD_INPUT and "--policy paper" in err
    code, _, err = run_cli(capsys, *base, "--policy", "paper", "--paper-profile", str(short_dir / "none.json"))
    assert code == EXIT_BAD_INPUT and "cannot read the paper profile" in err
    profile.write_text('{"slots": [{"stage": 0}]}')
    code, _, err = run_cli(capsys, *base, "--policy", "paper", "--paper-profile", str(profile))
    assert code == EXIT_BAD_INPUT and "min_ns" in err
    profile.write_text('{"slots": [{"stage": 0, "slot": 0, "min_ns": 0}]}')
    code, _, err = run_cli(capsys, *base, "--policy", "paper", "--paper-profile", str(profile))
    assert code == EXIT_BAD_INPUT and "non-positive" in err


def test_no_manager_exits_3_naming_endpoint(
    short_dir: Path, in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"unix:{short_dir}/nobody.sock"
    for argv in (["ls"], ["stats"], ["health"], ["show", "x-1"], ["submit", COUNTER, "--memory", "1MiB"]):
        code, out, err = run_cli(capsys, *argv, "--endpoint", endpoint)
        assert code == EXIT_NO_MANAGER, (argv, err)
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and endpoint in lines[0] and "freeride manager --device cpu:0" in lines[0]
        assert "or it is stopping" in lines[0]  # a manager that is exiting answers nothing either


def test_unknown_task_id_exits_4(manager: Manager, ep: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("show", "cancel"):
        code, _, err = run_cli(capsys, command, "nope-42", *ep)
        assert code == EXIT_NOT_FOUND
        assert "nope-42" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ failures are rendered


def test_show_renders_failure_record_of_a_task_that_crashed_in_setup(
    manager: Manager, ep: list[str], in_tests_dir: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "submit", "sample_tasks:SetupCrasher", "--memory", "64MiB", *ep)
    assert code == EXIT_OK, err
    task_id = out.strip()

    stop = threading.Event()
    stream = BubbleStream(manager.endpoint, bubbles(stop))
    try:
        with ControlClient(manager.endpoint) as client:
            wait_for(lambda: client.get(task_id).state == "FAILED", timeout_s=20, what="the task to fail")
    finally:
        stop.set()
        stream.close()

    code, out, err = run_cli(capsys, "show", task_id, *ep)
    assert code == EXIT_OK, err
    assert "state:      FAILED" in out
    assert out.count("failure:") == 1
    assert "cannot set up" in out
    assert "traceback:" in out and 'raise RuntimeError("cannot set up")' in out
    assert out.count('raise RuntimeError("cannot set up")') == 1  # not again in the log tail
    code, out, _ = run_cli(capsys, "ls", "--all", *ep)
    assert task_id in out and "FAILED" in out
    code, out, _ = run_cli(capsys, "cancel", task_id, *ep)  # a stranger read "t FAILED" as the cancel's doing
    assert code == EXIT_OK and out.strip() == f"{task_id} FAILED (over already: nothing to cancel)"


def test_show_says_when_a_failure_came_after_steps_the_worker_never_reported() -> None:
    # Regression: a task frozen mid-grant and then failed as hung showed "progress: 45 steps (45 steps)"
    # beside "at step: 50" (now "after: 50 steps finished"): the steps of its last grant were never reported (it
    # never parked).
    from freeride._cli.tasks import render_task
    from freeride.messages import FailureRecord, TaskInfo, TaskProgress, TaskSpec

    spec = TaskSpec(target="sample_tasks:Counter", memory_bytes=2**26)
    hung = FailureRecord(kind="STEP_TIMEOUT", message="looks hung", step=50)
    out = render_task(TaskInfo("t-1", spec, "FAILED", TaskProgress(steps=45, progress=45.0), failure=hung))
    assert "progress:   45 steps as last reported; its worker had finished 50 steps when it failed" in out
    assert "after:     50 steps finished" in out
    # Stranger trial: "progress: - (0 steps), as last reported: it had finished 9 steps", read as a contradiction.
    out = render_task(TaskInfo("t-3", spec, "FAILED", TaskProgress(steps=0, progress=0.0), failure=hung))
    assert "progress:   none reported (it never parked); its worker had finished 50 steps when it failed" in out
    counted = TaskInfo("t-4", spec, "FAILED", TaskProgress(steps=29, progress=0.0, progress_unit="numbers"),
                       failure=FailureRecord(kind="STEP_TIMEOUT", message="looks hung", step=29))
    assert "progress:   none reported in numbers (29 steps finished)\n" in render_task(counted)
    # Stranger trial: "progress: 120 matmuls (50 steps)" for 120 matmuls said at 30 steps, hung after 50.
    said = TaskInfo("t-5", spec, "FAILED", TaskProgress(steps=30, progress=120.0, progress_unit="matmuls"),
                    failure=hung)
    assert ("progress:   120 matmuls (30 steps) as last reported; its worker had finished 50 steps when it failed"
            in render_task(said))
    crashed = FailureRecord(kind="EXCEPTION", message="boom", step=45)
    out = render_task(TaskInfo("t-2", spec, "FAILED", TaskProgress(steps=45, progress=45.0), failure=crashed))
    assert "progress:   45 steps\n" in out  # the counts agree: nothing added


def test_show_says_what_an_overrun_is_where_a_task_has_any() -> None:
    # Stranger trial: "overruns: 60" for a task of 15 us steps read as its steps running long.
    from freeride._cli.tasks import render_task
    from freeride.messages import TaskInfo, TaskProgress, TaskSpec

    spec = TaskSpec(target="sample_tasks:Counter", memory_bytes=2**26)
    out = render_task(TaskInfo("t-1", spec, "PARKED", TaskProgress(steps=49, progress=49.0, overruns=60)))
    line = next(line for line in out.splitlines() if line.startswith("overruns:"))
    assert line.split()[1] == "60" and "when the rank took the core back" in line
    clean = render_task(TaskInfo("t-2", spec, "PARKED", TaskProgress(steps=49, progress=49.0)))
    assert next(line for line in clean.splitlines() if line.startswith("overruns:")).split() == ["overruns:", "0"]


# ------------------------------------------------------------------ real processes


def test_subprocess_cli_against_in_process_manager(manager: Manager, ep: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "freeride.cli", "submit", COUNTER, "--memory", "8MiB", *ep],
        cwd=TESTS_DIR,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_OK, result.stderr
    task_id = result.stdout.strip()
    result = subprocess.run(
        [sys.executable, "-m", "freeride.cli", "show", task_id, "--json", *ep],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_OK, result.stderr
    assert json.loads(result.stdout)["spec"]["target"] == COUNTER


def test_manager_daemon_serves_health_and_exits_0_on_sigterm(short_dir: Path) -> None:
    endpoint = f"unix:{short_dir}/d.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "freeride.cli",
            "manager",
            "--device",
            DEVICE,
            "--endpoint",
            endpoint,
            "--state-dir",
            str(short_dir / "state"),
            "--headroom",
            "128MiB",
            "--grace-ms",
            "1",
        ],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        target = Endpoint("unix", str(short_dir / "d.sock"))

        def serving() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"manager exited early: {proc.communicate()[1]}")
            try:
                return health_status(target, timeout_s=1.0) == "SERVING"
            except ManagerUnavailable:
                return False

        wait_for(serving, timeout_s=30, what="the manager to serve")
        health = subprocess.run(
            [sys.executable, "-m", "freeride.cli", "health", "--endpoint", endpoint],
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == EXIT_OK, health.stderr
        assert health.stdout.strip() == "SERVING"

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"freeride manager for cpu:0 listening on {endpoint}; state in" in err
        assert not os.path.exists(target.address)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_output_to_a_reader_that_went_away_ends_quietly_with_the_sigpipe_status() -> None:
    # Stranger trial: `freeride top | head` and `freeride bubbles --json | head` ended in a traceback.
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "freeride.cli", "plan", "--stages", "4", "--microbatches", "8"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_a_command_tasks_own_options_without_the_separator_are_refused_saying_where_they_go(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A stranger's `submit --command --memory 64MiB sh -c '...'` met a bare argparse "unrecognized arguments".
    with pytest.raises(SystemExit) as info:
        main(["submit", "--command", "--memory", "64MiB", "sh", "-c", "sleep 1"])
    err = capsys.readouterr().err
    assert info.value.code == EXIT_BAD_INPUT
    assert ("unrecognized arguments: -c sleep 1; a command's own options follow `--`: freeride submit --command "
            "[options] -- PROGRAM ARGS...") in err


def test_a_command_line_it_cannot_take_never_prints_a_password_and_says_it_in_json_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Stranger trial: `stats --queue redis://:pw123@host` (stats takes no --queue) printed the password in
    # "unrecognized arguments", under the top level's usage, and nothing on stdout with --json.
    for argv in (["stats", "--queue", "redis://:pw123@127.0.0.1:1/0"],
                 ["stats", "--json", "--queue", "redis://user:pw123@127.0.0.1:1/0"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main(argv)
        out, err = capsys.readouterr()
        assert info.value.code == EXIT_BAD_INPUT
        assert "pw123" not in out + err and ":***@127.0.0.1:1/0" in err
        assert "usage: freeride stats " in err and "freeride stats: error: unrecognized arguments: --queue" in err
        if "--json" in argv:
            assert json.loads(out) == {"error": "unrecognized arguments: --queue redis://user:***@127.0.0.1:1/0",
                                       "exit_code": EXIT_BAD_INPUT}
        else:
            assert out == ""


@pytest.mark.parametrize("argv", [
    ["bench", "--max-trails", "2", "--", "true"],
    ["launch", "--devices", "cpu:0", "--bogus", "--", "true"],
    ["submit", "x:Y", "--devcie", "cpu:0"],
    ["submit", "--command", "--devcie", "cpu:0", "--", "true"],
])
def test_a_misspelt_option_of_a_command_with_a_command_of_its_own_is_said_under_that_commands_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Stranger trial: `bench --max-trails 2 -- true` crashed (TypeError: unhashable type: 'list'): the top level's
    # dest "command" was overwritten by bench's and launch's own `command`; submit's --command flag sent its
    # misspelt option under the top level's usage.
    has_json = argv[0] != "launch"
    for json_too in (False, True) if has_json else (False,):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main([argv[0], *(["--json"] if json_too else []), *argv[1:]])
        out, err = capsys.readouterr()
        assert info.value.code == EXIT_BAD_INPUT and "Traceback" not in err
        assert f"usage: freeride {argv[0]} " in err and f"freeride {argv[0]}: error: unrecognized arguments: " in err
        if json_too:
            assert json.loads(out)["exit_code"] == EXIT_BAD_INPUT
        else:
            assert out == ""
