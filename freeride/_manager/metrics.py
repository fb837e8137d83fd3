"""Prometheus metrics of one manager: a collector that asks the loop on each scrape, and its server.

One source of truth: on every scrape :class:`ManagerCollector` asks the loop for the same
``GetStats`` and ``ListTasks`` answers that the Stats and List RPCs serve, through the loop's
thread-safe request path (:meth:`ManagerLoop.call_async`), and turns them into metric families.
The loop keeps no bookkeeping of its own for metrics.

A scrape must neither hold up bubble handling nor hang on a stuck loop:

* both requests are posted together and awaited with one deadline (``timeout_s``). Past it the
  scrape serves what needs no answer from the loop (uptime, the loop's plain event counters),
  ``freeride_loop_responsive 0`` and the count of such timeouts, and leaves the rest out (an
  exporter that cannot read a figure omits it rather than repeat a stale value);
* while an earlier pair of requests is still unanswered, later scrapes wait on that pair instead of
  posting more, so a stuck loop's inbox does not grow with every scrape;
* an answer is reused for ``min_interval_s``: however often ``/metrics`` is fetched, the loop
  computes its statistics (sorting its percentile windows) at most once per interval.

Percentiles come from the loop's sliding windows (the last 10,000 samples), which have neither a
monotonic count nor a sum. A Prometheus *summary* promises both (its ``_count`` and ``_sum`` are
counters that ``rate()`` is applied to), so the windows are exposed as *gauges with a quantile
label* (0.5, 0.9, 0.99, and 1 for the maximum). Users query them exactly as they would a
summary's quantiles (``freeride_grant_latency_seconds{quantile="0.99"}``), and no series claims
to be a counter when it is not; the totals are separate counters (``freeride_overruns_total``).
Times are in seconds and sizes in bytes, Prometheus' base units. Every family has a ``device``
label, so one Prometheus scraping the managers of a whole job can tell them apart.

Per-task gauges cover live tasks only: a task's series end when it finishes, fails or is cancelled,
which keeps the number of series bounded by the live tasks (``freeride_tasks{state=...}`` still
counts the finished ones).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from freeride._manager.requests import GetStats, ListTasks, Request
from freeride.errors import ConfigError
from freeride.messages import ManagerStats, Percentiles, QueueStats, TaskInfo
from freeride.states import TaskState

log = logging.getLogger(__name__)

#: How long a scrape waits for the loop before serving what it can.
DEFAULT_TIMEOUT_S = 1.0
#: How long one answer of the loop is reused by later scrapes.
DEFAULT_MIN_INTERVAL_S = 1.0
DEFAULT_ADDRESS = "127.0.0.1"

_QUANTILES = (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"), ("1", "max"))


class LoopView(Protocol):
    """What the collector needs of a :class:`~freeride._manager.loop.ManagerLoop` (tests pass fakes)."""

    device: Any
    started_unix: float

    @property
    def events_received(self) -> int: ...

    @property
    def events_rejected(self) -> int: ...

    @property
    def messages_dropped(self) -> int: ...

    def call_async(self, request: Request) -> Future[Any]: ...


@dataclass(frozen=True)
class Snapshot:
    """One answer of the loop: its statistics and its live tasks, and when it was asked."""

    stats: ManagerStats
    tasks: list[TaskInfo]
    at_monotonic: float


class ManagerCollector:
    """A prometheus_client collector that reads one manager's loop at scrape time."""

    def __init__(
        self,
        loop: LoopView,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"the metrics timeout must be > 0 s, got {timeout_s}")
        if not min_interval_s >= 0:
            raise ConfigError(f"the metrics cache interval must be >= 0 s, got {min_interval_s}")
        self._loop = loop
        self._timeout_s = timeout_s
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()  # one scrape at a time asks the loop; the others reuse its answer
        self._pending: tuple[Future[Any], Future[Any], float] | None = None  # stats, tasks, asked at
        self._cached: Snapshot | None = None
        self._count_lock = threading.Lock()
        self.timeouts = 0

    def describe(self) -> list[Metric]:
        # Registering must not ask the loop (it may not run yet); names are not checked for clashes.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snapshot = self.snapshot()
        except Exception:  # a scrape must never take anything down; serve what needs no loop
            log.exception("[%s] metrics: reading the manager loop failed", self._loop.device)
            snapshot = None
        yield from self._families(str(self._loop.device), snapshot)

    # ------------------------------------------------------------------ reading the loop

    def snapshot(self) -> Snapshot | None:
        """The loop's current answer, a recent cached one, or None if it did not answer in time."""
        deadline = time.monotonic() + self._timeout_s
        if not self._lock.acquire(timeout=self._timeout_s):
            self._count_timeout()  # another scrape has waited on the loop all this time
            return None
        try:
            cached = self._cached
            if cached is not None and time.monotonic() - cached.at_monotonic < self._min_interval_s:
                return cached
            if self._pending is None:
                self._pending = (
                    self._loop.call_async(GetStats()),
                    self._loop.call_async(ListTasks(include_finished=False)),
                    time.monotonic(),
                )
            stats_future, tasks_future, asked_at = self._pending
            remaining_s = max(0.0, deadline - time.monotonic())
            _, not_done = wait_futures((stats_future, tasks_future), timeout=remaining_s)
            if not_done:
                self._count_timeout()
                log.warning("[%s] metrics: the manager loop did not answer within %.1f s",
                            self._loop.device, self._timeout_s)
                return None
            self._pending = None  # answered (or failed): the next scrape asks afresh
            if stats_future.exception() is not None or tasks_future.exception() is not None:
                return None  # the loop has stopped: serve what needs no loop
            snapshot = Snapshot(stats_future.result(), tasks_future.result(), asked_at)
            self._cached = snapshot
            return snapshot
        finally:
            self._lock.release()

    def _count_timeout(self) -> None:
        with self._count_lock:
            self.timeouts += 1

    # ------------------------------------------------------------------ families

    def _families(self, device: str, snap: Snapshot | None) -> Iterator[Metric]:
        loop = self._loop
        stats = snap.stats if snap is not None else None

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["device"])
            family.add_metric([device], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["device"])
            family.add_metric([device], value)
            return family

        yield gauge("freeride_loop_responsive",
                    "1 if the manager loop answered this scrape in time; 0 if it did not (its figures are left out)",
                    1.0 if snap is not None else 0.0)
        yield counter("freeride_metrics_scrape_timeouts_total",
                      "scrapes that served partial figures because the manager loop did not answer in time",
                      self.timeouts)
        # Needs no loop: plain attributes, safe to read from this thread.
        yield gauge("freeride_uptime_seconds", "seconds since the manager started",
                    stats.uptime_s if stats is not None else max(0.0, time.time() - loop.started_unix))
        yield counter("freeride_events_received_total", "bubble events received from the trainer",
                      stats.events_received if stats is not None else loop.events_received)
        yield counter("freeride_events_rejected_total", "malformed bubble events rejected (the stream went on)",
                      stats.events_rejected if stats is not None else loop.events_rejected)
        yield counter("freeride_messages_dropped_total",
                      "grants and parks dropped because a worker was not reading its channel",
                      stats.messages_dropped if stats is not None else loop.messages_dropped)
        if snap is None or stats is None:
            return

        yield counter("freeride_bubbles_total", "bubbles seen", stats.bubbles)
        yield counter("freeride_bubble_seconds_total", "measured bubble time", stats.bubble_time_s)
        yield counter("freeride_granted_seconds_total", "bubble time granted to side tasks", stats.granted_s)
        yield counter("freeride_harvested_seconds_total", "bubble time side tasks spent stepping",
                      stats.harvested_s)
        yield counter("freeride_overruns_total", "grants whose side-task step still ran at the bubble's real end",
                      stats.overruns)
        yield counter("freeride_hung_overruns_total",
                      "of the overruns, those of a side-task step that looked hung (thawed at its turns)",
                      stats.hung_overruns)
        yield counter("freeride_events_ignored_total",
                      "well-formed bubble events ignored as out of order (an end without its start: a restart)",
                      stats.events_ignored)
        yield counter("freeride_events_late_total",
                      "bubble events read late on purpose (quiet slots held back by the trainer, or no task could use "
                      "any bubble): not timed as event delay", stats.events_late)
        yield counter("freeride_events_other_ranks_total",
                      "bubble events of trainer ranks other than the one the device follows (ignored)",
                      stats.events_other_ranks)
        yield counter("freeride_bubbles_while_shared_total",
                      "bubbles that ended while trainer ranks shared the device (their time not in bubble seconds)",
                      stats.bubbles_while_shared)
        yield gauge("freeride_shared_by_ranks",
                    "trainer ranks that share the device now (0: one rank, or none); nothing is granted while they do",
                    len(stats.shared_by_ranks))
        yield _quantiles("freeride_overrun_seconds", "how far overrunning steps ran past the bubble's real end "
                         "(recent window; quantile 1 is the maximum)", device, stats.overrun_ms)
        yield _quantiles("freeride_grant_latency_seconds", "bubble start received to a side task's first step "
                         "(recent window; quantile 1 is the maximum)", device, stats.grant_latency_ms)
        yield _quantiles("freeride_park_latency_seconds", "bubble end received to the side task parked or frozen "
                         "(recent window; quantile 1 is the maximum)", device, stats.park_latency_ms)
        if stats.memory_budget_bytes >= 0:  # unknown until the first memory sample: left out
            yield gauge("freeride_memory_budget_bytes", "device memory side tasks may still be given",
                        stats.memory_budget_bytes)
        yield gauge("freeride_draining", "1 while the manager drains (accepts no new tasks)",
                    1.0 if stats.draining else 0.0)
        if stats.queue is not None:
            yield from _queue_families(gauge, counter, stats.queue)

        by_state = GaugeMetricFamily("freeride_tasks", "tasks known to the manager, by state",
                                     labels=["device", "state"])
        states = [s.value for s in TaskState] + sorted(set(stats.tasks_by_state) - {s.value for s in TaskState})
        for state in states:  # every state, zeros included, so series do not come and go
            by_state.add_metric([device, state], stats.tasks_by_state.get(state, 0))
        yield by_state

        labels = ["device", "task", "name"]
        progress = GaugeMetricFamily("freeride_task_progress", "a live task's progress in its own unit",
                                     labels=[*labels, "unit"])
        steps = GaugeMetricFamily("freeride_task_steps", "steps a live task has completed", labels=labels)
        harvested = GaugeMetricFamily("freeride_task_harvested_seconds", "bubble time a live task spent stepping",
                                      labels=labels)
        for info in snap.tasks:
            key = [device, info.task_id, info.spec.display_name]
            progress.add_metric([*key, info.progress_unit or "steps"], info.progress or float(info.steps))
            steps.add_metric(key, info.steps)
            harvested.add_metric(key, info.harvested_s)
        yield progress
        yield steps
        yield harvested


