"""Stand-ins for the nodes of a multi-node job: a manager on a ``cpu:N`` core joined to a real queue,
with a trainer stand-in that keeps reporting bubbles from a background thread.

Several nodes may share one core (different endpoints and state directories): the queue sees them as
different devices, which is all the placement logic needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from conftest import BubbleFeeder, wait_for

from freeride._cluster.agent import QueueConfig
from freeride._cluster.records import ClusterRecord
from freeride._cluster.redis_queue import RedisQueue
from freeride._cluster.url import parse_queue_url
from freeride._manager.daemon import Manager
from freeride._wire.client import ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.messages import TrainerLayout

MiB = 2**20
#: Short leases keep the tests fast; the poll must be at most a third of the lease.
LEASE_MS = 800
POLL_MS = 50.0


def node_devices(count: int) -> list[str]:
    """``count`` devices on this process's cores, reusing cores when there are fewer than nodes."""
    allowed = sorted(os.sched_getaffinity(0))
    return [f"cpu:{allowed[i % len(allowed)]}" for i in range(count)]


def socket_for(name: str) -> Path:
    return Path(f"/tmp/fr-{name}-{os.getpid()}.sock")


@dataclass
class Trainer:
    """Reports a bubble every ~35 ms to one manager until stopped; its free-memory figure, slot and
    kind can change while it runs (a new layout)."""

    endpoint: Endpoint
    free_memory_bytes: int
    length_ms: float = 30.0
    slot: int = 0
    kind: str = "test"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    feeder: BubbleFeeder | None = None

    def start(self) -> Trainer:
        self.feeder = BubbleFeeder(self.endpoint, free_memory_bytes=self.free_memory_bytes)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self.feeder is not None
        while not self._stop.is_set():
            self.feeder.free_memory_bytes = self.free_memory_bytes
            self._bubble()

    def _bubble(self) -> None:
        import time

        from freeride.messages import BubbleEnd, BubbleStart

        feeder = self.feeder
        assert feeder is not None
        it = feeder._iteration
        feeder._iteration += 1
        start = time.monotonic_ns()
        feeder.send(BubbleStart(0, 0, it, self.slot, self.kind, start, int(self.length_ms * 1e6),
                                self.free_memory_bytes))
        time.sleep(self.length_ms / 1000)  # the trainer's wait: the bubble itself
        feeder.send(BubbleEnd(0, 0, it, self.slot, time.monotonic_ns()))
        time.sleep(0.005)  # its compute between bubbles

    def layout(self, layout: TrainerLayout) -> None:
        assert self.feeder is not None
        self.feeder.send(layout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.feeder is not None:
            self.feeder._q.put(None)
            self.feeder.stream.close()


@dataclass
class Node:
    """An in-process manager joined to the queue."""

    name: str
    manager: Manager
    client: ControlClient
    trainer: Trainer | None = None

    @property
    def where(self) -> str:
        return f"{self.name}/{self.manager.device}"

    @property
    def state_dir(self) -> Path:
        return self.manager.state_dir

    def train(self, free_mib: int) -> Trainer:
        self.trainer = Trainer(self.manager.endpoint, free_mib * MiB).start()
        return self.trainer

    def stop(self, drain: bool = False) -> None:
        if self.trainer is not None:
            self.trainer.stop()
        self.client.close()
        self.manager.stop(drain=drain)


def queue_config(url: str, checkpoints: Path, **kw: float) -> QueueConfig:
    options: dict[str, float] = {"lease_ms": LEASE_MS, "poll_ms": POLL_MS, "hold_ms": 2_000.0, "backoff_max_ms": 400.0}
    options.update(kw)
    return QueueConfig(parse_queue_url(url), checkpoints, **options)  # type: ignore[arg-type]


def start_node(tmp: Path, name: str, device: str, url: str, checkpoints: Path, **queue: float) -> Node:
    sock = socket_for(name)
    manager = Manager(device, endpoint=Endpoint("unix", str(sock)), state_dir=tmp / f"state-{name}",
                      queue=queue_config(url, checkpoints, **queue), node=name, memory_poll_ms=20.0)
    manager.start()
    return Node(name, manager, ControlClient(manager.endpoint))


def start_daemon_node(tmp: Path, name: str, device: str, url: str, checkpoints: Path) -> subprocess.Popen[bytes]:
    """A manager as a real process (``freeride manager --queue ...``), returned once it serves."""
    sock = socket_for(name)
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "freeride.cli", "manager", "--device", device, "--endpoint", f"unix:{sock}",
             "--state-dir", str(tmp / f"state-{name}"), "--queue", url, "--checkpoint-dir", str(checkpoints),
             "--queue-lease-ms", str(LEASE_MS), "--queue-poll-ms", str(POLL_MS), "--node", name,
             "--memory-poll-ms", "20"],
            stdout=subprocess.DEVNULL, stderr=log,
        )
    endpoint = Endpoint("unix", str(sock))

    def serving() -> bool:
        assert proc.poll() is None, (tmp / f"{name}.log").read_text()
        try:
            return health_status(endpoint, timeout_s=1) == "SERVING"
        except ManagerUnavailable:
            return False

    try:
        wait_for(serving, 30)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def kill_9(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


class Queue:
    """The test's own view of the queue (what ``freeride ls --queue`` reads). Its reads wait up to 10 s: the test
    server fsyncs every write (``appendfsync always``), and on a CI machine's busy disk one fsync held a read of
    the record past the client's default 2 s (a placement test failed "cannot reach the queue")."""

    def __init__(self, url: str) -> None:
        self.q = RedisQueue(parse_queue_url(url), timeout_s=10.0)
        self.q.connect()

    def record(self, task_id: str) -> ClusterRecord:
        found = self.q.record(task_id)
        assert found is not None, f"no record of {task_id}"
        return found

    def close(self) -> None:
        self.q.close()
