"""Standalone mode: run one side task alone on a device and measure it.

``run_standalone`` is the yardstick of harvest efficiency (DESIGN section 6): the throughput a
task reaches with the device to itself, which the benchmark divides bubble-time progress by. It
also lets a user try a task before submitting it: does it import, does ``setup`` fit the memory
limit, how long is a step (the worker needs steps well under a bubble), how much memory does it
really take.

The run goes through the same contract the worker uses -- ``load_task_class``, construct with
the JSON arguments (:func:`freeride._loading.construct_task`, which words a bad argument as
``freeride submit`` does), ``setup(TaskContext)``, ``step()`` until ``done()`` -- in a process set up
as a worker's (``prepare_device``: :mod:`freeride._task_process`), but with no bubbles:
steps run back to back until the task is done or ``seconds`` have passed (the step in flight at
the deadline is finished, never cut). On CUDA each step is followed by a device synchronize so
that step times are device times, not launch times, exactly as in a worker.

Memory: on CUDA, the peak as the GPU counts it -- the CUDA context plus the most the allocator
(torch's, which CuPy allocates through) reserved, or NVML's figure for this process where larger --
so that a cap copied from the report holds in a worker, whose cap covers the same things. On CPU,
the growth of the process's resident set over its size once the task is constructed (what a
worker's cap covers too: the interpreter and the task's libraries are the worker's baseline),
sampled after setup, every :data:`SAMPLE_EVERY_S` of steps and after the last (a short-lived spike can be
missed, as a manager's poll can miss it; the run's own record of step times is left out). The reads are
left out of the run's elapsed time, so a task of 20 us steps is measured at its own rate. The
limit is enforced as a worker's is: a run whose peak goes over it fails as the task would fail
with MEMORY_LIMIT under the manager. There is no step timeout: a step that never returns holds
the run until it is interrupted (Ctrl-C), where a manager would fail the task with STEP_TIMEOUT.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from freeride import measure
from freeride._loading import (
    check_target_syntax,
    construct_task,
    estimate_memory,
    exit_raises,
    load_task_class,
    task_location,
)
from freeride._task_process import enter_worker_environment, pin_to_core, prepare_process
from freeride.devices import (
    Device,
    DeviceName,
    WorkerDevice,
    WorkerSetupError,
    open_device,
    parse_device_name,
    worker_device,
)
from freeride.errors import ConfigError, FreerideError
from freeride.task import SideTask, TaskContext, check_saveable, finite_progress
from freeride.units import format_mib_apart, format_steps, memory_limit_hint, over_device_text

log = logging.getLogger(__name__)

__all__ = ["StandaloneReport", "TaskRunError", "check_target_syntax", "load_task_class", "run_standalone"]


#: Other processes' share of a core above which ``freeride run-task`` warns that its figures are slow.
BUSY_CORE_SHARE = 0.10
#: How often a run reads its memory between steps (and once after the last): a read is a psutil call.
SAMPLE_EVERY_S = 0.01


class MemoryLimitExceeded(Exception):
    """The task's peak memory went over its limit (a worker would fail with MEMORY_LIMIT)."""


class TaskRunError(FreerideError):
    """The task itself raised in ``setup`` or ``step``; carries where and the traceback.

    Raised as a record, not a traceback: ``phase`` is ``"setup"``, ``"step"``, ``"done()"`` or
    ``"progress()"``, ``step`` the 0-based index of the failing step (or of the next one),
    ``traceback_text`` the formatted traceback.
    """

    def __init__(self, target: str, phase: str, step: int, exc: BaseException) -> None:
        # "failed in step 2" read as the second step where it was the third: the count of finished steps is
        # what no reader counts differently.
        at = f"a step, after {format_steps(step)}" if phase == "step" else phase
        super().__init__(f"{target} failed in {at}: {type(exc).__name__}: {exc}{task_location(exc)}")
        self.phase = phase
        self.step = step
        self.traceback_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


