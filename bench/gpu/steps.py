"""The GPU run, in steps that fit the lent GPU machine: which commands, in which order, within what time.

The machine (see the device tool's notes) has one GPU, no network, at most 10 minutes per command and
15 minutes of device time per session, counted from the machine's start (about half a minute) to its
return; files come back only from ``$OUT``, and a command cut off at its limit returns what it left
there. So the run is :data:`PARTS`, commands of steps, two to a session (:data:`SESSIONS`), each step
under a time limit of its own, and after every step its results are already under
``bench/results/gpu-<model>/`` and packed into ``$OUT/gpu-results.tgz``: a step that overruns is killed
(with every process it started) and costs only itself.

The first session's parts hold what the third H200 run found wanting and what changed since: the
instrumentation's cost taken apart call by call (26 us a mark there, its resolver since made to keep the
GIL for events already done), the demo on a GPU (inconsistent there: long setups kept every first turn,
changed since) and the GPU tests (one failed there for bubbles too short, changed since); then the
regression checks of the device clock and of every task stepping in bubbles. The second's: the framework
adapters on the device clock (all passed there), caps with steps taken, CuPy against torch, step times,
the stand-in for a neighbour's receive, and the park tails (MPS among them); the third, the bench modes.
The limits are about one and a half times what each step took on the H200.

    bash bench/gpu/run.sh --plan          # the plan, with each step's limit
    bash bench/gpu/run.sh --part 1        # the first command of the plan
    bash bench/gpu/run.sh caps timing     # some steps

Before the first step: the wheels in ``.whl/`` that this machine needs are installed
(:mod:`bench.gpu.ensure_deps`), and a step whose imports are still missing is skipped with the reason
rather than failed. Standard library only, up to the steps themselves.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The lent machine's limits (device tool's notes): one command, one session, and what each command
#: costs beyond its steps (a machine's start, a minute or more where none is warm; the transfers; the
#: idle time after it).
COMMAND_LIMIT_S = 600
LEASE_S = 900
#: The H200 run: 32 s for the first command (the machine's start and the transfers), 6 s for the next.
OVERHEAD_PER_COMMAND_S = 45
#: What one command of the plan may take at most: well under the 10-minute cap.
PART_LIMIT_S = 540
ARCHIVE = "gpu-results.tgz"


@dataclass(frozen=True)
class Step:
    """One step: ``python ARGV`` from the repository root (``{results}`` is the results directory)."""

    name: str
    what: str
    argv: tuple[str, ...]
    limit_s: int
    needs: tuple[str, ...] = ("torch", "grpc", "grpc_health", "google.protobuf", "pynvml", "freeride")
    #: Run under an MPS control daemon of its own (a private pipe directory), quit afterwards.
    mps: bool = False
    env: dict[str, str] = field(default_factory=dict)


_PYTEST = ("-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs", "-m", "gpu")
_TEST_NEEDS = ("torch", "grpc", "grpc_health", "google.protobuf", "pynvml", "freeride", "pytest", "pytest_timeout",
               "hypothesis")
_TASKS = "every_bundled_task"
_ADAPTER_TESTS = tuple(f"tests/gpu/test_{name}_device_time.py" for name in ("megatron", "deepspeed", "torchtitan"))

#: Installing the carried wheels (always done first; named in a command so that the plan shows it).
DEPS = Step("deps", "install what this machine lacks from .whl/", (), 30, needs=())
STEPS: dict[str, Step] = {s.name: s for s in (
    DEPS,
    Step("clock", "the device clock on the GPU: order, device times, graph capture, one hardware queue",
         (*_PYTEST, "--timeout", "60", "tests/gpu/test_device_clock.py", "--junitxml", "{results}/clock.xml"),
         30, needs=_TEST_NEEDS),
    Step("tests", "pytest -m gpu: caps, host memory, restarts, parks and freezes, NVML, MPS, the GPU trainer",
         (*_PYTEST, "--timeout", "150", "tests/gpu", "tests/trainer/test_single_stage.py", "-k", f"not {_TASKS}",
          "--deselect", "tests/gpu/test_device_clock.py", *(a for f in _ADAPTER_TESTS for a in ("--ignore", f)),
          "--junitxml", "{results}/tests.xml"),
         260, needs=_TEST_NEEDS),
    # DeepSpeed and Megatron Core come from carried wheels (ensure_deps.OPTIONAL): without them their tests
    # skip, naming the framework.
    Step("adapters", "the framework adapters on the device clock: Megatron Core, DeepSpeed, torchtitan",
         (*_PYTEST, "--timeout", "120", *_ADAPTER_TESTS, "--junitxml", "{results}/adapters.xml"),
         120, needs=_TEST_NEEDS),
    Step("tasks", "pytest -m gpu: every bundled task steps on the GPU inside bubbles",
         (*_PYTEST, "--timeout", "90", "tests/gpu/test_gpu_manager.py", "-k", _TASKS,
          "--junitxml", "{results}/tasks.xml"), 200, needs=_TEST_NEEDS),
    Step("caps", "each task's NVML peak against its cap; raw cudaMalloc's overshoot",
         # 3 s of bubbles once each worker is ready, and on until its first steps (caps.SETUP_LIMIT_S): 9 tasks
         # in about 80 s by estimate, most of it workers starting and setups.
         ("-m", "bench.gpu.caps", "--seconds", "3"), 100),
    Step("timing", "step time: the runtime's host timer against CUDA events",
         ("-m", "bench.gpu.step_timing", "--steps", "30"), 60),
    Step("bubbles", "device-timed bubbles against the profiler; the instrumentation's cost",
         ("-m", "bench.gpu.bubble_timing", "--iterations", "40"), 45),
    Step("nccl", "a neighbour's receive beside a side task, with and without MPS",
         ("-m", "bench.gpu.nccl_latency", "--samples", "200"), 60),
    Step("park", "park and SIGSTOP tails, side tasks outside MPS",
         ("-m", "bench.gpu.park_tail", "--mps", "off", "--trials", "8"), 120),
    Step("park-mps", "park and SIGSTOP tails, side tasks as MPS clients",
         ("-m", "bench.gpu.park_tail", "--mps", "require", "--trials", "8"), 120, mps=True),
    Step("backends", "CuPy against torch per bundled task",
         # 8 runs of 3 s, each after a setup of its own (a graph generated on the host per run).
         ("-m", "bench.gpu.backends", "--seconds", "3"), 90, needs=("torch", "cupy", "freeride")),
    # A trial of every task set is 14 runs of 18-48 s each on the H200 (it was killed inside the first):
    # one task set makes a trial 5 runs (none, instrumented, freeride, freeride-paper, naive), about
    # 2 min; two trials, then the budget stops it.
    Step("modes", "the bench's five modes on one real GPU stage, the LSTM task, two trials",
         ("-m", "bench.bench_modes", "--single-stage", "cuda:0", "--out", "{results}", "--task-sets", "training",
          "--min-trials", "2", "--budget-min", "3", "--standalone-s", "1",
          "--label", "GPU run (one task set, two trials, to fit one command)"),
         330),
    # 66 s on the H200 (2026-12-01), where it reported itself inconsistent.
    Step("demo", "freeride demo --quick on this GPU",
         ("-m", "freeride.cli", "demo", "--device", "cuda", "--quick", "--out", "{results}/demo"), 150),
)}

#: The GPU run, as commands: ``bash bench/gpu/run.sh --part N`` runs ``PARTS[N-1]``.
PARTS: tuple[tuple[str, ...], ...] = (
    ("deps", "bubbles", "demo", "tests"),
    ("deps", "adapters", "caps", "backends", "timing", "nccl"),
    ("deps", "modes"),
    ("deps", "park", "park-mps"),
    ("deps", "clock", "tasks"),
)
#: The parts each session of 15 device minutes runs (numbers as ``--part`` takes them), most wanted first.
SESSIONS: tuple[tuple[int, ...], ...] = ((1, 5), (2, 4), (3,))


def part_limit_s(part: Sequence[str]) -> int:
    return sum(STEPS[name].limit_s for name in part)


def plan_problems() -> list[str]:
    """What in :data:`PARTS` does not fit the machine's limits (empty: the plan holds)."""
    problems = []
    for i, part in enumerate(PARTS, 1):
        if part_limit_s(part) > PART_LIMIT_S:
            problems.append(f"part {i} may take {part_limit_s(part)} s, over {PART_LIMIT_S} s")
    for i, session in enumerate(SESSIONS, 1):
        total = sum(part_limit_s(PARTS[n - 1]) for n in session)
        room = LEASE_S - OVERHEAD_PER_COMMAND_S * len(session)
        if total > room:
            problems.append(f"session {i}'s parts may take {total} s together, over the {room} s a session "
                            "leaves them")
    scheduled = sorted(n for session in SESSIONS for n in session)
    if scheduled != list(range(1, len(PARTS) + 1)):
        problems.append(f"the sessions run parts {scheduled}, not each of 1 to {len(PARTS)} once")
    planned = {name for part in PARTS for name in part}
    problems += [f"step {name} is in no part" for name in STEPS if name not in planned]
    return problems


