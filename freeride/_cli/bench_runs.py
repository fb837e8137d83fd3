"""``freeride bench``'s processes: one run of the user's command in one mode, and the yardstick.

**Where the job finds the managers.** Every run (each mode alike) gets the same environment: this
process's, with ``$XDG_RUNTIME_DIR`` pointing at a private directory and ``$FREERIDE_ENDPOINT``
removed. A trainer that reports to its device's default endpoint (the reference trainer, or a
``BubbleReporter`` given no endpoint) therefore reaches the bench's managers, never a manager the user
already runs, and ``alone`` runs find no manager at all. A job that names its endpoints itself
bypasses them; the bench then sees no bubble and says so.

**One run** (:meth:`Runner.run`): for ``managers`` and ``tasks``, fresh managers (``freeride launch``'s
:func:`~freeride._cli.launch.start_managers`, with a state directory per run, so every run starts
from nothing), the side tasks submitted to every device and resident (worker up, ``setup`` done)
before the command starts; then the command, timed by its wall clock, in its own process group with
its output in the run's log (:func:`~freeride._cli.launch.supervise`); then the managers' figures,
once their statistics stop moving (the last events reach them shortly after the command exits); then
the managers are stopped. A command that exits non-zero, or outlives its time, ends the bench with the
tail of its log (under torchrun, with the job's own last words above torchrun's summary); so does a
side task that fails (with its failure record). Ctrl-C is forwarded to the command, which is given
``kill_after_s`` to stop before its group is stopped, and then ends the bench.

**The yardstick** (:meth:`Runner.standalone_rates`): each task alone on the job's first device, in a
child process pinned and threaded like a worker (``freeride._demo.probe``, the demo's and the research
bench's measurement), while nothing else of the bench runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from freeride._cli.bench_figures import ALONE, TASKS, DeviceFigures, Run, TaskFigures
from freeride._cli.launch import ManagedManager, start_managers, stop_managers, supervise, wait_ready
from freeride._cli.tasks import render_failure
from freeride._wire.client import ControlClient
from freeride.endpoints import ENDPOINT_ENV
from freeride.errors import FreerideError
from freeride.messages import ManagerStats, TaskInfo, TaskSpec
from freeride.standalone import BUSY_CORE_SHARE

log = logging.getLogger(__name__)

#: Unix socket paths longer than this risk the kernel's limit (108 bytes with the terminator).
_MAX_SOCKET_PATH = 100
_RESIDENT = ("PARKED", "RUNNING", "FROZEN")
_ENDED = ("FAILED", "CANCELLED", "FINISHED")


class BenchFailed(FreerideError):
    """The bench cannot go on: the command failed or hung, a side task failed, nothing was reported."""


@dataclass(frozen=True)
class BenchTask:
    """A side task of the bench: its name (the key of its figures) and its submission."""

    name: str
    spec: TaskSpec


def private_runtime() -> Path:
    """A fresh owner-only directory for ``$XDG_RUNTIME_DIR``, short enough for socket paths."""
    for parent in (Path(tempfile.gettempdir()), Path("/tmp")):
        path = Path(tempfile.mkdtemp(prefix="frb-", dir=parent))
        if len(str(path / "freeride" / "cuda-99.sock")) <= _MAX_SOCKET_PATH:
            path.chmod(0o700)
            return path
        path.rmdir()
    raise BenchFailed("no directory short enough for unix socket paths (set TMPDIR to a short path)")


def job_env(base: Mapping[str, str], runtime: Path) -> dict[str, str]:
    """The environment of every run: ``base`` with the private runtime directory, no explicit endpoint."""
    env = {k: v for k, v in base.items() if k != ENDPOINT_ENV}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    return env


#: A line of torch's own logging (``W1130 11:32:23.008000 776 torch/...``): torchrun's, not the job's.
_TORCH_LOG_LINE = re.compile(r"[WEIF]\d{4} \d\d:\d\d:\d\d")
#: Where torchrun begins its summary of a failed job (``... failed (exitcode: 1) local_rank: 0 ...``).
_TORCHRUN_FAILED = "failed (exitcode:"


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a command's log, indented; and where torchrun's summary of a failed job (~40
    lines of its own) fills them, the job's last words before it too: a stranger's trainer said "unknown schedule
    bogus" and the bench showed only torchrun's summary."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    tail = text[-lines:]
    start = len(text) - len(tail)
    failed = next((i for i, line in enumerate(text) if _TORCHRUN_FAILED in line), None)
    if failed is not None and failed < start:
        said = [line for line in text[:failed] if not _TORCH_LOG_LINE.match(line)][-10:]
        if said:
            return "\n".join(["    " + line for line in said] + ["    ..."] + ["    " + line for line in tail])
    return "\n".join("    " + line for line in tail)


@dataclass
class Runner:
    """Runs the command in each mode (see the module docstring); one per bench."""

    command: tuple[str, ...]
    devices: tuple[str, ...]
    env: dict[str, str]
    work_dir: Path
    tasks: tuple[BenchTask, ...] = ()
    manager_args: tuple[str, ...] = ()
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    kill_after_s: float = 10.0
    settle_s: float = 0.2

    def run(self, trial: int, mode: str, timeout_s: float | None) -> Run:
        """The command once in ``mode``; ``trial`` -1 is a warm-up run (always ``alone``)."""
        run_dir = self.work_dir / (f"t{trial}-{mode}" if trial >= 0 else "warmup")
        run_dir.mkdir(parents=True, exist_ok=True)
        loadavg = os.getloadavg()[0]
        if mode == ALONE:
            return Run(trial, mode, self._job(run_dir, trial, mode, timeout_s), (), loadavg)
        managers: list[ManagedManager] = []
        try:
            managers = start_managers(self.devices, run_dir / "state", run_dir, self.manager_args, env=self.env)
            wait_ready(managers, self.ready_timeout_s)
            ids: dict[str, dict[str, str]] = {}  # device -> task id -> name
            if mode == TASKS:
                ids = self._submit(managers, run_dir)
            wall_s = self._job(run_dir, trial, mode, timeout_s)
            figures = tuple(self._figures(m, ids.get(m.device, {}), trial, run_dir) for m in managers)
        finally:
            stop_managers(managers, self.stop_timeout_s)
        return Run(trial, mode, wall_s, figures, loadavg)

    def _job(self, run_dir: Path, trial: int, mode: str, timeout_s: float | None) -> float:
        path = run_dir / "command.log"
        with path.open("wb") as output:
            started = time.monotonic()
            outcome = supervise(self.command, env=self.env, output=output, timeout_s=timeout_s,
                                stop_after_signal_s=self.kill_after_s, kill_after_s=self.kill_after_s,
                                die_with_parent=True, kill_group_at_exit=True)
            wall_s = time.monotonic() - started
        if outcome.signals:
            raise KeyboardInterrupt  # the user's Ctrl-C (or a SIGTERM), forwarded to the command first
        what = "the warm-up run" if trial < 0 else f"trial {trial}, {mode}"
        if outcome.timed_out:
            raise BenchFailed(f"the command did not finish within {timeout_s:.0f} s ({what}) and was stopped "
                              f"(raise --run-timeout-s if it needs longer); its output ({path}) ends with:\n"
                              f"{log_tail(path)}")
        if outcome.code != 0:
            raise BenchFailed(f"the command exited with code {outcome.code} ({what}); its output ({path}) ends "
                              f"with:\n{log_tail(path)}")
        return wall_s

    def _submit(self, managers: Sequence[ManagedManager], run_dir: Path) -> dict[str, dict[str, str]]:
        """Every task on every device, then wait until each is resident (its ``setup`` done)."""
        ids: dict[str, dict[str, str]] = {}
        for m in managers:
            with ControlClient(m.endpoint) as client:
                for task in self.tasks:
                    ids.setdefault(m.device, {})[client.submit(task.spec).task_id] = task.name
        deadline = time.monotonic() + self.ready_timeout_s
        for m in managers:
            with ControlClient(m.endpoint) as client:
                while True:
                    infos = [client.get(task_id) for task_id in ids.get(m.device, {})]
                    failed = next((i for i in infos if i.state in _ENDED), None)
                    if failed is not None:
                        raise BenchFailed(self._task_failure(failed.task_id, ids[m.device][failed.task_id], m.device,
                                                             failed, "before the command started"))
                    if all(i.state in _RESIDENT for i in infos):
                        break
                    if time.monotonic() > deadline:
                        waiting = "; ".join(f"{ids[m.device][i.task_id]}: {i.state}"
                                            + (f" ({i.waiting_reason})" if i.waiting_reason else "") for i in infos)
                        raise BenchFailed(f"the side tasks on {m.device} were not ready after "
                                          f"{self.ready_timeout_s:g} s (--ready-timeout-s): {waiting}; manager log "
                                          f"{m.log_path}")
                    time.sleep(0.05)
        return ids

    @staticmethod
    def _task_failure(task_id: str, name: str, device: str, info: TaskInfo, when: str) -> str:
        head = f"side task {name} ({task_id}) on {device} is {info.state} {when}"
        return head + (":\n" + render_failure(info.failure) if info.failure is not None else "")

    def _settled_stats(self, client: ControlClient) -> ManagerStats:
        """The manager's statistics once they stop moving (or after 5 s): the trainer's last events and
        the workers' last parks reach the manager shortly after the command exits."""
        deadline = time.monotonic() + 5.0
        last: tuple[int, int, float] | None = None
        since = time.monotonic()
        while True:
            stats = client.stats()
            key = (stats.events_received, stats.bubbles, stats.harvested_s)
            now = time.monotonic()
            if key != last:
                last, since = key, now
            elif now - since >= self.settle_s or now > deadline:
                return stats
            time.sleep(0.05)

    def _figures(self, m: ManagedManager, ids: Mapping[str, str], trial: int, run_dir: Path) -> DeviceFigures:
        with ControlClient(m.endpoint) as client:
            stats = self._settled_stats(client)
            tasks = []
            for task_id, name in ids.items():
                info = client.get(task_id)
                if info.state in ("FAILED", "CANCELLED"):
                    raise BenchFailed(self._task_failure(task_id, name, m.device, info, f"in trial {trial}"))
                tasks.append(TaskFigures(name, m.device, info.state, info.steps, info.progress, info.progress_unit,
                                         info.harvested_s))
        overrun, grant, park = (d.p99 if d.count else None
                                for d in (stats.overrun_ms, stats.grant_latency_ms, stats.park_latency_ms))
        return DeviceFigures(m.device, stats.bubbles, stats.bubble_time_s, stats.granted_s, stats.harvested_s,
                             stats.overruns, overrun, grant, park, tuple(tasks))

    def standalone_rates(self, trial: int, seconds: float) -> dict[str, float]:
        """Each task's progress per second alone on the first device (the same for each of the job's
        devices: they are taken to be alike)."""
        run_dir = self.work_dir / f"t{trial}-standalone"
        run_dir.mkdir(parents=True, exist_ok=True)
        device = self.devices[0]
        request, result = run_dir / "request.json", run_dir / "standalone.json"
        request.write_text(json.dumps({"device": device, "seconds": seconds, "tasks": [
            {"name": t.name, "target": t.spec.target, "args": t.spec.args, "memory_bytes": t.spec.memory_bytes}
            for t in self.tasks]}))
        path = run_dir / "standalone.log"
        limit_s = self.ready_timeout_s + 4 * seconds * len(self.tasks)
        with path.open("wb") as output:
            try:
                subprocess.run([sys.executable, "-m", "freeride._demo.probe", str(request), str(result)], env=self.env,
                               cwd=self.tasks[0].spec.working_dir or None, stdin=subprocess.DEVNULL, stdout=output,
                               stderr=subprocess.STDOUT, timeout=limit_s, check=False,
                               start_new_session=True)  # its autogroup at nice 19, like a worker's, not ours
            except subprocess.TimeoutExpired:
                raise BenchFailed(f"measuring the side tasks alone took over {limit_s:.0f} s; its log ({path}) ends "
                                  f"with:\n{log_tail(path)}") from None
        entries = json.loads(result.read_text()) if result.exists() else []
        rates: dict[str, float] = {}
        for entry in entries:
            if "error" in entry:
                raise BenchFailed(f"side task {entry['name']} failed alone on {device}: {entry['error']}")
            rate = float(entry["report"]["progress_per_s"])
            if rate <= 0:
                raise BenchFailed(f"side task {entry['name']} made no progress in {seconds:g} s alone on {device} "
                                  "(a step longer than that?): raise --standalone-s")
            rates[entry["name"]] = rate
            busy = entry["report"].get("core_busy_share")
            if busy is not None and busy > BUSY_CORE_SHARE:
                log.warning("other processes took %.0f%% of %s while side task %s was measured alone: its rate, "
                            "the yardstick of the side work, reads low, and the work and H of this trial read high "
                            "(bench on idle cores)", 100 * busy, device, entry["name"])
        missing = [t.name for t in self.tasks if t.name not in rates]
        if missing:
            raise BenchFailed(f"measuring {', '.join(missing)} alone on {device} failed; its log ({path}) ends "
                              f"with:\n{log_tail(path)}")
        return rates