class TaskInterrupted(KeyboardInterrupt):
    """Ctrl-C while the task's own code ran; ``str()`` says where (the CLI prints it, then exits 130)."""


@dataclass(frozen=True)
class StandaloneReport:
    """What a standalone run measured.

    Attributes:
        target, args, device: what ran, with which arguments, where (``cpu:0``, ``cuda:1``).
        steps: ``step()`` calls completed; progress / progress_unit: the task's own count.
        finished: the task reported ``done()`` (else the time ran out).
        setup_s: time spent in ``setup``; elapsed_s: time of the step loop.
        progress_per_s, steps_per_s: throughput over the step loop.
        step_ms_p50, step_ms_p90, step_ms_p99: step-time percentiles (nearest rank), ms.
        peak_memory_bytes: see the module doc; memory_measure says which measure it is.
        memory_limit_bytes: the limit the task was given.
        core_busy_share: on ``cpu:N`` from ``freeride run-task``, the share of the core that other
            processes took during the run (:class:`CoreLoad`); None where not measured. Above
            :data:`BUSY_CORE_SHARE` the step times are longer than an idle core's.
    """

    target: str
    device: str
    steps: int
    progress: float
    progress_unit: str
    finished: bool
    setup_s: float
    elapsed_s: float
    progress_per_s: float
    steps_per_s: float
    step_ms_p50: float
    step_ms_p90: float
    step_ms_p99: float
    peak_memory_bytes: int
    memory_measure: str
    memory_limit_bytes: int
    args: dict[str, Any] = field(default_factory=dict)
    core_busy_share: float | None = None

    @property
    def core_was_busy(self) -> bool:
        return self.core_busy_share is not None and self.core_busy_share > BUSY_CORE_SHARE

    def to_json(self) -> str:
        """The report as one JSON object (keys sorted, stable for diffs)."""
        return json.dumps(asdict(self), sort_keys=True, indent=2, default=str)


class CoreLoad:
    """How much of a CPU core other processes took while this process ran pinned to it.

    From the core's counters in ``/proc/stat`` (time busy, steal included: a VM's core that its host
    gave to another guest is as lost) less this process's own CPU time, over the wall time. A worker
    runs at nice 19 and yields the core to anything else on it, so a step measured on a busy core is
    longer than on the idle core of a GPU host's stage.
    """

    _TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

    def __init__(self, core: int) -> None:
        self.core = core
        self._start = self._sample()

    @classmethod
    def of(cls, name: DeviceName) -> CoreLoad | None:
        """The load of ``cpu:N``'s core from now on; None for a GPU, or where ``/proc/stat`` is not readable."""
        if name.kind != "cpu":
            return None
        try:
            return cls(name.index)
        except (OSError, ValueError):
            return None

    def _sample(self) -> tuple[float, float, float]:
        """(now, the core's busy seconds so far, this process's CPU seconds so far)."""
        prefix = f"cpu{self.core} "
        with open("/proc/stat") as fh:
            line = next((line for line in fh if line.startswith(prefix)), None)
        if line is None:
            raise ValueError(f"no {prefix.strip()} in /proc/stat")
        user, nice, system, _idle, _iowait, irq, softirq, steal = ([int(x) for x in line.split()[1:9]] + [0] * 8)[:8]
        own = os.times()
        return time.monotonic(), (user + nice + system + irq + softirq + steal) * self._TICK_S, own.user + own.system

    def others_share(self) -> float:
        """The share of the core's time since construction that went to other processes (0 to 1)."""
        now, busy, own = self._sample()
        start, busy0, own0 = self._start
        wall = now - start
        if wall <= 0:
            return 0.0
        return min(1.0, max(0.0, ((busy - busy0) - (own - own0)) / wall))


def percentile(values: list[float], q: float) -> float:
    """:func:`freeride.measure.percentile` (nearest rank), but 0 for an empty list."""
    return measure.percentile(values, q) if values else 0.0


