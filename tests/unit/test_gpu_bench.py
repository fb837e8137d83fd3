"""The GPU run's logic on CPU, so that the first GPU minutes measure rather than debug: the plan fits the
lent machine, steps are chosen, run under their limits, skipped for missing imports and packed after
each; wheels are chosen for what is missing; an MPS daemon is started and quit; and the measurement
scripts' arithmetic gives the figures it claims on known inputs."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomllib
from conftest import wait_for

from bench.gpu import backends, caps, ensure_deps, park_tail, step_timing, steps
from bench.gpu.bubble_timing import LABEL, action_label, action_spans
from bench.gpu.caps import verdict
from bench.gpu.mps_daemon import MpsDaemon
from bench.gpu.nccl_latency import summarise as nccl_summary
from bench.gpu.park_tail import FreeRun
from bench.gpu.step_timing import summarise as timing_summary
from freeride.devices.mps import probe_mps
from freeride.task import TaskContext
from side_tasks.graphs import PageRank
from side_tasks.graphs.tasks import parse_graph_spec

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

# ---------------------------------------------------------------------- the plan


def test_the_plan_fits_the_lent_machine() -> None:
    assert steps.plan_problems() == []
    for part in steps.PARTS:
        assert part[0] == "deps" and steps.part_limit_s(part) <= steps.PART_LIMIT_S < steps.COMMAND_LIMIT_S


def test_a_session_whose_parts_outlast_its_device_time_is_a_plan_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "SESSIONS", ((1, 2, 3), (4, 5)))
    assert any(p.startswith("session 1's parts may take") for p in steps.plan_problems())
    monkeypatch.setattr(steps, "SESSIONS", ((1,), (2, 4), (5,)))
    assert "the sessions run parts [1, 2, 4, 5], not each of 1 to 5 once" in steps.plan_problems()


def test_run_sh_lists_the_plans_commands_in_order() -> None:
    header = (REPO / "bench/gpu/run.sh").read_text()
    listed = re.findall(r"^#\s+\d\. bash bench/gpu/run\.sh ([a-z -]+?)\s+# <= ([\d.]+) min$", header, re.M)
    assert [tuple(c.split()) for c, _ in listed] == list(steps.PARTS)
    assert [float(m) for _, m in listed] == [round(steps.part_limit_s(p) / 60, 1) for p in steps.PARTS]


def test_steps_are_chosen_by_name_part_or_all() -> None:
    assert [s.name for s in steps.select([], part=2)] == list(steps.PARTS[1])
    assert [s.name for s in steps.select(["caps", "caps", "deps"])] == ["caps", "deps"]
    assert {s.name for s in steps.select(["all"])} == set(steps.STEPS)
    with pytest.raises(ValueError, match="unknown step.*nope"):
        steps.select(["nope"])
    with pytest.raises(ValueError, match="--part must be 1 to 5"):
        steps.select([], part=6)


def test_no_arguments_print_the_plan_and_run_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert steps.main([]) == 0
    assert f"bash bench/gpu/run.sh {' '.join(steps.PARTS[0])}" in capsys.readouterr().out


def test_run_sh_without_a_gpu_says_so_and_measures_nothing(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(REPO / "bench/gpu/run.sh"), "clock"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}, timeout=120)
    assert done.returncode == 2 and "no usable NVIDIA GPU here" in done.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- running steps

PY = sys.executable


def step(name: str, code: str, limit_s: int = 60, **kw: Any) -> steps.Step:
    return steps.Step(name, name, ("-c", code, "{results}"), limit_s, needs=kw.pop("needs", ()), **kw)


def test_each_step_is_packed_as_soon_as_it_ends_and_a_failing_one_costs_only_itself(tmp_path: Path) -> None:
    results, out = tmp_path / "gpu-test", tmp_path / "out"
    results.mkdir()
    first = step("first", "import sys, pathlib; pathlib.Path(sys.argv[1], 'first.json').write_text('{}')")
    # The second step finds the first one's results already packed in $OUT.
    check = step("second", "import os, sys, tarfile; names = tarfile.open(os.environ['OUT'] + '/gpu-results.tgz')"
                           ".getnames(); sys.exit(0 if 'gpu-test/first.json' in names else 5)")
    failing = step("failing", "print('boom'); raise SystemExit(3)")
    lacking = step("lacking", "pass", needs=("no_such_module_anywhere",))
    done = steps.run_steps([steps.DEPS, first, check, failing, lacking], results, out, {**os.environ, "OUT": str(out)})
    assert [(r.name, r.status) for r in done] == [
        ("first", "ok"), ("second", "ok"), ("failing", "exit 3"),
        ("lacking", "skipped: no_such_module_anywhere cannot be imported here")]
    assert (results / "failing.log").read_text().strip() == "boom"
    with tarfile.open(out / "gpu-results.tgz") as tar:
        names = set(tar.getnames())
    assert {"gpu-test/first.json", "gpu-test/steps.txt", "gpu-test/failing.log"} <= names
    assert (out / "steps.txt").read_text().splitlines()[2].startswith("failing: exit 3")
    assert json.loads((results / "steps.json").read_text())[0]["status"] == "ok"


def test_a_step_over_its_limit_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    results = tmp_path / "r"
    results.mkdir()
    [result] = steps.run_steps([step("slow", code, limit_s=2)], results, None, dict(os.environ))
    assert result.status == "timed out after 2 s" and result.seconds < 30
    child = int(pid_file.read_text())
    wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2],
             20, what="the step's own child killed with it")


class FakeMps:
    def __init__(self, why: str = "") -> None:
        self.why = why
        self.stopped = False

    def start(self) -> str:
        return self.why

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/fake-mps"}

    def stop(self) -> None:
        self.stopped = True


def test_an_mps_step_runs_as_a_client_of_its_own_daemon_and_quits_it(tmp_path: Path) -> None:
    code = "import os, sys; sys.exit(0 if os.environ['CUDA_MPS_PIPE_DIRECTORY'] == '/tmp/fake-mps' else 4)"
    daemon = FakeMps()
    [ok] = steps.run_steps([step("m", code, mps=True)], tmp_path, None, dict(os.environ), mps_daemon=lambda p: daemon)
    assert ok.status == "ok" and daemon.stopped
    none = FakeMps("nvidia-cuda-mps-control is not installed")
    [skipped] = steps.run_steps([step("m", code, mps=True)], tmp_path, None, dict(os.environ),
                                mps_daemon=lambda p: none)
    assert skipped.status == "skipped: no MPS here (nvidia-cuda-mps-control is not installed)"


FAKE_CONTROL = """#!{python}
# nvidia-cuda-mps-control, faked: -d starts a daemon holding the control pipe open; "quit" on stdin ends it.
import os, subprocess, sys
pipes = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
if sys.argv[1:] == ["-d"]:
    os.mkfifo(os.path.join(pipes, "control"))
    serve = "import os, time; fd = os.open({{!r}}, os.O_RDONLY | os.O_NONBLOCK); time.sleep(600)"
    p = subprocess.Popen([sys.executable, "-c", serve.format(os.path.join(pipes, "control"))], start_new_session=True)
    open(os.path.join(pipes, "nvidia-cuda-mps-control.pid"), "w").write(str(p.pid))