def _queue_families(gauge: Callable[[str, str, float], Metric], counter: Callable[[str, str, float], Metric],
                    q: QueueStats) -> Iterator[Metric]:
    """The manager's part in the cluster queue (``--queue``): the queue's depth and set-aside records as this
    manager's agent last saw them (every manager reports the same figure; take the max across devices), and
    this manager's own counts."""
    yield gauge("freeride_queue_connected", "1 if the queue agent reached the queue's Redis at its last poll",
                1.0 if q.connected else 0.0)
    yield gauge("freeride_queue_depth", "tasks waiting in the cluster queue", q.depth)
    yield gauge("freeride_queue_set_aside", "records the cluster queue set aside (cannot be read or used)",
                q.set_aside)
    yield gauge("freeride_queue_held", "cluster tasks this manager holds", q.held)
    yield counter("freeride_queue_claims_total", "cluster tasks this manager claimed", q.claims)
    yield counter("freeride_queue_reclaims_total",
                  "expired leases this manager's sweeps returned to the queue", q.reclaims)
    yield counter("freeride_queue_lease_renewals_total", "lease renewals (one per held task per round)",
                  q.renewals)
    yield counter("freeride_queue_lost_total", "cluster tasks this manager lost to another (its lease expired)",
                  q.lost)
    yield counter("freeride_queue_set_aside_total", "queue records this manager set aside", q.set_aside_here)
    yield counter("freeride_queue_errors_total", "queue polls that failed (Redis unreachable or erring)",
                  q.errors)
    yield counter("freeride_queue_sweep_graces_total",
                  "times sweeps were held back a lease after a Redis restart or an outage every manager saw",
                  q.graces)


