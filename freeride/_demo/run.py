"""The demo's orchestration: start real processes in order, stop them all, then compute and draw.

Steps (each announced on the progress stream):

1. **Baseline**: the reference trainer under torchrun, 2 stages, 1F1B, without reporting and
   without side tasks; its iteration logs give ``T_base``.
2. **Standalone**: each side task alone on its device for a few seconds (one probe process per
   device, one device after the other): the throughput that harvest efficiency divides by.
3. **Managers**: one ``freeride manager`` per device on the demo's own unix sockets (a private
   directory in the per-user runtime directory, so that a manager already serving the default
   endpoint is never touched and socket paths stay short), each with ``--trace``; the side tasks
   are submitted and training starts once every worker has started (imports done outside bubbles).
4. **Training with side tasks**: the same trainer with ``--report`` and ``--endpoint-template``
   pointing at the demo's managers; a progress line every couple of seconds (iteration, tasks'
   progress). When it ends, each manager's statistics and task list are read.
5. **Stop**: SIGTERM to the managers (they park and checkpoint every task, flush their traces
   and exit), then the summary, ``summary.json``, ``timeline.png`` and ``trace.json``.

Every exit path -- success, a failing step, SIGINT or SIGTERM -- goes through the same cleanup
(:class:`freeride._demo.processes.Children`): no manager, worker or trainer rank outlives the demo.

Output layout under ``out_dir``: ``summary.json``, ``timeline.png``, ``trace.json``,
``standalone.json``, ``baseline/`` and ``run/`` (each rank's iteration log and the trainer's
output), and per device ``state-<dev>/`` (the manager's state), ``trace-<dev>.jsonl`` and
``manager-<dev>.log``. Only these names are removed when a previous demo left them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from freeride._demo.perfetto import chrome_trace, write_chrome_trace
from freeride._demo.plan import DemoConfig, TaskPlan, demo_devices, plan_tasks
from freeride._demo.processes import Child, Children, Signals, become_subreaper
from freeride._demo.summary import DemoError, DemoSummary, Iteration, read_iteration_log, summarize
from freeride._demo.timeline import draw_timeline
from freeride._demo.traces import Grant, Instant, grants_from_trace, instants_from_trace
from freeride._manager.trace import read_trace
from freeride.devices import parse_device_name
from freeride.endpoints import Endpoint, runtime_dir
from freeride.errors import FreerideError
from freeride.messages import ManagerStats, TaskInfo, TaskSpec
from freeride.states import TaskState
from freeride.workload.single_stage import single_stage_command

log = logging.getLogger(__name__)

STAGES = 2
DEMO_MICROBATCHES = 4
#: Unix socket paths longer than this risk the kernel's limit (108 bytes with the terminator).
_MAX_SOCKET_PATH = 100


@dataclass(frozen=True)
class Layout:
    """Where the demo's files go (see the module docstring)."""

    out: Path

    @property
    def summary(self) -> Path:
        return self.out / "summary.json"

    @property
    def timeline(self) -> Path:
        return self.out / "timeline.png"

    @property
    def trace(self) -> Path:
        return self.out / "trace.json"

    @property
    def standalone(self) -> Path:
        return self.out / "standalone.json"

    @property
    def baseline(self) -> Path:
        return self.out / "baseline"

    @property
    def run(self) -> Path:
        return self.out / "run"

    def state_dir(self, device: str) -> Path:
        return self.out / f"state-{parse_device_name(device).slug}"

    def manager_trace(self, device: str) -> Path:
        return self.out / f"trace-{parse_device_name(device).slug}.jsonl"

    def manager_log(self, device: str) -> Path:
        return self.out / f"manager-{parse_device_name(device).slug}.log"

    def prepare(self, devices: Sequence[str]) -> None:
        """Create the directory and remove what an earlier demo left under the demo's own names."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            for path in (self.summary, self.timeline, self.trace, self.standalone):
                path.unlink(missing_ok=True)
            for directory in (self.baseline, self.run, *(self.state_dir(d) for d in devices)):
                shutil.rmtree(directory, ignore_errors=True)
            for device in devices:
                self.manager_trace(device).unlink(missing_ok=True)
                self.manager_log(device).unlink(missing_ok=True)
            probe = self.out / ".writable"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise DemoError(f"cannot use {self.out} for the demo's output: {exc.strerror or exc}") from None


def _socket_dir() -> Path:
    """A fresh private directory for the managers' sockets, with short enough paths."""
    for parent in (runtime_dir(), Path(tempfile.gettempdir())):
        path = Path(tempfile.mkdtemp(prefix="demo-", dir=parent))
        if len(str(path / "cuda-99.sock")) <= _MAX_SOCKET_PATH:
            return path
        path.rmdir()
    raise DemoError("no directory short enough for unix socket paths (set TMPDIR to a short path)")