def plan_text() -> str:
    lines = [f"The GPU run in {len(PARTS)} commands, {len(SESSIONS)} sessions (limits: {COMMAND_LIMIT_S // 60} min "
             f"a command, {LEASE_S // 60} min of device time a session):"]
    for j, session in enumerate(SESSIONS, 1):
        total = sum(part_limit_s(PARTS[n - 1]) for n in session)
        lines.append(f" session {j} (at most {total / 60:.1f} min, and about {OVERHEAD_PER_COMMAND_S} s per "
                     "command for the machine's start and the transfers):")
        for i in session:
            part = PARTS[i - 1]
            lines.append(f"  {i}. bash bench/gpu/run.sh {' '.join(part)}   # at most {part_limit_s(part) / 60:.1f} min")
            lines += [f"       {name:<9} {STEPS[name].limit_s:>4} s  {STEPS[name].what}" for name in part]
    return "\n".join(lines)


def select(args: Sequence[str], part: int | None = None) -> list[Step]:
    """The steps to run, in order; ValueError naming an unknown step or part."""
    if part is not None:
        if not 1 <= part <= len(PARTS):
            raise ValueError(f"--part must be 1 to {len(PARTS)}, got {part}")
        args = [*PARTS[part - 1], *args]
    if list(args) == ["all"]:
        args = [name for p in PARTS for name in p]
    unknown = [a for a in args if a not in STEPS]
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}: the steps are {', '.join(STEPS)}")
    seen: list[str] = []
    for a in args:
        if a not in seen:
            seen.append(a)
    return [STEPS[a] for a in seen]


