"""Side tasks used by the end-to-end tests: each misbehaves (or behaves) in one specific way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from freeride import SideTask, TaskContext


class Counter(SideTask):
    """Counts steps of ``step_ms`` each; finishes after ``total`` steps (0: never). ``cpu_time``: a step is
    ``step_ms`` of its thread's CPU time, not of wall time (its cost is then that whatever the load: a wall-time
    step preempted by other processes costs only the CPU it got).

    Each step's start and end go to ``work/steps.log`` unless ``log_steps`` is false (a task
    that must keep running on a full disk). Faulty subclasses call :meth:`mark_fault` just before
    they misbehave, so that ``bench/bench_faults.py`` can time the manager's reaction.
    """

    progress_unit = "ticks"

    def __init__(self, step_ms: float = 1.0, total: int = 0, log_steps: bool = True, cpu_time: bool = False) -> None:
        self.step_s = step_ms / 1000
        self.clock = time.thread_time if cpu_time else time.perf_counter
        self.total = total
        self.count = 0
        self.log_path = ""
        self.log_steps = log_steps
        self.work_dir = ""

    def setup(self, ctx: TaskContext) -> None:
        self.work_dir = str(ctx.work_dir)
        self.log_path = str(ctx.work_dir / "steps.log") if self.log_steps else ""

    def mark_fault(self, work_dir: str = "") -> None:
        """Write the wall-clock time of the fault about to happen to ``work/fault_at``."""
        with open(os.path.join(work_dir or self.work_dir, "fault_at"), "w") as fh:
            fh.write(repr(time.time()))

    def step(self) -> None:
        start = time.monotonic_ns()
        clock = self.clock
        end_at = clock() + self.step_s
        while clock() < end_at:
            pass
        self.count += 1
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(f"{start} {time.monotonic_ns()}\n")

    def done(self) -> bool:
        return bool(self.total) and self.count >= self.total

    def progress(self) -> float:
        return float(self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


class Crasher(Counter):
    """Raises in step number ``crash_at``."""

    def __init__(self, crash_at: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.crash_at = crash_at

    def step(self) -> None:
        if self.count == self.crash_at:
            self.mark_fault()
            raise ValueError(f"boom at step {self.count}")
        super().step()


class SetupCrasher(Counter):
    def setup(self, ctx: TaskContext) -> None:
        self.mark_fault(str(ctx.work_dir))
        raise RuntimeError("cannot set up")


class SlowSetup(Counter):
    """A Counter whose setup computes for ``setup_cpu_ms`` of its thread's CPU time first (a graph generated, a
    library's one-off start: done in grants, as every setup is)."""

    def __init__(self, setup_cpu_ms: float = 1000.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.setup_cpu_s = setup_cpu_ms / 1000

    def setup(self, ctx: TaskContext) -> None:
        end_at = time.thread_time() + self.setup_cpu_s
        while time.thread_time() < end_at:
            pass
        super().setup(ctx)


class Segfaulter(Counter):
    def step(self) -> None:
        if self.count == 2:
            self.mark_fault()
            os.kill(os.getpid(), signal.SIGSEGV)
        super().step()


class Hanger(Counter):
    """Its step ``hang_at`` never returns (ignores every deadline and park)."""

    def __init__(self, hang_at: int = 2, **kw: Any) -> None:
        super().__init__(**kw)
        self.hang_at = hang_at

    def step(self) -> None:
        if self.count == self.hang_at:
            self.mark_fault()
            while True:
                pass
        super().step()


class ThreadSpinner(Counter):
    """Steps as a Counter does; ``setup`` starts a thread of its own that computes for ever, between its steps
    too (a prefetcher that never waits, a stray spinner)."""

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)

        def spin() -> None:
            while True:
                pass

        threading.Thread(target=spin, daemon=True).start()


class CheckpointHanger(Counter):
    """Steps as a Counter does; its ``state_dict`` never returns (a checkpoint that hangs)."""

    def state_dict(self) -> dict[str, Any]:
        self.mark_fault()
        while True:
            pass


class MemoryHog(Counter):
    """Allocates ``mib_per_step`` MiB per step and keeps it; with ``hold_at``, only in that step, which
    then never returns (so the step it is killed in is known)."""

    def __init__(self, mib_per_step: int = 64, hold_at: int = -1, **kw: Any) -> None:
        super().__init__(**kw)
        self.mib = mib_per_step
        self.hold_at = hold_at
        self.hoard: list[bytes] = []

    def step(self) -> None:
        if self.hold_at >= 0 and self.count != self.hold_at:
            super().step()
            return
        if not self.hoard:
            self.mark_fault()
        self.hoard.append(b"\x01" * (self.mib * 2**20))  # touched pages: resident at once
        while self.hold_at >= 0:
            time.sleep(0.001)
        super().step()


