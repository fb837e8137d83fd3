"""Test a side task without a manager or a GPU: the checks every task needs, ready-made.

    from freeride.testing import check_resume, checkpoint_roundtrip, run_steps, task_context

    def test_resumes_exactly(tmp_path):
        check_resume(lambda: MyTask(size=100, seed=3), stop_after=4, work_dir=tmp_path)

    def test_runs_within_its_cap(tmp_path):
        run = run_steps(MyTask(size=100), 20, memory_limit_bytes=64 << 20, work_dir=tmp_path)
        assert run.steps == 20

* :func:`task_context` -- the :class:`~freeride.task.TaskContext` a worker on a CPU core gives ``setup``.
* :func:`run_steps` -- ``setup``, then up to N steps (fewer if the task is done), each checked against
  the memory cap the way a worker on a CPU core counts it: the growth of the process's resident set
  since the task was handed over (the interpreter and the libraries already loaded are the baseline).
  Over the cap: :class:`MemoryCapExceeded`, naming the step, where a worker fails with MEMORY_LIMIT.
* :func:`checkpoint_roundtrip` -- ``state_dict()`` written and read back in the worker's checkpoint
  format (``torch.save`` once torch is loaded, else pickle; every tensor loaded on the CPU), so a state
  that cannot be saved fails here rather than as the task's CHECKPOINT failure.
* :func:`check_resume` -- the worker's contract for restarts: a run stopped after k steps,
  checkpointed, and resumed in a fresh instance (built with the same arguments, ``setup``, then
  ``load_state_dict``) must be where the stopped one was, and end where an uninterrupted run ends.
  Any difference is a :class:`ResumeMismatch` naming the keys. It catches the classic bug: a
  ``load_state_dict`` that forgets part of the state (a counter, an RNG state).

Everything runs in the calling process, on the CPU; nothing here needs a manager, a GPU or torch (a
task that uses torch brings it). What the resident-set check cannot see: memory the process freed
earlier is reused without growing it, so a pass is no proof of a small footprint in a fresh worker
(``freeride run-task`` measures that), while a failure is a real overrun.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freeride import _checkpoints
from freeride._loading import exit_raises
from freeride.standalone import MemoryProbe
from freeride.task import SideTask, TaskContext, finite_progress
from freeride.units import format_mib_apart

__all__ = [
    "MemoryCapExceeded",
    "ResumeMismatch",
    "StepsRun",
    "check_resume",
    "checkpoint_roundtrip",
    "run_steps",
    "task_context",
]

#: The cap a context gets when a test names none: large, so that only a test that asks checks it.
DEFAULT_MEMORY_LIMIT_BYTES = 1 << 30
#: :func:`check_resume` without ``steps`` runs until ``done()``; a task not done after this many is
#: taken for one that never finishes (pass ``steps``).
MAX_STEPS_UNTIL_DONE = 100_000


class MemoryCapExceeded(AssertionError):
    """The task's resident-set growth went over its cap: a worker would fail it with MEMORY_LIMIT."""


class ResumeMismatch(AssertionError):
    """A resumed task is not where the task it resumes was (or does not end where a whole run ends)."""


@dataclass(frozen=True)
class StepsRun:
    """What :func:`run_steps` did: ``steps`` run, whether the task is ``done``, its ``peak_bytes`` of
    resident-set growth, and how long the steps took (``step_s``, one per step)."""

    steps: int
    done: bool
    peak_bytes: int
    step_s: tuple[float, ...]  # one per step: its repr shows how many, not tens of thousands of them

    def __repr__(self) -> str:
        times = f"{len(self.step_s)} step times" + (f", p50 {statistics.median(self.step_s) * 1e3:.3g} ms"
                                                    if self.step_s else "")
        return f"StepsRun(steps={self.steps}, done={self.done}, peak_bytes={self.peak_bytes}, step_s=<{times}>)"


def task_context(work_dir: str | Path | None = None, *, memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
                 task_id: str = "test") -> TaskContext:
    """A context as a worker on a CPU core builds it: ``device="cpu"``, this process's first core, the cap.

    ``work_dir`` is created if needed; without one, a fresh temporary directory (left for the OS to clean).
    """
    if not (isinstance(memory_limit_bytes, int) and memory_limit_bytes > 0):
        raise ValueError(f"memory_limit_bytes must be a positive int, got {memory_limit_bytes!r}")
    directory = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="freeride-test-"))
    directory.mkdir(parents=True, exist_ok=True)
    core = min(os.sched_getaffinity(0))
    return TaskContext(device="cpu", device_name=f"cpu:{core}", memory_limit_bytes=memory_limit_bytes,
                       task_id=task_id, work_dir=directory, logger=logging.getLogger(f"freeride.task.{task_id}"))