def _child_env(device_kind: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("FREERIDE_LOG_LEVEL", "WARNING")
    if device_kind == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def trainer_argv(config: DemoConfig, log_path: Path, endpoint_template: str | None,
                 devices: Sequence[str] = ()) -> list[str]:
    """The command line of one training run (reporting when an endpoint template is given): torchrun
    over the stages, or on one GPU the single-stage trainer of stage 0 with its neighbour emulated."""
    if config.single_stage:
        device = devices[0] if devices else "cuda:0"
        endpoint = endpoint_template.format(slug=parse_device_name(device).slug) if endpoint_template else None
        return single_stage_command(
            device, 0, STAGES, DEMO_MICROBATCHES, config.iterations, log=_rank_log(log_path, 0),
            report=endpoint is not None, endpoint=endpoint,
            extra=["--schedule", "1f1b", "--warmup", str(config.warmup_iterations), *config.trainer_args],
        )
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(STAGES),
        "-m", "freeride.workload", "--stages", str(STAGES), "--schedule", "1f1b",
        "--microbatches", str(DEMO_MICROBATCHES),
        "--iterations", str(config.iterations), "--warmup", str(config.warmup_iterations),
        "--device", config.device_kind, "--iteration-log", str(log_path), *config.trainer_args,
    ]  # fmt: skip
    if endpoint_template is not None:
        argv += ["--report", "--endpoint-template", endpoint_template]
    return argv


def manager_argv(device: str, endpoint: Endpoint, layout: Layout) -> list[str]:
    return [sys.executable, "-m", "freeride.cli", "manager", "--device", device, "--endpoint", str(endpoint),
            "--state-dir", str(layout.state_dir(device)), "--trace", str(layout.manager_trace(device))]  # fmt: skip


def _rank_log(template: Path, rank: int) -> Path:
    return template.with_name(f"{template.stem}.rank{rank}{template.suffix}")


def _count_iterations(path: Path) -> int:
    try:
        with path.open() as fh:
            return sum(1 for line in fh if line.startswith("{") and '"summary"' not in line)
    except OSError:
        return 0


def _format_progress(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.2f} {unit}"


