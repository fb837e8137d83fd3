"""The Prometheus endpoint of a real in-process manager, scraped over HTTP; and the collector on fakes.

Scrapes go through ``urllib`` and are parsed with prometheus_client's own text parser, so a test
fails on a malformed exposition as well as on a wrong value.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import ManagerHarness, cpu_devices, wait_for
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from freeride._manager.daemon import Manager
from freeride._manager.metrics import ManagerCollector, MetricsServer
from freeride._manager.requests import GetStats, ListTasks, Request
from freeride._wire.client import ControlClient
from freeride.cli import EXIT_BAD_INPUT, main
from freeride.endpoints import Endpoint
from freeride.errors import ConfigError
from freeride.messages import ManagerStats, Percentiles, QueueStats

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

REPO_ROOT = Path(__file__).resolve().parents[2]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as reply:
        assert reply.status == 200
        return parse(reply.read().decode())


def value(samples: Samples, metric: str, /, **labels: str) -> float | None:
    """The sample ``metric`` whose labels include ``labels`` (device cpu:0 unless given), or None."""
    wanted = {"device": DEVICE, **labels}.items()
    for (sample, sample_labels), v in samples.items():
        if sample == metric and wanted <= dict(sample_labels).items():
            return v
    return None


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="frm-"))  # unix socket paths are limited to about 100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def metered(short_dir: Path, tmp_path: Path) -> Iterator[ManagerHarness]:
    """A real in-process manager with metrics on an ephemeral port."""
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(short_dir / "m.sock")), state_dir=tmp_path / "state",
                      memory_poll_ms=20.0, metrics_port=0)
    manager.start()
    harness = ManagerHarness(manager, ControlClient(manager.endpoint), tmp_path)
    try:
        yield harness
    finally:
        harness.client.close()
        manager.stop()


def url_of(harness: ManagerHarness) -> str:
    assert harness.manager.metrics is not None
    return harness.manager.metrics.url


# ------------------------------------------------------------------ a real manager


EXPECTED_SAMPLES = [
    "freeride_loop_responsive",
    "freeride_metrics_scrape_timeouts_total",
    "freeride_uptime_seconds",
    "freeride_events_received_total",
    "freeride_events_rejected_total",
    "freeride_messages_dropped_total",
    "freeride_bubbles_total",
    "freeride_bubble_seconds_total",
    "freeride_granted_seconds_total",
    "freeride_harvested_seconds_total",
    "freeride_overruns_total",
    "freeride_hung_overruns_total",
    "freeride_events_ignored_total",
    "freeride_events_late_total",
    "freeride_events_other_ranks_total",
    "freeride_bubbles_while_shared_total",
    "freeride_shared_by_ranks",
    "freeride_memory_budget_bytes",
    "freeride_draining",
    "freeride_tasks",
]


def test_metrics_endpoint_serves_every_family_with_a_device_label(metered: ManagerHarness) -> None:
    samples = scrape(url_of(metered))
    for name in EXPECTED_SAMPLES:
        assert value(samples, name) is not None, name
    assert value(samples, "freeride_loop_responsive") == 1
    assert value(samples, "freeride_bubbles_total") == 0
    assert value(samples, "freeride_tasks", state="FINISHED") == 0  # every state, zeros included
    assert any(name == "process_cpu_seconds_total" for name, _ in samples)
    # Nothing measured yet: a percentile window without samples has no quantiles rather than zeros.
    assert value(samples, "freeride_grant_latency_seconds", quantile="0.99") is None


def test_metrics_move_after_bubbles_and_a_task(metered: ManagerHarness) -> None:
    url = url_of(metered)
    info = metered.submit("sample_tasks:Counter", memory_mib=64, args={"step_ms": 1}, name="ticker")

    def harvested() -> bool:
        stats = metered.client.stats()
        measured = stats.grant_latency_ms.count > 0 and stats.park_latency_ms.count > 0
        return measured and metered.client.get(info.task_id).steps >= 3

    feeder = metered.feeder()
    try:
        # Predicted longer than real: the real end finds the worker stepping, so a park latency is measured
        # (a worker that parks itself at the predicted end measures none).
        feeder.run_until(harvested, predicted_ms=60)
    finally:
        feeder.close()
    # Answers are reused for up to a second: poll until the scrape shows the task's steps.
    wait_for(lambda: (value(scrape(url), "freeride_task_steps", task=info.task_id) or 0) >= 3)
    samples = scrape(url)
    assert (value(samples, "freeride_bubbles_total") or 0) >= 1
    assert (value(samples, "freeride_bubble_seconds_total") or 0) > 0
    assert (value(samples, "freeride_events_received_total") or 0) >= 2
    assert (value(samples, "freeride_harvested_seconds_total") or 0) > 0
    assert value(samples, "freeride_grant_latency_seconds", quantile="0.99") is not None
    assert value(samples, "freeride_park_latency_seconds", quantile="1") is not None
    assert (value(samples, "freeride_task_progress", task=info.task_id, name="ticker", unit="ticks") or 0) >= 3
    assert (value(samples, "freeride_task_harvested_seconds", task=info.task_id) or 0) > 0
    live = sum(value(samples, "freeride_tasks", state=s) or 0 for s in ("PARKED", "RUNNING", "FROZEN"))
    assert live == 1

    metered.client.cancel(info.task_id)
    metered.wait_state(info.task_id, "CANCELLED")
    # A task's own series end with it; the state count keeps it.
    wait_for(lambda: value(scrape(url), "freeride_task_steps", task=info.task_id) is None)
    assert value(scrape(url), "freeride_tasks", state="CANCELLED") == 1


def test_scrape_of_a_stuck_loop_returns_partial_figures_and_adds_no_requests(
    metered: ManagerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = metered.manager.loop
    release = threading.Event()
    entered: list[int] = []
    real_stats = loop.views.stats

    def stuck_stats() -> ManagerStats:  # runs on the loop thread: the whole loop waits here
        entered.append(1)
        release.wait(30)
        return real_stats()

    monkeypatch.setattr(loop.views, "stats", stuck_stats)
    server = MetricsServer(loop, port=0, timeout_s=0.2, min_interval_s=0)
    server.start()
    try:
        first = scrape(server.url)
        assert value(first, "freeride_loop_responsive") == 0
        assert value(first, "freeride_uptime_seconds") is not None  # needs no loop
        assert value(first, "freeride_events_received_total") is not None
        assert value(first, "freeride_bubbles_total") is None  # needs the loop: left out, not stale
        second = scrape(server.url)
        assert value(second, "freeride_metrics_scrape_timeouts_total") == 2
        wait_for(lambda: entered)
        assert len(entered) == 1  # the second scrape waited on the first one's request

        release.set()
        wait_for(lambda: value(scrape(server.url), "freeride_loop_responsive") == 1)
        assert value(scrape(server.url), "freeride_bubbles_total") == 0
    finally:
        release.set()
        server.stop()


def test_metrics_server_stops_with_the_manager(short_dir: Path, tmp_path: Path) -> None:
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(short_dir / "m.sock")), state_dir=tmp_path / "state",
                      metrics_port=0)
    manager.start()
    assert manager.metrics is not None
    url = manager.metrics.url
    assert value(scrape(url), "freeride_loop_responsive") == 1
    manager.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_manager_command_announces_its_ephemeral_metrics_url_and_serves_it(short_dir: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", DEVICE, "--endpoint",
         f"unix:{short_dir / 'd.sock'}", "--state-dir", str(short_dir / "state"), "--metrics-port", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        announced = ""
        while "listening on" not in announced:
            line = proc.stderr.readline()
            assert line, f"the manager exited before announcing itself: {proc.communicate(timeout=30)[1]}"
            announced += line
        match = re.search(r"metrics on (http://127\.0\.0\.1:(\d+)/metrics)", announced)
        assert match is not None and int(match.group(2)) > 0, announced
        assert value(scrape(match.group(1)), "freeride_loop_responsive") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_metrics_port_in_use_is_a_config_error_and_leaves_no_socket(
    busy_port: int, short_dir: Path, tmp_path: Path
) -> None:
    sock = short_dir / "m.sock"
    manager = Manager(DEVICE, endpoint=Endpoint("unix", str(sock)), state_dir=tmp_path / "state",
                      metrics_port=busy_port)
    with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{busy_port}"):
        manager.start()
    assert not os.path.exists(sock)
    manager.loop.durability.store.close()


def test_manager_command_exits_2_when_the_metrics_port_is_in_use(
    busy_port: int, short_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["manager", "--device", DEVICE, "--endpoint", f"unix:{short_dir / 'm.sock'}",
                 "--state-dir", str(tmp_path / "state"), "--metrics-port", str(busy_port)])
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"cannot serve metrics on 127.0.0.1:{busy_port}" in err
    assert "--metrics-port" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metrics-port", "70000"], "metrics port must be in [0, 65535]"),
        (["--metrics-address", "0.0.0.0"], "--metrics-address needs --metrics-port"),
        (["--metrics-port", "0", "--metrics-address", "192.0.2.1"], "cannot serve metrics on 192.0.2.1:0"),
    ],
)
def test_manager_command_rejects_bad_metrics_options(
    argv: list[str], message: str, short_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["manager", "--device", DEVICE, "--endpoint", f"unix:{short_dir / 'm.sock'}",
                 "--state-dir", str(tmp_path / "state"), *argv])
    assert code == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ the collector on a fake loop


def _stats(bubbles: int, queue: QueueStats | None = None) -> ManagerStats:
    empty = Percentiles()
    return ManagerStats(
        device="cpu:7", uptime_s=5.0, bubbles=bubbles, bubble_time_s=0.5, granted_s=0.4, harvested_s=0.3,
        overruns=1, overrun_ms=Percentiles(1, 2.0, 2.0, 2.0, 2.0), grant_latency_ms=empty, park_latency_ms=empty,
        memory_budget_bytes=-1, tasks_by_state={"PARKED": 1, "MYSTERY": 2}, events_received=9, events_rejected=1,
        draining=False, messages_dropped=4, queue=queue, shared_by_ranks=(0, 2), events_other_ranks=6, events_ignored=5,
        bubbles_while_shared=9, events_late=3,
    )


class FakeLoop:
    """Answers requests at once (or with ``error``), counting them."""

    def __init__(self, error: Exception | None = None, queue: QueueStats | None = None) -> None:
        self.device = "cpu:7"
        self.queue = queue
        self.started_unix = 0.0
        self.events_received = 11
        self.events_rejected = 0
        self.messages_dropped = 0
        self.error = error
        self.requests: list[Request] = []

    def call_async(self, request: Request) -> Future[Any]:
        self.requests.append(request)
        future: Future[Any] = Future()
        if self.error is not None:
            future.set_exception(self.error)
        elif isinstance(request, GetStats):
            future.set_result(_stats(bubbles=sum(isinstance(r, GetStats) for r in self.requests), queue=self.queue))
        else:
            assert isinstance(request, ListTasks) and not request.include_finished
            future.set_result([])
        return future


def collect(collector: ManagerCollector) -> Samples:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def test_scrapes_within_the_interval_reuse_one_answer_of_the_loop() -> None:
    loop = FakeLoop()
    collector = ManagerCollector(loop, min_interval_s=3600)
    first, second = collect(collector), collect(collector)
    assert value(first, "freeride_bubbles_total", device="cpu:7") == 1
    assert value(second, "freeride_bubbles_total", device="cpu:7") == 1
    assert len(loop.requests) == 2  # one GetStats and one ListTasks for both scrapes
    assert value(first, "freeride_shared_by_ranks", device="cpu:7") == 2
    assert value(first, "freeride_events_other_ranks_total", device="cpu:7") == 6
    assert value(first, "freeride_events_ignored_total", device="cpu:7") == 5
    assert value(first, "freeride_events_late_total", device="cpu:7") == 3
    assert value(first, "freeride_bubbles_while_shared_total", device="cpu:7") == 9


def test_every_scrape_asks_the_loop_without_an_interval() -> None:
    loop = FakeLoop()
    collector = ManagerCollector(loop, min_interval_s=0)
    collect(collector)
    assert value(collect(collector), "freeride_bubbles_total", device="cpu:7") == 2


def test_collector_exposes_stats_figures_in_base_units() -> None:
    samples = collect(ManagerCollector(FakeLoop()))
    assert value(samples, "freeride_overrun_seconds", device="cpu:7", quantile="0.99") == pytest.approx(0.002)
    assert value(samples, "freeride_messages_dropped_total", device="cpu:7") == 4
    assert value(samples, "freeride_tasks", device="cpu:7", state="MYSTERY") == 2  # unknown states still count
    assert value(samples, "freeride_memory_budget_bytes", device="cpu:7") is None  # unknown yet: left out


def test_the_cluster_queues_figures_are_metrics_only_for_a_manager_on_a_queue() -> None:
    queue = QueueStats(connected=True, lease_ms=2000, depth=5, set_aside=2, held=1, claims=3, reclaims=1,
                       renewals=40, set_aside_here=1)
    samples = collect(ManagerCollector(FakeLoop(queue=queue)))
    expected = {"freeride_queue_depth": 5, "freeride_queue_set_aside": 2, "freeride_queue_claims_total": 3,
                "freeride_queue_reclaims_total": 1, "freeride_queue_lease_renewals_total": 40,
                "freeride_queue_set_aside_total": 1, "freeride_queue_held": 1, "freeride_queue_connected": 1}
    for name, figure in expected.items():
        assert value(samples, name, device="cpu:7") == figure, name
    assert value(collect(ManagerCollector(FakeLoop())), "freeride_queue_depth", device="cpu:7") is None


def test_a_failing_loop_request_serves_partial_figures_instead_of_an_error() -> None:
    loop = FakeLoop(error=RuntimeError("bug in _stats"))
    samples = collect(ManagerCollector(loop))
    assert value(samples, "freeride_loop_responsive", device="cpu:7") == 0
    assert value(samples, "freeride_events_received_total", device="cpu:7") == 11
    assert value(samples, "freeride_bubbles_total", device="cpu:7") is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ManagerCollector(FakeLoop(), timeout_s=0), "timeout must be > 0"),
        (lambda: ManagerCollector(FakeLoop(), min_interval_s=-1), "interval must be >= 0"),
        (lambda: MetricsServer(FakeLoop(), address=""), "must not be empty"),
        (lambda: MetricsServer(FakeLoop(), port=-1), "port must be in"),
    ],
)
def test_bad_metrics_settings_are_config_errors(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()