class MemoryProbe:
    """Peak memory of this process on its device, as a worker's cap counts it (see the module doc).

    ``device=None``: a CPU core, the resident set's growth since the probe was made.
    """

    def __init__(self, device: WorkerDevice | None = None, own_bytes: Callable[[], int] | None = None) -> None:
        """``own_bytes``: what the measuring process holds for its own bookkeeping (left out on a CPU core)."""
        self.device = device
        self._own_bytes = own_bytes
        self.cuda = device is not None and device.torch_device.startswith("cuda")
        self.process = psutil.Process()
        self.peak = 0
        self.baseline = 0 if self.cuda else int(self.process.memory_info().rss)

    @property
    def measure(self) -> str:
        return "device" if self.cuda else "rss_growth"

    def sample(self) -> None:
        if self.cuda and self.device is not None:
            self.peak = max(self.peak, self.device.peak_bytes())
        else:
            own = self._own_bytes() if self._own_bytes is not None else 0
            self.peak = max(self.peak, int(self.process.memory_info().rss) - self.baseline - own)

    def peak_bytes(self) -> int:
        return max(0, self.peak)


def _check_limit(probe: MemoryProbe, limit: int, target: str, phase: str, step: int) -> None:
    peak = probe.peak_bytes()
    if peak > limit:
        cpu = probe.measure == "rss_growth"
        what = "beyond its size once constructed" if cpu else "on the device"
        steps = step if phase == "step" else 0  # ``step``: the steps finished before the one it was over in
        hint = memory_limit_hint(steps) if cpu or steps >= 2 else ""
        shown_peak, shown_limit = format_mib_apart(peak, limit)
        exc = MemoryLimitExceeded(
            f"used {shown_peak} {what}, over its limit of {shown_limit} "
            f"(a worker would fail with MEMORY_LIMIT){hint}; raise --memory or shrink the task"
        )
        raise TaskRunError(target, phase, step, exc)


def _default_limit(cls: type[SideTask], target: str, args: dict[str, Any], device: Device) -> int:
    """The task's ``estimate_memory(**args)``, else the device's free memory; a raising estimate is a
    ConfigError worded as ``freeride submit`` words it (it escaped as a traceback)."""
    estimate = estimate_memory(cls, target, args)
    return estimate if estimate else int(device.free_memory_bytes())


