"""What the framework adapters' tests share: the frameworks themselves, the documented snippets, a
one-process gloo group, and a two-rank job under torchrun beside one manager per rank's core.

The frameworks are real, installed as test extras (``scripts/setup.sh`` installs them): missing, a test
is skipped on a developer's machine and fails under CI (``$CI`` set), where their absence is a broken
setup.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO / "tests"
DOCS = REPO / "docs" / "bubbles.md"
README = REPO / "README.md"
#: Per framework: the module its tests need, and how scripts/setup.sh installs it.
FRAMEWORKS = {
    "deepspeed": ("deepspeed", "pip install -e '.[test-deepspeed]'"),
    "torchtitan": ("torchtitan.distributed.pipeline_parallel",
                   "pip install --no-deps torchtitan==0.3.0 and -e '.[test-torchtitan]'"),
    # Found, not imported: importing Megatron Core on CPU needs examples/megatron_cpu.py first.
    "megatron": ("megatron.core", "pip install --no-deps --ignore-requires-python megatron-core==0.19.2"),
}


def require_framework(name: str) -> None:
    """Skip the calling test (or module) when framework ``name`` is not installed; under CI, fail it."""
    module, hint = FRAMEWORKS[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError as exc:  # a parent package that cannot be imported
        found, hint = False, f"{exc}; {hint}"
    if found:
        return
    message = f"{name} is not installed ({hint}: scripts/setup.sh does)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message + "; set CI to make this a failure", allow_module_level=True)


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """An initialised one-process gloo group (in memory: no port), unless one is up already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def deepspeed_one_rank(store: Path, backend: str) -> Iterator[None]:
    """DeepSpeed initialised on a one-rank group of ``backend`` (gloo, or nccl on a GPU) over a file store at
    ``store`` (no port), with the environment DeepSpeed reads; all of it undone afterwards."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group(backend, store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def docs_snippet(name: str, path: Path = DOCS) -> str:
    """The code block after ``<!-- snippet: NAME -->`` in ``path``: the code a user copies, run as written."""
    found = re.search(rf"<!-- snippet: {re.escape(name)} -->\s*```python\n(.*?)```", path.read_text(), re.S)
    assert found, f"no snippet {name!r} in {path}"
    return found.group(1)


RankLog = tuple[list[dict[str, Any]], dict[str, Any]]  # a rank's iteration records, and its summary


@dataclass
class ManagedRanks:
    """One in-process manager per core the job's two ranks run on, at each device's default endpoint
    under a private runtime directory (the job gets it as ``XDG_RUNTIME_DIR``, so a reporter made with
    no endpoint, as the snippets make it, finds its manager)."""

    devices: list[str]
    runtime_dir: Path
    tmp: Path
    managers: list[Any] = field(default_factory=list)
    traces: list[Path] = field(default_factory=list)

    def endpoint(self, rank: int) -> Any:
        return self.managers[rank].endpoint

    def submit(self, rank: int, target: str, **args: Any) -> Any:
        """Submit a side task to rank ``rank``'s manager; returns once its worker is up (parked), so that
        the job's bubbles find it ready, as a long training run would."""
        from conftest import wait_for

        from freeride._wire.client import ControlClient
        from freeride.messages import TaskSpec

        with ControlClient(self.endpoint(rank)) as client:
            info = client.submit(TaskSpec(target=target, args=args, memory_bytes=256 * 2**20,
                                          working_dir=str(TESTS_DIR)))
            wait_for(lambda: client.get(info.task_id).state == "PARKED", 60, what=f"{target} parked")
        return info

    def run_job(self, module: str, *args: str, timeout_s: float = 240) -> list[RankLog]:
        """``torchrun --standalone --nproc-per-node 2 -m MODULE ARGS --iteration-log ...``; each rank's
        iteration records and summary."""
        from freeride.workload.jobs import read_log

        log = self.tmp / "it.jsonl"
        env = dict(os.environ, XDG_RUNTIME_DIR=str(self.runtime_dir), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   FREERIDE_LOG_LEVEL="WARNING")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", module, *args, "--iteration-log", str(log)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(self.tmp))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return [read_log(self.tmp / f"it.rank{r}.jsonl") for r in (0, 1)]

    def stop(self) -> None:
        for manager in self.managers:
            manager.stop()
        self.managers = []


@contextlib.contextmanager
def managed_ranks(tmp: Path) -> Iterator[ManagedRanks]:
    from conftest import cpu_devices

    from freeride._manager.daemon import Manager
    from freeride.devices import parse_device_name
    from freeride.endpoints import Endpoint

    devices = cpu_devices(2)
    # Short: a unix socket's path has at most 107 bytes, and pytest's temporary directories are long.
    runtime_dir = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))
    sockets = runtime_dir / "freeride"
    sockets.mkdir(mode=0o700)
    ranks = ManagedRanks(devices, runtime_dir, tmp)
    try:
        for i, device in enumerate(devices):
            trace = tmp / f"trace{i}.jsonl"
            sock = sockets / f"{parse_device_name(device).slug}.sock"
            manager = Manager(device, endpoint=Endpoint("unix", str(sock)), state_dir=tmp / f"state{i}",
                              memory_poll_ms=20.0, trace_path=trace)
            manager.start()
            ranks.managers.append(manager)
            ranks.traces.append(trace)
        yield ranks
    finally:
        ranks.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def traced_bubbles(trace: Path) -> list[dict[str, Any]]:
    """The bubbles a manager's trace holds: its starts joined with their ends (by rank, iteration, slot)."""
    from freeride._manager.trace import read_trace

    records = read_trace(trace)
    ends = {(r["rank"], r["iteration"], r["slot"]): r["end_ns"] for r in records if r["ev"] == "bubble_end"}
    out = []
    for r in records:
        if r["ev"] == "bubble_start":
            end = ends.get((r["rank"], r["iteration"], r["slot"]))
            if end is not None:
                out.append({**r, "end_ns": end})
    return out


def megatron_waits(intervals: Iterable[Sequence[Any]]) -> list[tuple[int, int, int]]:
    """Megatron's transfer intervals of one iteration, as a trainer's timers saw them (``(name, start, stop)``
    each): ``(position, start, stop)``, the position being the compute actions begun before it."""
    from freeride.training.megatron import P2P_TIMERS

    position, waits = 0, []
    for name, start, stop in sorted(intervals, key=lambda i: i[1]):
        if name in ("forward-compute", "backward-compute"):
            position += 1
        elif name in P2P_TIMERS:
            waits.append((position, start, stop))
    return waits


def misplaced_bubbles(bubbles: Iterable[dict[str, Any]], intervals: Iterable[Sequence[Any]]
                      ) -> list[tuple[dict[str, Any], list[tuple[int, int, int]]]]:
    """The bubbles of one iteration (``slot``, ``start_ns``, ``end_ns``) that are not inside exactly one of
    Megatron's waits (:func:`megatron_waits`), or that are in one at another position than their modelled
    slot's (a learned slot's id is no position): each with the waits it is inside."""
    from freeride.training.learned_slots import LEARNED_SLOT_BASE

    waits = megatron_waits(intervals)
    wrong = []
    for b in bubbles:
        inside = [w for w in waits if w[1] <= b["start_ns"] and b["end_ns"] <= w[2]]
        if len(inside) != 1 or (b["slot"] < LEARNED_SLOT_BASE and b["slot"] != inside[0][0]):
            wrong.append((b, inside))
    return wrong