def run_steps(task: SideTask, steps: int, *, ctx: TaskContext | None = None, work_dir: str | Path | None = None,
              memory_limit_bytes: int | None = None, setup: bool = True) -> StepsRun:
    """``setup`` the task (unless ``setup=False``: it is set up already), then run up to ``steps`` steps.

    Stops at the first ``done()`` that is true, as a worker does (the task is finished then, whatever a
    later call says); ``done`` is checked once more after the last of ``steps``. ``progress()`` is read after
    every step as a worker reads it (:func:`~freeride.task.finite_progress`: a NaN raises ValueError). The cap is
    ``ctx.memory_limit_bytes``, else ``memory_limit_bytes``; a task to be set up without ``ctx`` gets a context
    made from ``work_dir`` and the cap (a task set up already needs none, and no directory is made for it). The
    resident set is sampled after ``setup`` and after every step, from a baseline taken now, as a worker takes
    its baseline once the task is built. Raises :class:`MemoryCapExceeded`; the task's own exceptions propagate
    unchanged, and its ``os._exit(code)`` raises :class:`~freeride._loading.ProcessExitCalled`.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if memory_limit_bytes is not None and not (isinstance(memory_limit_bytes, int) and memory_limit_bytes > 0):
        raise ValueError(f"memory_limit_bytes must be a positive int, got {memory_limit_bytes!r}")
    cap = memory_limit_bytes or DEFAULT_MEMORY_LIMIT_BYTES
    if ctx is not None:
        cap = ctx.memory_limit_bytes
    elif setup:  # a task set up already has its directory: none is made for it
        ctx = task_context(work_dir, memory_limit_bytes=cap)
    probe = MemoryProbe()
    name = type(task).__name__
    with exit_raises():  # a task's os._exit() took the test session down without a word
        if ctx is not None and setup:
            task.setup(ctx)
            _check_cap(probe, cap, f"{name}.setup()")
        times: list[float] = []
        done = bool(task.done())
        while len(times) < steps and not done:
            start = time.perf_counter()
            task.step()
            times.append(time.perf_counter() - start)
            _check_cap(probe, cap, f"{name}'s step {len(times) - 1}")
            finite_progress(task.progress(), len(times))  # a worker fails a task whose progress() is no number
            done = bool(task.done())
    return StepsRun(len(times), done, probe.peak_bytes(), tuple(times))


def _check_cap(probe: MemoryProbe, limit: int, where: str) -> None:
    probe.sample()
    if probe.peak_bytes() > limit:
        shown_peak, shown_limit = format_mib_apart(probe.peak_bytes(), limit)
        raise MemoryCapExceeded(
            f"{where} took the resident set {shown_peak} past its size when the task was "
            f"handed over, over the cap of {shown_limit}: a worker would fail it with MEMORY_LIMIT "
            "(raise the cap, or shrink the task)"
        )


def checkpoint_roundtrip(task: SideTask) -> dict[str, Any]:
    """``task.state_dict()``, saved and loaded back exactly as a worker checkpoints and restores it."""
    state = task.state_dict()
    with tempfile.TemporaryDirectory(prefix="freeride-ckpt-") as directory:
        path = _checkpoints.write(Path(directory), "test", 0, state)
        return dict(_checkpoints.load(path)["state"])


def check_resume(factory: Callable[[], SideTask], stop_after: int, *, steps: int | None = None,
                 work_dir: str | Path | None = None,
                 memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES) -> SideTask:
    """Check that a task stopped after ``stop_after`` steps and resumed matches one that never stopped.

    Three instances from ``factory`` (each built as the worker builds it after a restart, with the same
    arguments): one runs ``steps`` steps (default: until done) without a stop; one runs ``stop_after``
    steps and is checkpointed (:func:`checkpoint_roundtrip`); a fresh one is set up, loads that
    checkpoint, and must then report the same ``state_dict()`` as the stopped one (what the checkpoint
    held, nothing lost), and after the remaining steps the same state, ``progress()`` and ``done()`` as
    the uninterrupted run, in the steps that run had left (none redone). The interrupted and resumed instances
    share a work directory (it survives restarts); the uninterrupted one has its own. Returns the resumed
    instance for further checks.
    """
    if stop_after < 0 or (steps is not None and steps < stop_after):
        raise ValueError(f"need 0 <= stop_after <= steps, got stop_after={stop_after}, steps={steps}")
    base = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="freeride-test-"))
    limit = steps if steps is not None else MAX_STEPS_UNTIL_DONE

    whole = factory()
    if steps is None and type(whole).done is SideTask.done:
        # SideTask's done() is never true: run until done, such a task took MAX_STEPS_UNTIL_DONE steps to fail.
        raise ValueError(f"{type(whole).__name__} never finishes (its done() is SideTask's): pass steps=N")
    ran = run_steps(whole, limit, ctx=task_context(base / "whole", memory_limit_bytes=memory_limit_bytes))
    if steps is None and not ran.done:
        raise ValueError(f"{type(whole).__name__} was not done after {limit} steps: pass steps=N")
    if ran.steps < stop_after:
        raise ValueError(f"{type(whole).__name__} was done after {ran.steps} steps, before stop_after={stop_after}")

    stopped = factory()
    resumed_ctx = task_context(base / "resumed", memory_limit_bytes=memory_limit_bytes)
    run_steps(stopped, stop_after, ctx=resumed_ctx)
    checkpoint = checkpoint_roundtrip(stopped)
    expected = stopped.state_dict()
    stopped.close()

    resumed = factory()
    resumed.setup(resumed_ctx)
    resumed.load_state_dict(checkpoint)
    _must_match("right after load_state_dict, the resumed task's state_dict()", resumed.state_dict(),
                "the checkpointed one's", expected,
                "load_state_dict must restore everything state_dict saved (counters, cursors, RNG states)")
    rest = run_steps(resumed, limit - stop_after, ctx=resumed_ctx, setup=False)
    if rest.steps != ran.steps - stop_after:
        # Without ``steps``, a task whose state_dict saved nothing caught up by redoing every step, and its end
        # state, progress and done() matched: it passed.
        raise ResumeMismatch(
            f"the resumed task took {rest.steps} steps to the end, an uninterrupted run {ran.steps} in all, less the "
            f"{stop_after} done before the stop, {ran.steps - stop_after} (it "
            + ("redid work: does state_dict save how far it got?)" if rest.steps > ran.steps - stop_after
               else "skipped work)"))
    _must_match("at the end, the resumed task's state_dict()", resumed.state_dict(),
                "an uninterrupted run's", whole.state_dict(),
                "everything that evolves must be in state_dict, and a step must depend on nothing else")
    for what in ("progress", "done"):
        got, want = getattr(resumed, what)(), getattr(whole, what)()
        if not _equal(got, want):
            raise ResumeMismatch(f"at the end, the resumed task's {what}() is {got!r}, an uninterrupted run's "
                                 f"{want!r}")
    whole.close()
    return resumed


def _must_match(what: str, got: Any, other: str, want: Any, hint: str) -> None:
    differences = _differences(got, want, "")
    if differences:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
        raise ResumeMismatch(f"{what} differs from {other}: {shown} ({hint})")


def _differences(got: Any, want: Any, path: str) -> list[str]:
    """Where two states differ, as ``key: what`` lines (tensors and arrays compared element by element)."""
    here = path or "the state"
    if isinstance(got, Mapping) and isinstance(want, Mapping):
        out = [f"{path}[{k!r}]: missing" for k in want if k not in got]
        out += [f"{path}[{k!r}]: not in the other" for k in got if k not in want]
        for key in want:
            if key in got:
                out += _differences(got[key], want[key], f"{path}[{key!r}]")
        return out
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{here}: {len(got)} items, the other {len(want)}"]
        return [d for i, (a, b) in enumerate(zip(got, want, strict=True)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if _equal(got, want) else [f"{here}: {_brief(got)} != {_brief(want)}"]


def _equal(a: Any, b: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu())))
    numpy = sys.modules.get("numpy")
    if numpy is not None and (isinstance(a, numpy.ndarray) or isinstance(b, numpy.ndarray)):
        return (isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == cannot answer is not known to be equal
        return False


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