class TorchCounter(Counter):
    """A Counter that imports torch (about 200 MiB of resident set) and keeps a small tensor."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        import torch

        self.torch = torch
        self.tensor: Any = None

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        self.tensor = self.torch.ones(1 << 18)  # 1 MiB

    def step(self) -> None:
        self.tensor.mul_(1.0)
        super().step()


class SlowInit(Counter):
    """Its constructor takes ``init_s`` seconds: the worker stays STARTING that long."""

    def __init__(self, init_s: float = 30.0, **kw: Any) -> None:
        super().__init__(**kw)
        time.sleep(init_s)


class Estimated(Counter):
    """Says how much memory it needs: ``mib`` MiB."""

    def __init__(self, mib: int = 64, **kw: Any) -> None:
        super().__init__(**kw)

    @classmethod
    def estimate_memory(cls, mib: int = 64, **kw: Any) -> int | None:
        return mib * 2**20


class NaNProgress(Counter):
    """Its ``progress()`` is NaN."""

    def progress(self) -> float:
        return float("nan")


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str failed")


class UnprintableRefusal(Counter):
    """Its constructor raises an exception whose ``str()`` raises."""

    def __init__(self, **kw: Any) -> None:
        raise _Unprintable()


class PrintsInConstructor(Counter):
    """Its constructor prints to stdout (a submit must not mix that into the task id)."""

    def __init__(self, **kw: Any) -> None:
        print("HELLO FROM THE CONSTRUCTOR")
        super().__init__(**kw)


class PositionalOnly(Counter):
    """A constructor that a submission (keyword arguments only) can never call."""

    def __init__(self, step_ms: float, /, total: int = 0) -> None:
        super().__init__(step_ms=step_ms, total=total)


class SlowConstructor(Counter):
    """Writes ``marker`` (when given), then takes ``secs`` seconds to construct."""

    def __init__(self, secs: float = 60.0, marker: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        if marker:
            with open(marker, "w") as fh:
                fh.write("constructing")
        time.sleep(secs)


class ChannelCloser(Counter):
    """Closes every inherited socket (its channel to the manager) and keeps running."""

    def step(self) -> None:
        if self.count == 1:
            self.mark_fault()
            for fd in range(3, 256):
                try:
                    os.close(fd)
                except OSError:
                    pass
            while True:
                time.sleep(0.01)
        super().step()


class ChannelWriter(Counter):
    """In step ``at``, writes ``payload`` on its channel to the manager as one message, and waits there
    (the manager kills it; its failure then names step ``at`` however late the manager reads)."""

    def __init__(self, payload: str, at: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        self.payload = payload.encode()
        self.at = at

    def step(self) -> None:
        if self.count == self.at:
            self.mark_fault()
            fd = int(sys.argv[sys.argv.index("--fd") + 1])  # the worker's channel, as the manager passed it
            os.write(fd, self.payload)
            while True:
                time.sleep(0.01)
        super().step()


class Spawner(Counter):
    """Starts a child process that sleeps; the child must die with the task."""

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (ctx.work_dir / "child.pid").write_text(str(self.child.pid))


class SpawnThenCrash(Spawner):
    """Starts a child in setup, then raises in step ``crash_at``: the child must not outlive it."""

    def __init__(self, crash_at: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.crash_at = crash_at

    def step(self) -> None:
        if self.count == self.crash_at:
            self.mark_fault()
            raise RuntimeError(f"crashed with a child running, at step {self.count}")
        super().step()


class UnpicklableState(Counter):
    """Its ``state_dict`` holds a lock, which no checkpoint format can serialise."""

    def state_dict(self) -> dict[str, Any]:
        self.mark_fault()
        return {"count": self.count, "lock": threading.Lock()}



class SlowCheckpoint(Counter):
    """Its ``state_dict`` says it began (``work/checkpointing``), then waits for ``work/release``.

    Holds a drain open for as long as a test likes, with the checkpoint still to be written.
    """

    def state_dict(self) -> dict[str, Any]:
        with open(os.path.join(self.work_dir, "checkpointing"), "w"):
            pass
        while not os.path.exists(os.path.join(self.work_dir, "release")):
            time.sleep(0.005)
        return super().state_dict()


class BusyCheckpoint(Counter):
    """Its ``state_dict`` computes for ``checkpoint_ms`` (serialising a large state takes the CPU so)."""

    def __init__(self, step_ms: float = 1.0, checkpoint_ms: float = 1500.0, **kwargs: Any) -> None:
        super().__init__(step_ms=step_ms, **kwargs)
        self.checkpoint_ms = checkpoint_ms

    def state_dict(self) -> dict[str, Any]:
        until = time.monotonic() + self.checkpoint_ms / 1000
        while time.monotonic() < until:
            pass
        return super().state_dict()


class Printer(Counter):
    """Prints ``kib_per_step`` KiB of numbered lines each step; at step ``crash_at`` it says its last words
    and dies from SIGSEGV (so its failure record quotes the log's tail)."""

    def __init__(self, kib_per_step: int = 1024, crash_at: int = -1, **kw: Any) -> None:
        super().__init__(**kw)
        self.line = "x" * 63
        self.lines_per_step = kib_per_step * 1024 // 64
        self.crash_at = crash_at

    def step(self) -> None:
        if self.count == self.crash_at:
            print(f"last words at step {self.count}", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        sys.stdout.write((self.line + "\n") * self.lines_per_step)
        sys.stdout.flush()
        super().step()


class MalformedInput(Counter):
    """Finds its input malformed in ``setup``: a user-fixable error (a ConfigError), not a crash."""

    def setup(self, ctx: TaskContext) -> None:
        from freeride.errors import ConfigError

        raise ConfigError("input.txt:3: expected two integers per line")