def _quantiles(name: str, doc: str, device: str, window_ms: Percentiles) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["device", "quantile"])
    if window_ms.count:  # an empty window has no quantiles: no samples rather than zeros
        for quantile, attr in _QUANTILES:
            family.add_metric([device, quantile], getattr(window_ms, attr) / 1000.0)
    return family


# ---------------------------------------------------------------------- the HTTP server


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Scrapes are not worth a log line each."""


class MetricsServer:
    """Serves ``/metrics`` for one manager over HTTP, on threads of its own.

    ``port=0`` picks a free port (read :attr:`port` after :meth:`start`). Each request is handled on
    its own thread (prometheus_client's threaded WSGI server), so a slow scrape blocks neither the
    loop nor other scrapes. The endpoint has no authentication: it binds to loopback by default, and
    a wider address exposes task names and figures to whoever can reach it.
    """

    def __init__(
        self,
        loop: LoopView,
        address: str = DEFAULT_ADDRESS,
        port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"the metrics port must be in [0, 65535] (0: any free port), got {port}")
        if not address:
            raise ConfigError("the metrics address must not be empty (e.g. 127.0.0.1, or 0.0.0.0 for all)")
        self.address = address
        self.requested_port = port
        self.collector = ManagerCollector(loop, timeout_s=timeout_s, min_interval_s=min_interval_s)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # the manager process's own CPU, memory and fds
        self._device = str(loop.device)
        self._httpd: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when 0 was asked for); 0 before :meth:`start`."""
        return int(self._httpd.server_port) if self._httpd is not None else 0

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve; raises :class:`ConfigError` if the address cannot be bound (port in use)."""
        where = f"{self.address}:{self.requested_port}"
        try:
            infos = socket.getaddrinfo(self.address, self.requested_port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise ConfigError(f"cannot serve metrics on {where}: unknown address ({exc.strerror})") from None
        family = infos[0][0]

        class _Server(ThreadingWSGIServer):
            address_family = family

        try:
            httpd = make_server(self.address, self.requested_port, make_wsgi_app(self.registry), _Server,
                                handler_class=_QuietHandler)
        except OSError as exc:
            hint = "; is another manager using it? pick another --metrics-port" if self.requested_port else ""
            raise ConfigError(f"cannot serve metrics on {where}: {exc.strerror or exc}{hint}") from None
        self._httpd = httpd
        # A short poll interval keeps stop() quick; the thread is otherwise idle in select().
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"metrics-{self._device}", daemon=True)
        self._thread.start()
        log.info("[%s] metrics on %s", self._device, self.url)

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(2.0)
