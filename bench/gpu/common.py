"""What the GPU measurements share: where results go, a manager of ``cuda:0``, bubbles, percentiles.

Results go to ``bench/results/gpu-<model>/`` (``<model>`` from NVML, e.g. ``h100-80gb-hbm3``), each as
``NAME.json`` (every sample and the machine) and ``NAME.md`` (the table a reader wants).

A manager is either in this process (:func:`gpu_manager`: the measurement process then holds no CUDA
context of its own) or a real ``freeride manager`` process (:class:`ManagerProcess`), for measurements
whose own process plays the trainer on the same GPU: the manager's threads must not share the
trainer's interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.machine import gpu_info, gpu_slug, machine_info
from freeride._manager.daemon import Manager
from freeride._wire.client import BubbleStream, ControlClient, health_status
from freeride.devices import open_device
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.measure import percentile
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart

REPO = Path(__file__).resolve().parents[2]
MS = 1_000_000
GiB = 2**30
MiB = 2**20


#: rmat:18's (seed 0) vertex of most out-edges: a BFS from it takes 6 levels. From vertex 0, isolated there
#: as in rmat:20, it ends after one step that reaches nothing.
RMAT18_BFS_SOURCE = 75061


def pagerank_args(graph: str) -> dict[str, Any]:
    """PageRank on ``graph`` for as long as a bench asks: its L1 test (change < n * tol) passes after a step or
    two on R-MAT graphs of a million vertices at the default tol (the first GPU run's rows had no sample);
    tol 0 runs it to ``max_iterations``, far past any bench's steps or seconds."""
    return {"graph": graph, "tol": 0.0, "max_iterations": 1_000_000}


def not_measured(left: list[str] | None) -> list[str]:
    """The lines a table ends with while some of its rows are missing (results are written row by row)."""
    return ["", f"Not measured (the run ended or is still going): {', '.join(left)}."] if left else []


def results_dir() -> Path:
    """``bench/results/gpu-<model>/`` (``$FREERIDE_GPU_RESULTS`` overrides), created."""
    override = os.environ.get("FREERIDE_GPU_RESULTS")
    path = Path(override) if override else REPO / "bench" / "results" / f"gpu-{gpu_slug(gpu_info())}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(name: str, data: dict[str, Any], table: str, command: str) -> Path:
    out = results_dir()
    doc = {"machine": machine_info(), "command": command, **data}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    gpu = doc["machine"].get("gpu", {})
    header = (f"# {name}\n\nMachine: {gpu.get('name', '?')} (driver {gpu.get('driver', '?')}, CUDA "
              f"{gpu.get('torch_cuda', '?')}), torch {doc['machine']['versions'].get('torch')}, "
              f"{doc['machine']['cpu']} x{doc['machine']['cores']}.\nCommand: `{command}`\n\n")
    (out / f"{name}.md").write_text(header + table.rstrip() + "\n")
    return out / f"{name}.md"


def pct(values: list[float]) -> dict[str, float]:
    """p50/p99/max and the count, by the project's one percentile definition."""
    return {"count": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values) if values else 0.0}


@contextmanager
def gpu_manager(tmp: Path, mps: str = "auto", **kw: Any) -> Iterator[Manager]:
    """An in-process manager of ``cuda:0`` on a private socket (``mps`` as ``freeride manager --mps``)."""
    sock = Path(f"/tmp/fr-gpubench-{os.getpid()}-{time.monotonic_ns() % 10**6}.sock")
    manager = Manager(open_device("cuda:0", mps=mps), endpoint=Endpoint("unix", str(sock)), state_dir=tmp / "state",
                      memory_poll_ms=kw.pop("memory_poll_ms", 10.0), **kw)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()


class ManagerProcess:
    """``freeride manager --device cuda:0`` in a process of its own, on a private socket; a context manager
    that returns once it is SERVING and stops it (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, state_dir: Path, *options: str, env: dict[str, str] | None = None,
                 log_path: Path | None = None) -> None:
        self.endpoint = Endpoint("unix", f"/tmp/fr-gpubench-{os.getpid()}-{time.monotonic_ns() % 10**6}.sock")
        self.argv = [sys.executable, "-m", "freeride.cli", "manager", "--device", "cuda:0", "--endpoint",
                     f"unix:{self.endpoint.address}", "--state-dir", str(state_dir), *options]
        self.env = env
        self.log_path = log_path or state_dir.parent / "manager.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ManagerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it for its whole life
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"freeride manager exited {self.proc.returncode}: see {self.log_path}")
            try:
                if health_status(self.endpoint) == "SERVING":
                    return self
            except ManagerUnavailable:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise TimeoutError(f"freeride manager not SERVING within 60 s: see {self.log_path}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fresh_cuda_memory() -> None:
    """Give back what this process's allocators cache and start their peak figures anew (between runs
    of one process, so that one run's peak is not the one before's)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        import cupy
    except ImportError:
        return
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


class Trainer:
    """A bubble stream driven by hand: ``start(length_ms)`` opens a bubble now, ``end()`` closes it."""

    def __init__(self, endpoint: Endpoint, free_memory_bytes: int = 40 * GiB) -> None:
        import queue

        self._q: queue.Queue[BubbleEvent | None] = queue.Queue()
        self.free = free_memory_bytes
        self.iteration = 0
        self.stream = BubbleStream(endpoint, iter(self._q.get, None))

    def start(self, predicted_ms: float) -> int:
        now = time.monotonic_ns()
        self._q.put(BubbleStart(0, 0, self.iteration, 0, "bench", now, int(predicted_ms * MS), self.free))
        return now

    def end(self) -> int:
        now = time.monotonic_ns()
        self._q.put(BubbleEnd(0, 0, self.iteration, 0, now))
        self.iteration += 1
        return now

    def bubbles(self, count: int, length_ms: float, gap_ms: float) -> None:
        for _ in range(count):
            self.start(length_ms)
            time.sleep(length_ms / 1000)
            self.end()
            time.sleep(gap_ms / 1000)

    def close(self) -> None:
        self._q.put(None)
        try:
            self.stream.result(10)
        finally:
            self.stream.close()


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.005)


class NvmlSampler:
    """Samples NVML's figure for a set of PIDs every ``period_ms`` on a thread; keeps the peak."""

    def __init__(self, uuid: str, period_ms: float = 5.0) -> None:
        self.uuid = uuid
        self.period_s = period_ms / 1000
        self.pids: set[int] = set()
        self.peak = 0
        self.samples = 0
        self.visible = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> NvmlSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        from freeride.devices.nvml import PyNvml, usage_by_pid

        nvml = PyNvml()
        handle = nvml.handle_by_uuid(self.uuid)
        try:
            while not self._stop.is_set():
                usage = usage_by_pid(nvml.processes(handle) + nvml.mps_processes(handle))
                mine = [usage[p] for p in self.pids if p in usage]
                if mine:
                    self.visible = True
                    self.peak = max(self.peak, sum(mine))
                self.samples += 1
                self._stop.wait(self.period_s)
        finally:
            nvml.shutdown()


def client(manager: Manager) -> ControlClient:
    return ControlClient(manager.endpoint)