def missing_modules(step: Step, find: Callable[[str], object] = importlib.util.find_spec) -> list[str]:
    out = []
    for name in step.needs:
        try:
            found = find(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            out.append(name)
    return out


@dataclass
class StepResult:
    name: str
    status: str  # "ok", "exit N", "timed out after N s", "skipped: ...", "failed to start: ..."
    seconds: float


def _pump(stream: object, sinks: list[object]) -> None:
    for line in iter(stream.readline, b""):  # type: ignore[attr-defined]
        for sink in sinks:
            sink.write(line)  # type: ignore[attr-defined]
            sink.flush()  # type: ignore[attr-defined]


def run_command(argv: Sequence[str], log_path: Path, limit_s: float, env: dict[str, str]) -> str:
    """Run ``argv`` in its own session, its output to the terminal and ``log_path``; kill the whole session
    at ``limit_s``. Returns the status."""
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(list(argv), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            return f"failed to start: {exc}"
        pump = threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout.buffer, log]), daemon=True)
        pump.start()
        try:
            rc = proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            _kill_session(proc, grace_s=10)
            pump.join(5)
            return f"timed out after {limit_s:.0f} s"
        pump.join(5)
        _kill_session(proc, grace_s=0)  # what it left running (a manager, a worker) goes with it
    return "ok" if rc == 0 else f"exit {rc}"