elif sys.stdin.read().strip() == "quit":
    os.kill(int(open(os.path.join(pipes, "nvidia-cuda-mps-control.pid")).read()), 9)
"""


def test_an_mps_daemon_of_our_own_is_started_live_and_quit(tmp_path: Path) -> None:
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(FAKE_CONTROL.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    pipes = Path(f"/tmp/fr-mpsd-{os.getpid()}")
    daemon = MpsDaemon(pipes, binary=str(binary))
    assert daemon.start() == ""
    assert probe_mps(daemon.env()).live
    daemon.stop()
    assert not pipes.exists() and not Path(f"{pipes}-log").exists()
    assert MpsDaemon(pipes, binary="no-such-mps-control").start() == "no-such-mps-control is not installed"


# ---------------------------------------------------------------------- wheels


def wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_version_clauses_are_read_as_pip_reads_them() -> None:
    assert ensure_deps.satisfies("7.36.2", ">=7.35.1,<8")
    assert not ensure_deps.satisfies("8.0.0", "<8.0dev,>=7.35.1")
    assert ensure_deps.satisfies("1.85.1", "==1.85.1.0") and not ensure_deps.satisfies("1.85.1", "!=1.85.1")
    assert ensure_deps.split_requirement("grpcio (>=1.85.1) ; python_version >= '3.10'") == ("grpcio", ">=1.85.1")
    assert ensure_deps.split_requirement("Pytest_Timeout[x]>=2.3") == ("pytest-timeout", ">=2.3")


def test_only_what_is_missing_or_too_old_is_installed_with_its_unmet_requirements(tmp_path: Path) -> None:
    health = wheel(tmp_path, "grpcio-health-checking", "1.85.1", ("protobuf<8.0.0,>=7.35.1", "grpcio>=1.85.1"))
    grpcio = wheel(tmp_path, "grpcio", "1.85.3")
    wheel(tmp_path, "protobuf", "7.36.2")
    machine = {"grpcio": "1.80.0", "protobuf": "7.36.0"}  # old grpcio; no health checking

    def version_of(name: str) -> str | None:
        return None if name == "grpcio-health-checking" else machine.get(name, "99")

    assert ensure_deps.unmet(version_of=version_of) == ["grpcio>=1.85.1", "grpcio-health-checking>=1.85.1"]
    installed: list[list[Path]] = []
    missing, chosen = ensure_deps.ensure(tmp_path, tmp_path / "site", version_of,
                                         lambda w, target: installed.append(w))
    assert chosen == installed[0] == [grpcio, health]  # protobuf 7.36.0 meets health checking's bound: kept
    machine["grpcio"] = "1.86.0"
    assert ensure_deps.choose_wheels(["grpcio-health-checking>=1.85.1"], [health, grpcio], version_of) == [health]


def test_an_optional_requirement_is_installed_only_where_its_wheel_is_carried(tmp_path: Path) -> None:
    def version_of(name: str) -> str | None:  # every requirement met but Megatron Core
        return {"megatron-core": None, "protobuf": "7.36.2"}.get(name, "99")

    installed: list[list[Path]] = []
    assert ensure_deps.ensure(tmp_path, tmp_path / "site", version_of, lambda w, t: installed.append(w)) == ([], [])
    megatron = wheel(tmp_path, "megatron-core", "0.19.2", ("torch>=2.6.0", "numpy", "packaging>=24.2"))
    missing, chosen = ensure_deps.ensure(tmp_path, tmp_path / "site", version_of, lambda w, t: installed.append(w))
    assert missing == ["megatron-core>=0.19.2"] and chosen == installed[0] == [megatron]


def test_a_requirement_no_carried_wheel_meets_is_named(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="grpcio-health-checking>=1.85.1"):
        ensure_deps.choose_wheels(["grpcio-health-checking>=1.85.1"], [wheel(tmp_path, "grpcio", "1.85.3")],
                                  lambda n: None)


def test_the_pinned_wheels_meet_freerides_requirements() -> None:
    pins = dict(line.split("==") for line in (REPO / "bench/gpu/wheels.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # The core's requirements and the extras' (the bundled tasks, the demo and the bench bring NumPy,
    # SciPy, Pillow and matplotlib); an extra's reference to another (freeride[tasks]) names no package.
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    declared = dict(ensure_deps.split_requirement(r) for r in project["dependencies"] + extras
                    if ensure_deps.split_requirement(r)[0] != "freeride")
    # DeepSpeed's own requirements that the GPU machine lacks are not freeride's.
    for name in ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"):
        assert name not in declared and pins.pop(name)
    for name, version in pins.items():
        assert ensure_deps.satisfies(version, declared[name]), (name, version, declared[name])
    for req in ensure_deps.REQUIREMENTS:  # the GPU steps' list follows pyproject's bounds
        name, spec = ensure_deps.split_requirement(req)
        assert declared[name] == spec, (name, spec, declared[name])


def test_fetch_wheels_downloads_the_pins_for_the_gpu_machines_python(tmp_path: Path) -> None:
    fake_pip = tmp_path / "pip"
    fake_pip.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/args\n")
    fake_pip.chmod(0o755)
    work = tmp_path / "repo"
    (work / "bench/gpu").mkdir(parents=True)
    for f in ("fetch_wheels.sh", "wheels.txt"):
        (work / "bench/gpu" / f).write_text((REPO / "bench/gpu" / f).read_text())
    subprocess.run(["bash", str(work / "bench/gpu/fetch_wheels.sh")], env={**os.environ, "PIP": str(fake_pip)},
                   check=True, capture_output=True, timeout=60)
    download, build = ((tmp_path / "args").read_text().splitlines())
    args = download.split()
    assert args[0] == "download" and args[args.index("--python-version") + 1] == "3.12" and "--no-deps" in args
    assert {a for a in args if "==" in a} == {"grpcio-health-checking==1.85.1", "grpcio==1.85.3", "protobuf==7.36.2",
                                              "megatron-core==0.19.2", "hjson==3.1.0", "pydantic==2.14.4",
                                              "pydantic-core==2.50.5", "annotated-types==0.8.0",
                                              "typing-inspection==0.4.5", "typing-extensions==4.16.0"}
    # DeepSpeed publishes only its source: built here, with this torch (no build isolation), without kernels.
    assert build.split() == ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", ".whl", "deepspeed==0.19.8"]


# ---------------------------------------------------------------------- the measurements' arithmetic


def test_an_allocator_cap_holds_or_is_over_and_a_raw_allocation_is_caught_or_not() -> None:
    cap = 1024 * MiB
    assert verdict({}, cap, 1000 * MiB, "", 5)["verdict"] == "held"
    over = verdict({}, cap, 1100 * MiB, "", 5)
    assert (over["verdict"], over["overshoot_bytes"], over["ok"]) == ("OVER", 76 * MiB, False)
    raw = verdict({"via": "raw"}, cap, 1792 * MiB, "MEMORY_LIMIT", 3)  # past the cap until the poll saw it
    assert (raw["enforcement"], raw["overshoot_bytes"], raw["verdict"], raw["ok"]) == (
        "watchdog", 768 * MiB, "caught", True)
    assert verdict({"via": "raw"}, cap, None, "", 5)["verdict"] == "NOT CAUGHT"
    assert verdict({"via": "raw"}, cap, 2048 * MiB, "", 0)["verdict"] == "NOT CAUGHT"
    assert verdict({}, cap, None, "", 5)["overshoot_bytes"] is None


def test_step_timing_compares_host_and_device_step_by_step() -> None:
    out = timing_summary([2.0, 3.0, 5.0], [1.5, 2.9, 4.0], [0.1, 0.1, 0.2])
    assert out["host_minus_device_ms"]["max"] == pytest.approx(1.0)
    assert out["host_minus_device_ms"]["count"] == 3 and out["device_ms"]["p50"] == pytest.approx(2.9)


def test_the_gpu_is_free_at_the_first_of_three_fast_probes_in_a_row() -> None:
    run = FreeRun(idle_s=0.001)
    feed = [(0.0, 0.010), (0.1, 0.001), (0.2, 0.0015), (0.3, 0.005), (0.4, 0.001), (0.5, 0.002), (0.6, 0.0011)]
    results = [run.add(t, took) for t, took in feed]
    assert results == [False, False, False, False, False, False, True]
    assert run.start == 0.4  # the first of the three, not the last


def kernel(start: float, end: float, corr: int) -> Any:
    return SimpleNamespace(name="sm90_gemm", device_type="DeviceType.CUDA", time_range=SimpleNamespace(
        start=start, end=end), linked_correlation_id=corr, id=0)


def cpu(name: str, op_id: int, children: list[Any] | None = None) -> Any:
    return SimpleNamespace(name=name, device_type="DeviceType.CPU", time_range=SimpleNamespace(start=0, end=1),
                           id=op_id, cpu_children=children or [], linked_correlation_id=0)


def test_an_actions_device_span_is_that_of_the_kernels_launched_under_its_label() -> None:
    a, b = action_label(0, 0), action_label(0, 1)
    events = [cpu(a, 1, [cpu("aten::mm", 2), cpu("aten::mm", 3)]), cpu(b, 4, [cpu("aten::mm", 5)]),
              kernel(10.0, 20.0, 2), kernel(21.0, 30.0, 3), kernel(40.0, 55.0, 5),
              kernel(31.0, 39.0, 99)]  # a spin kernel on the comm stream: under no label
    assert action_spans(events) == {a: (10.0, 30.0), b: (40.0, 55.0)}
    # Where the profiler gives GPU-side annotations, they are the spans.
    annotated = [*events, SimpleNamespace(name=a, device_type="DeviceType.CUDA",
                                          time_range=SimpleNamespace(start=9.5, end=30.5))]
    assert action_spans(annotated) == {a: (9.5, 30.5)}
    assert a.startswith(LABEL)


def test_a_side_tasks_added_latency_is_against_the_same_mps_setting() -> None:
    samples = {"alone": [10.0] * 9 + [12.0], "beside a side task": [30.0] * 9 + [900.0],
               "alone, MPS": [11.0] * 10, "beside a side task, MPS": [13.0] * 10}
    out = nccl_summary(samples)
    assert out["added_us"]["beside a side task"]["p50"] == pytest.approx(20.0)
    assert out["added_us"]["beside a side task, MPS"] == {"p50": pytest.approx(2.0), "p99": pytest.approx(2.0)}
    assert set(nccl_summary({"alone": [1.0]})["added_us"]) == set()


# ---------------------------------------------------------------------- what a measurement exercises


def test_caps_calls_a_task_that_took_no_step_not_exercised_rather_than_held() -> None:
    cap = 3072 * MiB
    # The first GPU run: graph tasks frozen in setup, training tasks still starting, each at its context's peak.
    idle = verdict({"graph": "rmat:20"}, cap, 710 * MiB, "", 0)
    assert (idle["verdict"], idle["ok"]) == ("not exercised", False)
    assert verdict({"via": "raw"}, cap, 710 * MiB, "", 0)["verdict"] == "not exercised"
    assert verdict({}, cap, None, "", 0)["verdict"] == "not exercised"
    # A failure exercised it: the watchdog fails a raw allocation mid-grant, before a park reported a step.
    assert verdict({"via": "raw"}, cap, 23748 * MiB, "MEMORY_LIMIT", 0)["verdict"] == "caught"
    assert verdict({}, cap, 2756 * MiB, "MEMORY_LIMIT", 8)["verdict"] == "held"
    assert verdict({}, cap, 3100 * MiB, "", 0)["verdict"] == "OVER"  # a context past the cap is over it


def test_caps_bubbles_go_on_past_the_seconds_until_a_long_setup_has_given_a_few_steps() -> None:
    go = caps.keep_stepping
    assert go(1.0, 3.0, 50, "PARKED")  # the seconds are not over
    assert go(10.0, 3.0, 0, "FROZEN") and go(10.0, 3.0, caps.MIN_STEPS - 1, "PARKED")  # setup, first steps
    assert not go(3.5, 3.0, caps.MIN_STEPS, "PARKED")
    assert not go(1.0, 3.0, 0, "FAILED") and not go(1.0, 3.0, 2, "FINISHED")
    assert not go(3.0 + caps.SETUP_LIMIT_S, 3.0, 0, "FROZEN")  # bounded: the row then says "not exercised"


@pytest.mark.parametrize("module", [caps, step_timing, park_tail, backends], ids=lambda m: m.__name__)
def test_a_bench_pagerank_steps_for_as_long_as_the_bench_asks(module: Any, tmp_path: Path) -> None:
    """PageRank stops once its L1 change < n * tol: at the default tol that is its first step on an R-MAT graph
    of a million vertices (the first GPU run's step_timing had no PageRank sample). Run on rmat:8 with the tol
    scaled to the same n * tol."""
    default_tol = PageRank.__init__.__defaults__[1]  # type: ignore[index]
    found = 0
    for name, target, args in module.TASKS:
        if not target.endswith(":PageRank"):
            continue
        found += 1
        spec = parse_graph_spec(args["graph"])
        assert spec is not None
        task = PageRank(**{**args, "graph": "rmat:8", "tol": args.get("tol", default_tol) * 2 ** (spec[0] - 8)})
        task.setup(TaskContext(device="cpu", device_name="cpu", memory_limit_bytes=2**30, task_id=name,
                               work_dir=tmp_path, logger=logging.getLogger(name)))
        for _ in range(100):
            task.step()
        assert not task.done(), f"{module.__name__}'s {name} finished after {task.iteration} steps"
    assert found == 1


def test_step_timing_says_a_task_that_gave_no_sample_finished_in_warm_up() -> None:
    rows = [{"task": "pagerank", "steps": 1, "finished": True, **timing_summary([], [], [])},
            {"task": "lstm", "steps": 33, "finished": False, **timing_summary([2.0], [1.5], [0.1])}]
    text = step_timing.table(rows)
    assert "| pagerank | no steps: finished in warm-up (done after 1 steps" in text and "nan" not in text
    assert "| lstm | 1.500 | 2.000 | 0.500 / 0.500 | 0.100 |" in text


def test_caps_writes_its_rows_as_it_goes_so_a_run_cut_off_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(name: str, target: str, args: dict[str, Any], cap: int, seconds: float) -> dict[str, Any]:
        if name == "components":
            raise TimeoutError("killed at the step's limit")
        return {"task": name, "cap_bytes": cap, "nvml_peak_bytes": 700 * MiB, "nvml_visible": True, "state": "PARKED",
                "steps": 5, "failure": "", "message": "", "enforcement": "allocator", "overshoot_bytes": 0,
                "verdict": "held", "ok": True}

    written: list[tuple[list[str], str]] = []  # the tasks of each write, and its table
    monkeypatch.setattr(caps, "measure", measure)
    monkeypatch.setattr(caps, "write_results", lambda name, data, table, command: written.append(
        ([r["task"] for r in data["rows"]], table)))
    with pytest.raises(TimeoutError):
        caps.main(["--seconds", "1"])
    assert [tasks for tasks, _ in written] == [["pagerank"], ["pagerank", "bfs"]]
    assert "| bfs | allocator | 3.0 GiB | 700 MiB | 0 MiB | held | PARKED (5 steps) |" in written[-1][1]
    assert "Not measured (the run ended or is still going): components, watermark" in written[-1][1]


def test_backends_prints_and_writes_each_run_as_it_ends_and_a_failed_run_is_a_row(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The first GPU run's backends ran past its limit and left nothing."""
    calls: list[tuple[str, str]] = []

    def run_standalone(target: str, args: dict[str, Any], device: str, seconds: float, limit: int) -> Any:
        calls.append((target, args["backend"]))
        if len(calls) == 4:
            raise RuntimeError("CUDA error: no kernel image")
        if len(calls) == 6:
            raise KeyboardInterrupt  # killed at the step's limit
        return SimpleNamespace(step_ms_p50=1.0, step_ms_p99=2.0, progress_per_s=100.0 * len(calls),
                               progress_unit="iterations", steps=10 * len(calls), finished=len(calls) == 3,
                               setup_s=0.5, peak_memory_bytes=700 * MiB)

    written: list[str] = []
    monkeypatch.setattr(backends, "run_standalone", run_standalone)
    monkeypatch.setattr(backends, "fresh_cuda_memory", lambda: None)
    monkeypatch.setattr(backends, "write_results", lambda name, data, table, command: written.append(table))
    with pytest.raises(KeyboardInterrupt):
        backends.main(["--seconds", "1"])
    assert len(written) == 5 and len(capsys.readouterr().out.splitlines()) == 5
    table = written[-1].splitlines()
    assert table[2] == "| pagerank | 1.000 / 2.000 | 1.000 / 2.000 | 2.00x | 700 / 700 | 10 / 20 |"
    assert table[3].startswith("| bfs | 1.000 / 2.000 | failed: RuntimeError: CUDA error: no kernel image | - |")
    assert table[4] == "| components | 1.000 / 2.000 | not run | - | 700 / - | 50 / - |"
    assert table[-1] == "Not measured (the run ended or is still going): watermark."
    assert "30 (done)" in table[3]


def test_park_tail_writes_its_rows_as_it_goes_and_a_task_that_never_stepped_is_not_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(name: str, target: str, args: dict[str, Any], trials: int, probe: Any, mps: str) -> dict[str, Any]:
        if name == "watermark":
            raise TimeoutError("killed at the step's limit")
        if name == "pagerank":
            return {"task": name, "not_measured": "0 steps in 30 s of bubbles before the trials (FROZEN)"}
        figures = {"count": 8, "p50": 1.0, "p99": 2.0, "max": 2.0}
        return {"task": name, "park_ms": figures, "sigstop_ms": figures, "manager_park_latency_ms": {"p99": 0.5},
                "samples_ms": {"park": [1.0], "sigstop": [1.0]}}

    written: list[str] = []
    monkeypatch.setattr(park_tail, "Probe", lambda: SimpleNamespace(idle_s=50e-6))
    monkeypatch.setattr(park_tail, "measure", measure)
    monkeypatch.setattr(park_tail, "write_results", lambda name, data, table, command: written.append(table))
    with pytest.raises(TimeoutError):
        park_tail.main(["--trials", "1"])
    assert len(written) == 2
    assert "| kernel-storm | 1.00 / 2.00 | 1.00 / 2.00 | 0.50 |" in written[-1]
    assert "| pagerank | not measured: 0 steps in 30 s of bubbles before the trials (FROZEN) | - | - |" in written[-1]