def run_standalone(
    target: str,
    args: dict[str, Any],
    device: str,
    seconds: float,
    memory_limit_bytes: int | None = None,
    work_dir: Path | None = None,
    *,
    prepare_device: bool = False,
    max_steps: int | None = None,
    search_path: str = "",
) -> StandaloneReport:
    """Run ``target`` (``"module:Class"``) alone on ``device`` for up to ``seconds``.

    Args:
        target: the task class reference.
        args: keyword arguments for its constructor (JSON values).
        device: ``cpu:N`` or ``cuda:N``.
        seconds: time budget of the step loop (> 0); the task may finish earlier.
        memory_limit_bytes: the limit passed in ``TaskContext``; default: the task's
            ``estimate_memory(**args)``, else the device's free memory.
        work_dir: the task's work directory; default: a temporary one, removed afterwards.
        prepare_device: make *this* process a worker's (:mod:`freeride._task_process`): the worker's
            environment (thread counts; on a GPU, this GPU alone) and its core before the task's
            module is imported, then its priority (and on a GPU the context and the one cap) before
            the task is built. Only for processes that exit afterwards (the CLI), in which no thread
            pool has started yet (nothing imported torch, NumPy or SciPy) and CUDA is not initialised.
        max_steps: stop after this many steps even if time is left.
        search_path: a directory put first on ``sys.path`` before importing (the CLI passes the
            current directory, so a user's own module next to them resolves).

    Raises:
        TaskLoadError: bad reference, unknown module or class, not a SideTask.
        ConfigError: bad device, arguments the class does not take or values it refuses (worded as
            ``freeride submit`` words them), a configuration that does not fit the memory limit.
        TaskRunError: the task raised in ``setup`` or ``step``.
    """
    if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
        raise ConfigError(f"seconds must be a positive number, got {seconds!r}")
    if not isinstance(args, dict):
        raise ConfigError(f"task arguments must be a JSON object, got {type(args).__name__}")
    check_target_syntax(target)
    name = parse_device_name(device)
    dev = open_device(name)
    wdev = worker_device(name)
    with exit_raises():  # the task's import, construction and run
        try:
            if prepare_device:
                # As a worker, before the task's module is imported: the environment its manager gives it (on
                # a GPU with a provisional MPS limit until the cap is known), and on cpu:N its one core.
                enter_worker_environment(dev, memory_limit_bytes or dev.free_memory_bytes())
                pin_to_core(name)
            cls = load_task_class(target, search_path=search_path)
            limit = (int(memory_limit_bytes) if memory_limit_bytes is not None
                     else _default_limit(cls, target, args, dev))
            if limit <= 0:
                raise ConfigError(f"memory limit must be positive, got {limit}")
            total = dev.total_memory_bytes()
            if total and limit > total:  # as submit refuses it
                raise ConfigError(over_device_text(limit, name, total))
            if prepare_device:
                # Then the rest of a worker's preparation: nice 19, and on a GPU the context and the one cap.
                # The priority waits for the import: it changes when this process gets its core, not how its
                # steps run, and a torch import at nice 19 beside a busy loop on the core took four minutes.
                enter_worker_environment(dev, limit)
                try:
                    prepare_process(wdev, limit)
                except WorkerSetupError as exc:
                    raise ConfigError(str(exc)) from None
        finally:
            dev.close()
        task = construct_task(cls, target, args)
        with tempfile.TemporaryDirectory(prefix="freeride-standalone-") as scratch:
            directory = Path(work_dir) if work_dir is not None else Path(scratch)
            directory.mkdir(parents=True, exist_ok=True)
            # The core's load where this process runs on that core alone (a worker's setup pins it; so does the
            # bench's yardstick, which keeps its own priority): the share of it others took says how far to trust
            # the rate. Unpinned, this process's own time may be another core's.
            pinned = name.kind == "cpu" and os.sched_getaffinity(0) == {name.index}
            load = CoreLoad.of(name) if prepare_device or pinned else None
            return _run(task, target, args, wdev, limit, directory, float(seconds), max_steps, load)


#: What task code may raise that is its failure, not this process's: ``sys.exit()`` in a step ended ``run-task``
#: silently, with the task's exit code as its own (0, or 3: "no manager"). A Ctrl-C stays the user's.
_TASK_ERRORS = (Exception, SystemExit)  # ProcessExitCalled is a SystemExit


def _check_checkpoint(task: SideTask, target: str, steps: int) -> None:
    """Check once, after the timed steps, that the task's state could be checkpointed as a manager does every few
    seconds: a state it cannot save passed ``run-task`` and failed ``CHECKPOINT`` in a manager after hundreds of
    steps."""
    try:
        check_saveable(task.state_dict())
    except _TASK_ERRORS as exc:
        raise TaskRunError(target, "its checkpoint (state_dict(), saved as a manager saves it)", steps,
                           exc) from None


def _done(task: SideTask, target: str, step: int) -> bool:
    try:
        return bool(task.done())
    except _TASK_ERRORS as exc:
        raise TaskRunError(target, "done()", step, exc) from None


