"""Shared fixtures: an in-process manager on a temporary socket, and a bubble trace replayer."""

from __future__ import annotations

import os
import queue
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings

from freeride._channel import MANAGER_MESSAGES, Channel, socketpair
from freeride._manager.core import CoreConfig
from freeride._manager.daemon import Manager
from freeride._wire.client import BubbleStream, ControlClient
from freeride.endpoints import Endpoint
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart, TaskInfo, TaskSpec

TESTS_DIR = Path(__file__).resolve().parent
MS = 1_000_000

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# Property tests explore new examples on a developer's machine (and remember failing ones in
# .hypothesis/); in CI they replay the same derandomized examples, so that a red run is
# reproducible and a green one does not depend on luck. $HYPOTHESIS_PROFILE picks one explicitly.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session", autouse=True)
def _no_socket_files_left_in_tmp() -> Iterator[None]:
    """Remove, when the session ends, the unix socket paths our tests made in /tmp (short names: pytest's own
    directories are too long for a socket) and what a manager keeps beside its socket (``.ends``, ``.events``),
    which a manager killed on purpose leaves behind: a stranger counted hundreds of them."""
    yield
    pid = os.getpid()
    for pattern in (f"fr-*-{pid}.sock*", f"fr-{pid}-*.sock*"):
        for path in Path("/tmp").glob(pattern):
            if not path.is_dir():
                path.unlink(missing_ok=True)


def cpu_devices(count: int = 1) -> list[str]:
    """``count`` distinct ``cpu:N`` devices this process may run on, from ``os.sched_getaffinity``.

    Tests never name core numbers: a CI runner or a ``taskset`` may allow any set of cores. A test that
    needs more cores than it is allowed is skipped, saying how many it needed.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < count:
        pytest.skip(f"needs {count} CPU cores, this process may use {len(allowed)}")
    return [f"cpu:{core}" for core in allowed[:count]]


def now_ns() -> int:
    """The host's ``CLOCK_MONOTONIC`` now: the only base for a timestamp a test sends to a manager.

    A manager rejects bubble times ahead of its own clock, and a machine that booted a minute ago has a
    clock of about 60 s: a fixed base such as 1,000 s fails there.
    """
    return time.monotonic_ns()


def wait_for(predicate: Callable[[], object], timeout_s: float = 20.0, interval_s: float = 0.02,
             what: str | None = None) -> object:
    """Poll until ``predicate()`` is truthy; fail the test with a clear message at the deadline.

    The way tests synchronise with other threads and processes: on an observable condition, with a
    deadline generous enough for a loaded 2-core machine, never a sleep that hopes.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout_s} s: {predicate}")
        time.sleep(interval_s)


def holds_for(predicate: Callable[[], object], duration_s: float, what: str, interval_s: float = 0.01) -> None:
    """Check that something stays true for ``duration_s``: the only honest form of "nothing happened".

    A negative can only be observed for a while; the failure names what was expected and for how long,
    and the check fails as soon as it breaks rather than at the end.
    """
    deadline = time.monotonic() + duration_s
    while True:
        if not predicate():
            raise AssertionError(f"expected for {duration_s} s: {what}; it broke after "
                                 f"{duration_s - max(0.0, deadline - time.monotonic()):.3f} s")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval_s)


@dataclass
class Bubble:
    start_ns: int
    predicted_end_ns: int
    end_ns: int