class Demo:
    """One run of the demo (use :func:`run_demo`)."""

    def __init__(self, config: DemoConfig, progress: TextIO) -> None:
        self.config = config
        self.progress = progress
        self.devices = demo_devices(config.device_kind)
        self.plans = plan_tasks(config.device_kind, len(self.devices))
        self.ranks = (0,) if config.single_stage else tuple(range(STAGES))
        self.layout = Layout(config.out_dir.resolve())
        self.signals = Signals()
        self.children = Children(self.signals)
        self.endpoints: dict[str, Endpoint] = {}
        self.managers: dict[str, Child] = {}
        self.task_ids: dict[str, str] = {}  # task id -> plan name
        self.task_device: dict[str, str] = {}  # task id -> device
        self.started_s = time.monotonic()

    # ------------------------------------------------------------------ helpers

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.started_s
        print(f"[{elapsed:5.0f} s] {text}", file=self.progress, flush=True)

    def device_of(self, plan: TaskPlan) -> str:
        return self.devices[plan.device_index]

    def _client(self, device: str) -> Any:
        from freeride._wire.client import ControlClient

        return ControlClient(self.endpoints[device], timeout_s=5.0)

    # ------------------------------------------------------------------ steps

    def train(self, label: str, directory: Path, endpoint_template: str | None,
              on_tick: Callable[[int], None]) -> dict[int, list[Iteration]]:  # fmt: skip
        """One torchrun training run; its iteration logs per stage."""
        log_path = directory / "iterations.jsonl"
        child = self.children.start(label, trainer_argv(self.config, log_path, endpoint_template, self.devices),
                                    directory / "trainer.log", env=_child_env(self.config.device_kind))
        last_rank = _rank_log(log_path, self.ranks[-1])
        code = self.children.wait(child, on_tick=lambda: on_tick(_count_iterations(last_rank)),
                                  tick_s=self.config.progress_interval_s)
        if code != 0:
            raise DemoError(f"the {label} exited with code {code}; {child.log_path} ends with:\n{child.log_tail()}")
        return {rank: read_iteration_log(_rank_log(log_path, rank)) for rank in self.ranks}

    def measure_standalone(self) -> dict[str, float | None]:
        """Each task's standalone throughput on its device, one device after the other (tasks in turn).

        One device at a time, as the bench does: probes running at once on two cores of one machine share
        its memory bus and caches, which slows the yardstick and inflates the efficiency.
        """
        scratch = self.layout.out / "standalone"
        shutil.rmtree(scratch, ignore_errors=True)
        rates: dict[str, float | None] = {}
        reports: list[dict[str, Any]] = []
        for device in self.devices:
            plans = [p for p in self.plans if self.device_of(p) == device]
            if not plans:
                continue
            slug = parse_device_name(device).slug
            request = scratch / f"{slug}.request.json"
            result = scratch / f"{slug}.json"
            request.parent.mkdir(parents=True, exist_ok=True)
            request.write_text(json.dumps({
                "device": device, "seconds": self.config.standalone_s,
                "tasks": [{"name": p.name, "target": p.target, "args": p.args, "memory_bytes": p.memory_bytes}
                          for p in plans],
            }))  # fmt: skip
            argv = [sys.executable, "-m", "freeride._demo.probe", str(request), str(result)]
            child = self.children.start(f"standalone probe on {device}", argv, scratch / f"{slug}.log",
                                        env=_child_env(self.config.device_kind))
            code = self.children.wait(child, timeout_s=120.0 + 2 * len(plans) * self.config.standalone_s)
            try:
                entries = json.loads(result.read_text())
            except (OSError, json.JSONDecodeError):
                raise DemoError(f"the {child.name} exited with code {code} and no result; {child.log_path} "
                                f"ends with:\n{child.log_tail()}") from None
            for entry in entries:
                if "error" in entry:
                    raise DemoError(f"{entry['name']} failed when run alone: {entry['error']}")
                report = entry["report"]
                rates[entry["name"]] = float(report["progress_per_s"]) or None
                reports.append({"name": entry["name"], **report})
                self.say(f"  {entry['name']:<10} on {report['device']}: {report['progress_per_s']:,.1f} "
                         f"{report['progress_unit']}/s, step p50 {report['step_ms_p50']:.2f} ms, "
                         f"p90 {report['step_ms_p90']:.2f} ms")
        self.layout.standalone.write_text(json.dumps(reports, indent=2, default=str))
        return rates

    def start_managers(self, socket_dir: Path) -> None:
        from freeride._wire.client import health_status

        env = _child_env(self.config.device_kind)
        for device in self.devices:
            endpoint = Endpoint("unix", str(socket_dir / f"{parse_device_name(device).slug}.sock"))
            self.endpoints[device] = endpoint
            self.managers[device] = self.children.start(
                f"manager for {device}", manager_argv(device, endpoint, self.layout), self.layout.manager_log(device),
                env=env,
            )
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = list(self.devices)
        while pending:
            for device in list(pending):
                child = self.managers[device]
                if not child.running():
                    raise DemoError(f"the manager for {device} exited with code {child.proc.returncode} before "
                                    f"serving; {child.log_path} ends with:\n{child.log_tail()}")
                try:
                    if health_status(self.endpoints[device], timeout_s=1.0) == "SERVING":
                        pending.remove(device)
                except FreerideError:
                    pass
            if pending and time.monotonic() > deadline:
                raise DemoError(f"the manager(s) for {', '.join(pending)} did not serve within "
                                f"{self.config.ready_timeout_s:g} s; see {self.managers[pending[0]].log_path}")
            if pending:
                self.signals.sleep(0.1)

    def submit_tasks(self) -> None:
        for plan in self.plans:
            device = self.device_of(plan)
            spec = TaskSpec(target=plan.target, args=dict(plan.args), memory_bytes=plan.memory_bytes, name=plan.name,
                            working_dir=str(self.layout.out))
            with self._client(device) as client:
                info = client.submit(spec)
            self.task_ids[info.task_id] = plan.name
            self.task_device[info.task_id] = device
            self.say(f"  submitted {plan.name} ({info.task_id}) to {device}: {plan.target} "
                     f"{json.dumps(plan.args, sort_keys=True)}, cap {plan.memory_bytes // 2**20} MiB")

    def list_tasks(self) -> dict[str, list[TaskInfo]]:
        tasks: dict[str, list[TaskInfo]] = {}
        for device in self.devices:
            with self._client(device) as client:
                tasks[device] = [t for t in client.list(include_finished=True) if t.task_id in self.task_ids]
        return tasks

    def wait_workers_started(self) -> None:
        """Until every task's worker process is up (PARKED): its imports then cost no bubble time."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            tasks = [t for ts in self.list_tasks().values() for t in ts]
            failed = [t for t in tasks if t.state == TaskState.FAILED.value]
            if failed:
                t = failed[0]
                why = f"{t.failure.kind}: {t.failure.message}\n{t.failure.log_tail}" if t.failure else "no record"
                raise DemoError(f"side task {t.spec.display_name} ({t.task_id}) failed to start: {why}")
            waiting = [t for t in tasks if t.state in (TaskState.SUBMITTED.value, TaskState.STARTING.value)]
            if not waiting and len(tasks) == len(self.plans):
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{t.spec.display_name} {t.state} ({t.waiting_reason or '-'})" for t in waiting)
                raise DemoError(f"side tasks not started within {self.config.ready_timeout_s:g} s: {names}")
            self.signals.sleep(0.2)

    def iteration_text(self, iteration: int) -> str:
        if iteration:
            return f"iteration {iteration}/{self.config.iterations}"
        # A status, repeated at every tick until the first iteration: not an action being repeated.
        trainer = "the single-stage trainer" if self.config.single_stage else "torchrun, 2 ranks"
        return f"waiting for the first iteration ({trainer})"

    def progress_line(self, iteration: int) -> None:
        parts = [self.iteration_text(iteration)]
        try:
            for device, tasks in self.list_tasks().items():
                done = ", ".join(f"{t.spec.display_name} {_format_progress(t.progress, t.progress_unit)}"
                                 + ("" if t.state in ("PARKED", "RUNNING", "FROZEN") else f" [{t.state}]")
                                 for t in tasks)  # fmt: skip
                parts.append(f"{device}: {done or '-'}")
        except FreerideError as exc:
            parts.append(f"(managers: {exc})")
        self.say("  " + " | ".join(parts))

    def collect(self) -> tuple[dict[str, ManagerStats], dict[str, list[TaskInfo]]]:
        stats: dict[str, ManagerStats] = {}
        for device in self.devices:
            try:
                with self._client(device) as client:
                    stats[device] = client.stats()
            except FreerideError as exc:
                child = self.managers[device]
                raise DemoError(f"the manager for {device} did not answer after training ({exc}); "
                                f"{child.log_path} ends with:\n{child.log_tail()}") from None
        return stats, self.list_tasks()

    def stop_managers(self) -> None:
        managers = list(self.managers.values())
        self.children.stop(managers, self.config.stop_timeout_s)
        for device, child in self.managers.items():
            if child.proc.returncode != 0:
                log.warning("the manager for %s exited with code %s (log %s)", device, child.proc.returncode,
                            child.log_path)

    # ------------------------------------------------------------------ the whole run

    def run(self) -> DemoSummary:
        config = self.config
        self.layout.prepare(self.devices)
        become_subreaper()
        socket_dir = _socket_dir()
        tasks_by_device = ", ".join(
            f"{d}: {', '.join(p.name for p in self.plans if self.device_of(p) == d)}" for d in self.devices
        )
        with self.signals:
            try:
                self.say(f"freeride demo on {', '.join(self.devices)}; output in {self.layout.out}")
                what = ("stage 0 of a 2-stage 1F1B GPT (its neighbour emulated)" if config.single_stage
                        else "a 2-stage 1F1B GPT")
                self.say(f"1/5 baseline: {config.iterations} iterations of {what}, no side tasks")
                baseline = self.train("baseline trainer", self.layout.baseline, None,
                                      lambda i: self.say(f"  {self.iteration_text(i)}"))
                self.say(f"2/5 standalone: each side task alone on its device for {config.standalone_s:g} s")
                rates = self.measure_standalone()
                self.say(f"3/5 managers on {', '.join(self.devices)}; side tasks ({tasks_by_device})")
                self.start_managers(socket_dir)
                self.submit_tasks()
                self.wait_workers_started()
                self.say(f"4/5 training {config.iterations} iterations with bubble reporting and side tasks")
                template = f"unix:{socket_dir}/{{slug}}.sock"
                run = self.train("trainer with side tasks", self.layout.run, template, self.progress_line)
                self.progress_line(config.iterations)
                stats, tasks = self.collect()
                self.say("5/5 stopping the managers (each parks and checkpoints its tasks)")
                self.stop_managers()
            finally:
                self.children.stop_all(config.stop_timeout_s)
                self.children.sweep()
                shutil.rmtree(socket_dir, ignore_errors=True)
        traces = self.read_traces()
        summary = summarize(
            device_kind=config.device_kind, devices=self.devices, iterations=config.iterations,
            warmup_iterations=config.warmup_iterations, baseline=baseline, run=run, manager_stats=stats,
            tasks=tasks, standalone_per_s=rates, traces=traces,
        )  # fmt: skip
        files, notes = self.write_pictures(run, traces)
        processes = {c.name: c.pid for c in self.children.started}
        processes.update({f"worker {self.task_ids[t.task_id]}": t.pid for ts in tasks.values() for t in ts if t.pid})
        files = {"summary": str(self.layout.summary), **files}
        summary = replace(summary, wall_s=time.monotonic() - self.started_s, files=files, processes=processes,
                          notes=summary.notes + tuple(notes))  # fmt: skip
        self.layout.summary.write_text(summary_json(summary) + "\n")
        return summary

    def read_traces(self) -> dict[str, list[dict[str, Any]]]:
        """Each manager's trace (the managers have stopped and flushed them); a missing one is left out."""
        traces: dict[str, list[dict[str, Any]]] = {}
        for device in self.devices:
            try:
                traces[device] = read_trace(self.layout.manager_trace(device))
            except OSError:
                continue
        return traces

    def write_pictures(self, run: Mapping[int, Sequence[Iteration]],
                       traces: Mapping[str, list[dict[str, Any]]]) -> tuple[dict[str, str], list[str]]:
        """``timeline.png`` and ``trace.json`` from the iteration logs and the managers' traces.

        A manager that was killed leaves no (or a torn) trace: the pictures are drawn without its
        side-task steps, and a note says so (its device then has no harvest efficiency either).
        """
        grants: dict[str, list[Grant]] = {}
        instants: dict[str, list[Instant]] = {}
        notes = []
        for device in self.devices:
            records = traces.get(device)
            if records is None:
                notes.append(f"no trace from the manager of {device}: the pictures show no side-task steps there, "
                             "and its harvest efficiency is unknown")
                records = []
            grants[device] = grants_from_trace(records)
            instants[device] = instants_from_trace(records)
        names = dict(self.task_ids)
        window = draw_timeline(self.layout.timeline, run, grants, names)
        self.say(f"timeline of iterations {window.first}-{window.last} in {self.layout.timeline}")
        write_chrome_trace(self.layout.trace, chrome_trace(run, grants, names, instants))
        return {"timeline": str(self.layout.timeline), "trace": str(self.layout.trace)}, notes


def run_demo(config: DemoConfig, progress: TextIO = sys.stderr) -> DemoSummary:
    """Run the whole demo (see the module docstring); progress lines go to ``progress``.

    Raises:
        ConfigError: the machine cannot run this configuration (not two devices).
        DemoError: a step failed (the message says which and quotes the log).
        DemoInterrupted: SIGINT or SIGTERM arrived; every process was stopped first.
    """
    return Demo(config, progress).run()


def summary_json(summary: DemoSummary) -> str:
    return json.dumps(summary.to_json(), indent=2, sort_keys=True)


__all__ = ["Demo", "Layout", "run_demo", "summary_json", "trainer_argv"]