def _run(
    task: SideTask,
    target: str,
    args: dict[str, Any],
    dev: WorkerDevice,
    limit: int,
    work_dir: Path,
    seconds: float,
    max_steps: int | None,
    load: CoreLoad | None = None,
) -> StandaloneReport:
    ctx = TaskContext(
        device=dev.torch_device,
        device_name=str(dev.name),
        memory_limit_bytes=limit,
        task_id=f"standalone-{type(task).__name__.lower()}",
        work_dir=work_dir,
        logger=logging.getLogger(f"freeride.task.{type(task).__name__}"),
    )
    # Step times in an array of doubles, whose size the memory probe leaves out: a list of floats grew by
    # 32 bytes a step inside the measured process, and a fast task failed a small cap on its own bookkeeping.
    step_ms = array("d")
    probe = MemoryProbe(dev, own_bytes=lambda: sys.getsizeof(step_ms))
    try:
        start = time.perf_counter()
        try:
            task.setup(ctx)
            dev.synchronize()
        except KeyboardInterrupt:
            raise TaskInterrupted(f"interrupted in {target}'s setup(), {time.perf_counter() - start:.1f} s into "
                                  "it") from None
        except ConfigError:
            raise
        except _TASK_ERRORS as exc:
            raise TaskRunError(target, "setup", 0, exc) from None
        setup_s = time.perf_counter() - start
        probe.sample()
        _check_limit(probe, limit, target, "setup", 0)
        loop_start = time.perf_counter()
        deadline = loop_start + seconds
        # Memory is read every SAMPLE_EVERY_S of steps (and after the last), as a manager polls a worker's:
        # read after every step (a psutil call, ~30 us), it cost a 20 us step more than the step and the
        # run reported a sixth of the task's throughput. The reads are left out of the elapsed time.
        next_sample = loop_start + SAMPLE_EVERY_S
        sampling_s = 0.0
        # The first done() that is true finishes the run, as it finishes a worker's task: a done() that flips back
        # was asked again after the loop, and a finished run read "finished": false.
        finished = _done(task, target, 0)
        while not finished and time.perf_counter() < deadline:
            if max_steps is not None and len(step_ms) >= max_steps:
                break
            t0 = time.perf_counter()
            try:
                task.step()
                dev.synchronize()
            except _TASK_ERRORS as exc:
                raise TaskRunError(target, "step", len(step_ms), exc) from None
            except KeyboardInterrupt:  # Ctrl-C on a step that never returns printed nothing (rc 130)
                raise TaskInterrupted(f"interrupted in a step of {target}, after {format_steps(len(step_ms))}, "
                                      f"{time.perf_counter() - t0:.1f} s into it (run-task has no step timeout; a "
                                      "manager fails a step that runs past its own)") from None
            t1 = time.perf_counter()
            step_ms.append((t1 - t0) * 1000.0)
            if t1 >= next_sample:
                probe.sample()
                _check_limit(probe, limit, target, "step", len(step_ms) - 1)
                t2 = time.perf_counter()
                sampling_s += t2 - t1
                next_sample = t2 + SAMPLE_EVERY_S
            finished = _done(task, target, len(step_ms))
        elapsed = time.perf_counter() - loop_start - sampling_s
        probe.sample()
        _check_limit(probe, limit, target, "step", max(0, len(step_ms) - 1))
        try:
            reported = task.progress()
            progress = finite_progress(reported, len(step_ms))
        except _TASK_ERRORS as exc:
            raise TaskRunError(target, "progress()", len(step_ms), exc) from None
        _check_checkpoint(task, target, len(step_ms))
    finally:
        task.close()
    unit = type(task).progress_unit if reported is not None else "steps"
    times = step_ms.tolist()
    report = StandaloneReport(
        target=target,
        device=str(dev.name),
        steps=len(step_ms),
        progress=progress,
        progress_unit=unit,
        finished=finished,
        setup_s=setup_s,
        elapsed_s=elapsed,
        progress_per_s=progress / elapsed if elapsed > 0 else 0.0,
        steps_per_s=len(step_ms) / elapsed if elapsed > 0 else 0.0,
        step_ms_p50=percentile(times, 50),
        step_ms_p90=percentile(times, 90),
        step_ms_p99=percentile(times, 99),
        peak_memory_bytes=probe.peak_bytes(),
        memory_measure=probe.measure,
        memory_limit_bytes=limit,
        args=dict(args),
        core_busy_share=load.others_share() if load is not None else None,
    )
    log.info("standalone %s on %s: %d steps, %.1f %s/s", target, dev.name, report.steps, report.progress_per_s, unit)
    return report