def _kill_session(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if grace_s == 0 and sig == signal.SIGTERM:
            continue
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass


def pack(results: Path, out: Path | None) -> Path | None:
    """``$OUT/gpu-results.tgz``: the results directory as it stands (replaced after every step)."""
    if out is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    partial = out / (ARCHIVE + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(results, arcname=results.name)
    partial.replace(out / ARCHIVE)
    return out / ARCHIVE


def write_status(results: Path, done: list[StepResult], out: Path | None) -> None:
    lines = [f"{r.name}: {r.status} ({r.seconds:.0f} s)" for r in done]
    (results / "steps.txt").write_text("\n".join(lines) + "\n")
    (results / "steps.json").write_text(json.dumps([r.__dict__ for r in done], indent=2) + "\n")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(results / "steps.txt", out / "steps.txt")
    pack(results, out)


def run_steps(steps: Sequence[Step], results: Path, out: Path | None, env: dict[str, str],
              python: str = sys.executable,
              mps_daemon: Callable[[Path], object] | None = None) -> list[StepResult]:
    """Run each step in turn; after each, its status is written and everything is packed."""
    done: list[StepResult] = []
    for step in steps:
        if step is DEPS:
            continue
        started = time.monotonic()
        lacking = missing_modules(step)
        if lacking:
            status = f"skipped: {', '.join(lacking)} cannot be imported here"
            print(f"== {step.name}: {status}", flush=True)
        else:
            argv = [python, *(a.replace("{results}", str(results)) for a in step.argv)]
            print(f"== {step.name} (at most {step.limit_s} s): {' '.join(argv[1:])}", flush=True)
            step_env = {**env, **step.env}
            if step.mps:
                status = _under_mps(step, argv, results, step_env, mps_daemon)
            else:
                status = run_command(argv, results / f"{step.name}.log", step.limit_s, step_env)
        done.append(StepResult(step.name, status, time.monotonic() - started))
        print(f"== {step.name}: {status} after {done[-1].seconds:.0f} s", flush=True)
        write_status(results, done, out)
    return done


def _under_mps(step: Step, argv: list[str], results: Path, env: dict[str, str],
               mps_daemon: Callable[[Path], object] | None) -> str:
    from bench.gpu.mps_daemon import MpsDaemon

    pipes = Path(f"/tmp/freeride-mps-{os.getpid()}")
    daemon = (mps_daemon or MpsDaemon)(pipes)
    reason = daemon.start()  # type: ignore[attr-defined]
    if reason:
        (results / f"{step.name}.log").write_text(f"no MPS here: {reason}\n")
        return f"skipped: no MPS here ({reason})"
    try:
        return run_command(argv, results / f"{step.name}.log", step.limit_s, {**env, **daemon.env()})  # type: ignore[attr-defined]
    finally:
        daemon.stop()  # type: ignore[attr-defined]


def results_dir(env: dict[str, str]) -> Path:
    """``bench/results/gpu-<model>/`` (``$FREERIDE_GPU_RESULTS`` overrides), created."""
    if env.get("FREERIDE_GPU_RESULTS"):
        path = Path(env["FREERIDE_GPU_RESULTS"])
    else:
        sys.path.insert(0, str(REPO))
        from bench.machine import gpu_info, gpu_slug

        path = REPO / "bench" / "results" / f"gpu-{gpu_slug(gpu_info())}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def gpu_usable(python: str, env: dict[str, str]) -> str:
    """Empty when torch sees a CUDA device here, else why not."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return ""
    return "torch.cuda.is_available() is false" if done.returncode == 3 else (done.stderr.strip().splitlines()
                                                                              or ["torch cannot be imported"])[-1]


def main(argv: list[str] | None = None, *, check_gpu: bool = True) -> int:
    ap = argparse.ArgumentParser(prog="bash bench/gpu/run.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="*", help=f"steps, in order ({', '.join(STEPS)}), or all")
    ap.add_argument("--part", type=int, help=f"the plan's command N (1 to {len(PARTS)})")
    ap.add_argument("--plan", action="store_true", help="print the plan and exit")
    ns = ap.parse_args(argv)
    if ns.plan or (not ns.steps and ns.part is None):
        print(plan_text())
        return 0
    try:
        steps = select(ns.steps, ns.part)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    from bench.gpu import ensure_deps

    try:
        missing, wheels = ensure_deps.ensure()
    except LookupError as exc:
        print(f"missing here, with no carried wheel for: {exc} (bench/gpu/fetch_wheels.sh, then carry .whl/); the "
              "steps that need them are skipped", file=sys.stderr)
    except subprocess.CalledProcessError as exc:
        print(f"installing the carried wheels failed ({exc}); the steps that need them are skipped", file=sys.stderr)
    else:
        if wheels:
            print(f"installed from .whl/: {', '.join(w.name for w in wheels)}", flush=True)
            env["PYTHONPATH"] = os.pathsep.join((str(ensure_deps.TARGET), env["PYTHONPATH"]))
            sys.path.insert(0, str(ensure_deps.TARGET))
            importlib.invalidate_caches()
    if check_gpu and (why := gpu_usable(sys.executable, env)):
        print(f"no usable NVIDIA GPU here ({why}): nothing to measure", file=sys.stderr)
        return 2
    results = results_dir(env)
    env["FREERIDE_GPU_RESULTS"] = str(results)
    out = Path(env["OUT"]) if env.get("OUT") else None
    _write_machine(results, env)
    print(f"results in {results}" + (f", packed into {out / ARCHIVE} after every step" if out else ""), flush=True)
    done = run_steps(steps, results, out, env)
    print("steps: " + "; ".join(f"{r.name} {r.status}" for r in done), flush=True)
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in done) else 1


def _write_machine(results: Path, env: dict[str, str]) -> None:
    code = "import json; from bench.machine import machine_info; print(json.dumps(machine_info(), indent=2))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          check=False)
    (results / "machine.json").write_text(done.stdout if done.returncode == 0 else json.dumps({"error": done.stderr}))


if __name__ == "__main__":
    raise SystemExit(main())