@dataclass
class BubbleFeeder:
    """Replays a generated bubble trace in real time over a real Trainer stream."""

    endpoint: Endpoint
    stage: int = 0
    rank: int = 0
    free_memory_bytes: int = 8 * 2**30
    sent: list[Bubble] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._q: queue.Queue[BubbleEvent | None] = queue.Queue()
        self._iteration = 0
        self.stream = BubbleStream(self.endpoint, self._events())

    def _events(self) -> Iterator[BubbleEvent]:
        while True:
            event = self._q.get()
            if event is None:
                return
            yield event

    def send(self, event: BubbleEvent) -> None:
        self._q.put(event)

    def bubble(self, length_ms: float, predicted_ms: float | None = None, gap_ms: float = 5.0) -> Bubble:
        """One bubble: start, wait ``length_ms``, end; then ``gap_ms`` of 'compute'."""
        predicted_ms = length_ms if predicted_ms is None else predicted_ms
        it = self._iteration
        self._iteration += 1
        start = time.monotonic_ns()
        self.send(BubbleStart(self.stage, self.rank, it, 0, "test", start, int(predicted_ms * MS),
                              self.free_memory_bytes))
        time.sleep(length_ms / 1000)
        end = time.monotonic_ns()
        self.send(BubbleEnd(self.stage, self.rank, it, 0, end))
        time.sleep(gap_ms / 1000)
        record = Bubble(start, start + int(predicted_ms * MS), end)
        self.sent.append(record)
        return record

    def run(self, count: int, length_ms: float, predicted_ms: float | None = None, gap_ms: float = 5.0) -> None:
        for _ in range(count):
            self.bubble(length_ms, predicted_ms, gap_ms)

    def run_until(self, predicate: Callable[[], object], length_ms: float = 20.0, timeout_s: float = 30.0,
                  gap_ms: float = 5.0, predicted_ms: float | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                with ControlClient(self.endpoint) as client:
                    tasks = [(t.task_id, t.state, t.steps, t.waiting_reason, t.failure) for t in client.list()]
                raise AssertionError(f"condition not met within {timeout_s} s of bubbles; tasks: {tasks}")
            self.bubble(length_ms, predicted_ms, gap_ms=gap_ms)

    def close(self) -> tuple[int, int]:
        self._q.put(None)
        try:
            return self.stream.result(10)
        finally:
            self.stream.close()


@dataclass
class ManagerHarness:
    manager: Manager
    client: ControlClient
    tmp: Path

    @property
    def endpoint(self) -> Endpoint:
        return self.manager.endpoint

    def submit(self, target: str, memory_mib: int = 512, **kw: object) -> TaskInfo:
        args = kw.pop("args", {})
        return self.client.submit(
            TaskSpec(target=target, args=dict(args), memory_bytes=memory_mib * 2**20,  # type: ignore[arg-type]
                     working_dir=str(TESTS_DIR), **kw)  # type: ignore[arg-type]
        )

    def wait_state(self, task_id: str, *states: str, timeout_s: float = 30.0) -> TaskInfo:
        wait_for(lambda: self.client.get(task_id).state in states, timeout_s)
        return self.client.get(task_id)

    def feeder(self, **kw: object) -> BubbleFeeder:
        return BubbleFeeder(self.endpoint, **kw)  # type: ignore[arg-type]


@pytest.fixture
def make_manager(tmp_path: Path) -> Iterator[Callable[..., ManagerHarness]]:
    """Start in-process managers (on this process's first allowed core unless ``device=`` says otherwise),
    with temporary sockets and state; stopped at teardown."""
    started: list[ManagerHarness] = []
    device = cpu_devices(1)[0]

    def make(trace_path: Path | None = None, device: str = device, event_spin_ns: int = 0,
             trainer_stops: bool = True, **core: object) -> ManagerHarness:
        index = len(started)
        sock = Path(f"/tmp/fr-{os.getpid()}-{id(tmp_path) % 10**6}-{index}.sock")
        manager = Manager(
            device,
            endpoint=Endpoint("unix", str(sock)),
            state_dir=tmp_path / f"state{index}",
            core=CoreConfig(**core),  # type: ignore[arg-type]
            memory_poll_ms=20.0,
            trace_path=trace_path,
            event_spin_ns=event_spin_ns,
            trainer_stops=trainer_stops,
        )
        manager.start()
        harness = ManagerHarness(manager, ControlClient(manager.endpoint), tmp_path)
        started.append(harness)
        return harness

    yield make
    for harness in started:
        harness.client.close()
        harness.manager.stop()


@pytest.fixture
def harness(make_manager: Callable[..., ManagerHarness]) -> ManagerHarness:
    return make_manager()


def redis_binary() -> str:
    """The ``redis-server`` binary for the cluster-queue tests.

    Missing, it fails the test under CI (``$CI`` set: the setup installs it, so its absence is a broken
    setup, not a reason to pass) and skips it, saying why, on a developer's machine without it.
    """
    path = shutil.which("redis-server")
    if path is None:
        message = ("redis-server is not installed (scripts/setup.sh installs it when run as root; "
                   "apt-get install redis-server)")
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message + "; set CI to make this a failure")
    try:
        import redis  # noqa: F401
    except ImportError:
        message = "the redis client is not installed (pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture
def redis_server() -> Iterator[object]:
    """A real redis-server on a unix socket in a temporary directory (see ``tests/redis_server.py``)."""
    from redis_server import remove, start_redis

    server = start_redis(redis_binary())
    try:
        yield server
    finally:
        remove(server)


def read_steps(work_dir: Path) -> list[tuple[int, int]]:
    path = work_dir / "steps.log"
    if not path.exists():
        return []
    return [tuple(int(x) for x in line.split()) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]


@pytest.fixture
def channels() -> Iterator[tuple[Channel, Channel]]:
    """Both ends of a worker channel: the manager's, then the worker's."""
    ours, theirs = socketpair()
    manager, worker = Channel(ours), Channel(theirs, accepts=MANAGER_MESSAGES)
    yield manager, worker
    manager.close()
    worker.close()
