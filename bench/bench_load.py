"""Sustained load on one manager daemon: a saturating bubble stream for a minute, hundreds of queued tasks.

    python -m bench.bench_load [--seconds 60] [--tasks 300] [--baseline-src DIR] [--out bench/results/cpu]
    python -m bench.bench_load --garbage-only [--garbage-requests 100000]   # phase 4 alone: load_garbage.*

Everything runs against real ``freeride manager`` subprocesses on ``cpu:0``, driven from this
process, whose main thread plays the training thread of one pipeline stage:

1. **Saturation** (``--seconds``, a fresh manager). A real :class:`~freeride.BubbleReporter` is fed
   the idle slots of one stage of a 1F1B schedule (``freeride.training.schedules``: slot indices, kinds and
   predicted lengths as a trainer would report them; start and end stamped with the real time) as
   fast as it takes them: the producer tops the reporter's queue up to ``--backlog`` events and
   never lets it overflow. Reported: events/s sent by the reporter and accepted by the manager (the
   stream's summary), the slowest and median second, reporter and manager drops, messages
   (mean batch size), CPU per event on each side, the manager's RSS every second (first and last
   after ``--warmup-s``, max, least-squares slope in MiB/min), and the event delay p50/p99/p999.
2. **Queued tasks**, during 1: at ``--submit-at-s`` this process submits ``--tasks`` tasks through
   the Control API, timing each call; their caps (16 GiB) exceed the budget that the trainer's own
   reports set (8 GiB free memory minus headroom), so they stay SUBMITTED: a few hundred worker
   processes would swamp the machine, and a resident task would be granted at every one of ~10^4
   bubbles a second, which measures the worker channel instead (``bench_control_plane`` measures
   grants). Every ``--list-every-s`` a List of all tasks is timed. After the stream, every task
   must still be listed, SUBMITTED.
3. **Paced** (``--paced-rate`` events/s for ``--paced-seconds``, a fresh manager): the event delay at
   the target rate, below saturation, where it is not dominated by the producer's backlog.
4. **Garbage** (``--garbage-requests``, a fresh manager): that many requests whose bytes do not parse
   as their RPC's message, round-robin over every method of Trainer, Control and health, from
   ``--garbage-threads`` client threads. Reported: the status codes and details they got (all
   INVALID_ARGUMENT), requests/s, and the manager's RSS before, every 10% of the way, and after.
   grpcio's own deserialisation failure path kept each such call's state for good (RSS 48 -> 141
   MiB over ~2,700 of them); see ``freeride._manager.servicers.add_raw_service``.
5. **Before/after** (only with ``--baseline-src``, a checkout of the code before batching, e.g.
   ``git archive <commit> | tar -x -C DIR``): saturation floods without tasks
   (``--compare-seconds`` each), alternating old and new code, ``--rounds`` times; and
   ``bench_control_plane``'s lone-event latency (bubble start -> first step) for both.

Event delay: the trainer's timestamp of an event (``start_ns`` or ``end_ns``) to the manager's loop
handing it to the scheduler core: the reporter's queue, the wire, the servicer and the loop's
inbox. The manager keeps it in a whole-run histogram (``ManagerStats.event_delay_ms``).
At saturation it is the depth of full buffers over the rate; phase 3 shows it below saturation.

Results: ``<out>/load.json`` and ``<out>/load.md`` with the machine, versions and load average.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2

from bench.bench_control_plane import start_manager
from bench.machine import machine_info
from freeride._wire import freeride_pb2
from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint
from freeride.measure import median, percentiles
from freeride.messages import TaskSpec
from freeride.training.reporter import BubbleReporter
from freeride.training.schedules import build_schedule

REPO = Path(__file__).resolve().parents[1]
MS = 1_000_000
MiB = 2**20
GiB = 2**30
#: Free memory every bubble start reports; with the default headroom it makes the device's budget.
REPORTED_FREE_BYTES = 8 * GiB
#: Cap of each queued task: above that budget, so none becomes resident.
QUEUED_TASK_BYTES = 16 * GiB


# ---------------------------------------------------------------- the trainer side


def stage_slots(stage: int) -> list[tuple[int, str, int]]:
    """(slot index, kind, predicted ns) of one stage's idle slots: 1F1B, 4 stages, 8 micro-batches."""
    schedule = build_schedule("1f1b", stages=4, microbatches=8, t_forward=1.0 * MS, t_backward=2.0 * MS)
    return [(s.index, s.kind, max(1, int(s.length))) for s in schedule.cyclic_slots(stage)]


def produce(
    reporter: BubbleReporter,
    slots: list[tuple[int, str, int]],
    seconds: float,
    backlog: int = 512,
    rate: float | None = None,
) -> int:
    """Report start+end pairs for ``seconds``; returns the number of events handed to the reporter.

    Without ``rate``: as fast as the reporter takes them, keeping at most ``backlog`` queued.
    With ``rate`` (events/s): on schedule, in small bursts every half millisecond.
    """
    iteration = slot = 0
    handed = 0
    started = time.monotonic()
    deadline = started + seconds
    while True:
        now = time.monotonic()
        if now >= deadline:
            return handed
        if rate is None:
            c = reporter.counters()
            room = backlog - (c.enqueued - c.sent - c.dropped)
            pairs = min(64, room // 2)
        else:
            pairs = min(64, (int((now - started) * rate) - handed) // 2)
        if pairs <= 0:
            time.sleep(0.0002 if rate is None else 0.0005)
            continue
        for _ in range(pairs):
            index, kind, predicted_ns = slots[slot]
            reporter.bubble_start(iteration, index, kind, predicted_ns, REPORTED_FREE_BYTES)
            reporter.bubble_end(iteration, index)
            slot += 1
            if slot == len(slots):
                slot = 0
                iteration += 1
        handed += 2 * pairs


# ---------------------------------------------------------------- helpers


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    p50, p90, p99, top = percentiles(values, (50, 90, 99, 100))  # the project's one definition
    return {"count": len(values), "p50": round(p50, 3), "p90": round(p90, 3), "p99": round(p99, 3),
            "max": round(top, 3)}


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if den == 0 else 60 * sum((t - mt) * (v - mv) for t, v in points) / den


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


@dataclass
class Manager:
    proc: subprocess.Popen[bytes]
    endpoint: Endpoint
    ps: psutil.Process

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def launch(tag: str) -> Manager:
    tmp = Path(tempfile.mkdtemp(prefix=f"fr-load-{tag}-"))
    sock = Path(f"/tmp/fr-load-{os.getpid()}-{tag}.sock")
    proc = start_manager(sock, tmp / "state")
    return Manager(proc, Endpoint("unix", str(sock)), psutil.Process(proc.pid))


@dataclass
class Sampler:
    """Once a second: the manager's RSS, and how many events the reporter sent so far."""

    manager: Manager
    reporter: BubbleReporter
    samples: list[dict[str, float]] = field(default_factory=list)
    t0: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        self.t0 = time.monotonic()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        t0 = self.t0
        while not self._stop.wait(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0)):
            self.samples.append({
                "t_s": round(time.monotonic() - t0, 3),
                "rss_mib": round(self.manager.ps.memory_info().rss / MiB, 3),
                "sent": self.reporter.counters().sent,
            })

    def stop(self) -> None:
        self._stop.set()


def stream(
    manager: Manager,
    seconds: float,
    stage: int,
    backlog: int,
    rate: float | None = None,
    during: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], Sampler]:
    """One reporter streaming for ``seconds`` (``during`` runs beside it on a thread)."""
    slots = stage_slots(stage)
    reporter = BubbleReporter("cpu:0", stage=stage, rank=stage, endpoint=manager.endpoint)
    with ControlClient(manager.endpoint) as client:
        deadline = time.monotonic() + 10
        while not reporter.counters().connected and time.monotonic() < deadline:
            time.sleep(0.01)
        before = client.stats()
        sampler = Sampler(manager, reporter)
        sampler.start()
        side = threading.Thread(target=during, daemon=True) if during else None
        if side:
            side.start()
        cpu0, mcpu0, t0 = time.process_time(), cpu_s(manager.ps), time.monotonic()
        handed = produce(reporter, slots, seconds, backlog, rate)
        wall = time.monotonic() - t0
        sampler.stop()  # every per-second figure is then a whole second of producing
        sent_at_deadline = reporter.counters().sent
        reporter.close(timeout_s=30)  # flushes the queue, then the manager's summary arrives
        cpu1, mcpu1 = time.process_time(), cpu_s(manager.ps)
        if side:
            side.join(120)
        counters = reporter.counters()
        after = client.stats()
    handled = after.events_received - before.events_received
    per_second = [b["sent"] - a["sent"] for a, b in zip(sampler.samples, sampler.samples[1:], strict=False)]
    result: dict[str, Any] = {
        "seconds": round(wall, 3),
        "stage": stage,
        "slots": [{"index": i, "kind": k, "predicted_ms": p / MS} for i, k, p in slots],
        "mode": "saturation" if rate is None else f"paced at {rate:.0f} events/s",
        "producer_backlog_events": backlog if rate is None else None,
        "events_handed_to_reporter": handed,
        "events_sent": counters.sent,
        "events_per_s_sent": round(sent_at_deadline / wall),
        "per_second_sent": {"min": min(per_second, default=0), "median": median(per_second or [0])},
        "reporter_dropped": counters.dropped,
        "messages": getattr(counters, "messages", None),
        "accepted": getattr(counters, "accepted", None),
        "rejected": getattr(counters, "rejected", None),
        "manager_dropped": getattr(counters, "manager_dropped", None),
        "manager_counted": handled,
        "events_per_s_accepted": round(getattr(counters, "accepted", handled) / wall),
        "client_cpu_us_per_event": round((cpu1 - cpu0) / max(1, counters.sent) * 1e6, 2),
        "manager_cpu_us_per_event": round((mcpu1 - mcpu0) / max(1, counters.sent) * 1e6, 2),
    }
    if counters.sent and result["messages"]:
        result["mean_batch_events"] = round(counters.sent / result["messages"], 1)
    delay = getattr(after, "event_delay_ms", None)
    if delay is not None:
        result["event_delay_ms"] = asdict(delay)
        result["manager_events_dropped"] = after.events_dropped
    return result, sampler


def memory_summary(samples: list[dict[str, float]], warmup_s: float) -> dict[str, Any]:
    """RSS figures over the samples taken from ``warmup_s`` on (the steady part of the run)."""
    steady = [(s["t_s"], s["rss_mib"]) for s in samples if s["t_s"] >= warmup_s]
    if not steady:
        return {"samples": len(samples)}
    return {
        "samples": len(samples),
        "warmup_s": round(warmup_s, 1),
        "first_mib": steady[0][1],
        "last_mib": steady[-1][1],
        "max_mib": max(v for _, v in steady),
        "slope_mib_per_min": round(slope_per_min(steady), 3),
        "series": [[s["t_s"], s["rss_mib"]] for s in samples],
    }


# ---------------------------------------------------------------- phases


def saturation_with_tasks(ns: argparse.Namespace) -> dict[str, Any]:
    manager = launch("sat")
    tasks: dict[str, Any] = {"submit_ms": [], "list_ms": [], "errors": [], "done_at": None}

    def queue_tasks() -> None:
        time.sleep(ns.submit_at_s)
        with ControlClient(manager.endpoint) as client:
            try:
                for k in range(ns.tasks):
                    spec = TaskSpec(target="bench.bench_tasks:SpinStep", args={"step_us": 100},
                                    memory_bytes=QUEUED_TASK_BYTES, name=f"queued-{k}", working_dir=str(REPO))
                    t = time.perf_counter()
                    client.submit(spec)
                    tasks["submit_ms"].append((time.perf_counter() - t) * 1e3)
                tasks["done_at"] = time.monotonic()
                end = time.monotonic() + ns.seconds - ns.submit_at_s
                while time.monotonic() + ns.list_every_s < end:
                    time.sleep(ns.list_every_s)
                    t = time.perf_counter()
                    listed = client.list()
                    tasks["list_ms"].append((time.perf_counter() - t) * 1e3)
                    tasks["listed"] = len(listed)
            except Exception as exc:  # noqa: BLE001 - recorded in the results, the stream goes on
                tasks["errors"].append(repr(exc))

    try:
        result, sampler = stream(manager, ns.seconds, ns.stage, ns.backlog, during=queue_tasks)
        with ControlClient(manager.endpoint) as client:
            final = client.list()
            stats = client.stats()
        # Steady state: after the warm-up and after the last submission (each task adds a few KiB).
        submitted_s = (tasks["done_at"] - sampler.t0) if tasks["done_at"] else 0.0
        result["memory"] = memory_summary(sampler.samples, max(ns.warmup_s, submitted_s + 1))
        result["tasks"] = {
            "submitted": len(tasks["submit_ms"]),
            "submissions_done_at_s": round(submitted_s, 1),
            "submit_ms": pct(tasks["submit_ms"]),
            "list_calls": len(tasks["list_ms"]),
            "list_ms": pct(tasks["list_ms"]),
            "present_after": len(final),
            "states_after": stats.tasks_by_state,
            "all_present_and_submitted": len(final) == ns.tasks and all(t.state == "SUBMITTED" for t in final),
            "errors": tasks["errors"],
        }
    finally:
        manager.stop()
    return result


def paced(ns: argparse.Namespace) -> dict[str, Any]:
    manager = launch("paced")
    try:
        result, sampler = stream(manager, ns.paced_seconds, ns.stage, ns.backlog, rate=ns.paced_rate)
        result["memory"] = memory_summary(sampler.samples, min(ns.warmup_s, ns.paced_seconds / 2))
        result["memory"].pop("series", None)
    finally:
        manager.stop()
    return result


#: Bytes that parse as no message: tags and varints that never end.
GARBAGE = b"\xff" * 16


def garbage_methods() -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method the manager serves."""
    return [
        (f"/{service.full_name}/{method.name}", method.client_streaming, method.server_streaming)
        for module, name in ((freeride_pb2, "Trainer"), (freeride_pb2, "Control"), (health_pb2, "Health"))
        for service in (module.DESCRIPTOR.services_by_name[name],)
        for method in service.methods
    ]


def garbage(ns: argparse.Namespace) -> dict[str, Any]:
    """``--garbage-requests`` undecodable requests: their answers, and the manager's RSS throughout."""
    manager = launch("garbage")
    methods = garbage_methods()
    outcomes: collections.Counter[str] = collections.Counter()
    details: dict[str, str] = {}
    rss: list[tuple[int, float]] = []
    lock = threading.Lock()
    sent = 0

    def one(channel: grpc.Channel, index: int) -> None:
        path, client_streaming, server_streaming = methods[index % len(methods)]
        try:
            if client_streaming:
                channel.stream_unary(path, request_serializer=None, response_deserializer=None)(iter([GARBAGE]),
                                                                                               timeout=10)
            elif server_streaming:
                list(channel.unary_stream(path, request_serializer=None, response_deserializer=None)(GARBAGE,
                                                                                                    timeout=10))
            else:
                channel.unary_unary(path, request_serializer=None, response_deserializer=None)(GARBAGE, timeout=10)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() else "UNKNOWN"
            with lock:
                details.setdefault(f"{path} {code}", (exc.details() or "")[:200])
        with lock:
            outcomes[code] += 1

    def worker(first: int, count: int, step: int) -> None:
        nonlocal sent
        with grpc.insecure_channel(manager.endpoint.grpc_target) as channel:
            for k in range(count):
                one(channel, first + k * step)
                with lock:
                    sent += 1

    def rss_mib() -> float:
        return round(manager.ps.memory_info().rss / MiB, 3)

    try:
        warm = max(len(methods) * 20, 1000)
        worker(0, warm, 1)  # every path once and again: first-call allocations are not growth
        outcomes.clear()
        before = rss_mib()
        sent = 0
        total, threads = ns.garbage_requests, max(1, ns.garbage_threads)
        pool = [threading.Thread(target=worker, args=(i, total // threads + (i < total % threads), threads),
                                 daemon=True) for i in range(threads)]
        t0 = time.monotonic()
        for thread in pool:
            thread.start()
        mark = 0
        while any(t.is_alive() for t in pool):
            time.sleep(0.2)
            if sent >= mark:
                rss.append((sent, rss_mib()))
                mark += max(1, total // 10)
        wall = time.monotonic() - t0
        time.sleep(1.0)
        after = rss_mib()
        with ControlClient(manager.endpoint) as client:
            stats = client.stats()
    finally:
        manager.stop()
    return {
        "requests": sum(outcomes.values()),
        "threads": threads,
        "methods": [m[0] for m in methods],
        "bytes": GARBAGE.hex(),
        "outcomes": dict(outcomes),
        "details": details,
        "wall_s": round(wall, 2),
        "requests_per_s": round(sum(outcomes.values()) / wall),
        "rss_before_mib": before,
        "rss_after_mib": after,
        "rss_growth_mib": round(after - before, 3),
        "rss_series": rss,
        "bytes_per_request": round((after - before) * MiB / max(1, sum(outcomes.values())), 2),
        "events_received": stats.events_received,
    }


def garbage_only(ns: argparse.Namespace) -> int:
    results: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python -m bench.bench_load", *sys.argv[1:]]),
        "note": ns.note,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    results["garbage"] = garbage(ns)
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "load_garbage.json").write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    text = "\n".join([
        "# Undecodable requests against one manager",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, grpcio {m['versions']['grpcio']}, "
        f"protobuf {m['versions']['protobuf']}. Load average at start {results['loadavg_start']}, at end "
        f"{results['loadavg_end']} (the machine is shared: re-run on a quiet one for figures to quote). "
        f"{results['note']} Command: `{results['command']}`.",
        "",
        *render_garbage(results["garbage"])[2:],
    ])
    (ns.out / "load_garbage.md").write_text(text)
    print(text)
    return 0


def flood_only(ns: argparse.Namespace) -> int:
    """One saturation flood without tasks, for ``--baseline-src`` comparisons (old code may run it)."""
    manager = launch("cmp")
    try:
        result, _ = stream(manager, ns.seconds, ns.stage, ns.backlog)
    finally:
        manager.stop()
    Path(ns.json_out).write_text(json.dumps(result))
    return 0


def compare(ns: argparse.Namespace) -> dict[str, Any]:
    """Old and new code in alternation: floods, then the control-plane bench's lone-event latency."""
    sources = {"before": Path(ns.baseline_src).resolve(), "after": REPO}
    floods: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for _ in range(ns.rounds):
        for label, src in sources.items():
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                env = {**os.environ, "PYTHONPATH": str(src)}
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--flood-only", "--seconds",
                                str(ns.compare_seconds), "--backlog", str(ns.backlog), "--json-out", out.name],
                               env=env, cwd=src, check=True)
                floods[label].append(json.loads(Path(out.name).read_text()))
    latency: dict[str, Any] = {}
    for label, src in sources.items():
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "PYTHONPATH": str(src)}
            subprocess.run([sys.executable, "-m", "bench.bench_control_plane", "--bubbles", str(ns.latency_bubbles),
                            "--flood-events", "2", "--out", out], env=env, cwd=src, check=True,
                           stdout=subprocess.DEVNULL)
            paced_cp = json.loads((Path(out) / "control_plane.json").read_text())["paced"]
            latency[label] = {k: paced_cp[k] for k in ("grant_latency_ms", "park_latency_ms", "bubbles")}
    summary = {}
    for label, runs in floods.items():
        rates = [r["events_per_s_sent"] for r in runs]
        summary[label] = {
            "events_per_s": {"best": max(rates), "median": median(rates), "runs": rates},
            "client_cpu_us_per_event": median(r["client_cpu_us_per_event"] for r in runs),
            "manager_cpu_us_per_event": median(r["manager_cpu_us_per_event"] for r in runs),
        }
    return {"baseline_src": str(sources["before"]), "floods": summary, "flood_runs": floods,
            "lone_event_latency": latency}


# ---------------------------------------------------------------- report


def _p(p: dict[str, Any], keys: tuple[str, ...] = ("p50", "p99", "p999", "max")) -> str:
    return " / ".join(f"{p.get(k, 0):.3f}" for k in keys)


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    sat, pac = results["saturation"], results["paced"]
    mem, tasks = sat["memory"], sat["tasks"]
    lines = [
        "# Sustained load (one manager on cpu:0, one trainer stream)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, grpcio {m['versions']['grpcio']}, "
        f"protobuf {m['versions']['protobuf']}. Load average at start {results['loadavg_start']}, at end "
        f"{results['loadavg_end']}. {results['note']} Command: `{results['command']}`.",
        "",
        "## Saturating stream with queued tasks",
        "",
        f"One `BubbleReporter` (stage {sat['stage']} of 1F1B, 4 stages x 8 micro-batches: "
        f"{len(sat['slots'])} idle slots an iteration) fed start+end pairs as fast as it takes them "
        f"(at most {sat['producer_backlog_events']} events queued), for {sat['seconds']} s; "
        f"{tasks['submitted']} tasks submitted from {results['args']['submit_at_s']} s to "
        f"{tasks['submissions_done_at_s']} s stay queued (caps above the budget). RSS figures start after "
        f"the warm-up ({results['args']['warmup_s']:.0f} s) and the last submission.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| events/s sent (whole run) | **{sat['events_per_s_sent']}** |",
        f"| events/s sent, slowest / median second | {sat['per_second_sent']['min']} / "
        f"{sat['per_second_sent']['median']} |",
        f"| events accepted by the manager (stream summary) | {sat['accepted']} of {sat['events_sent']} sent "
        f"({sat['events_per_s_accepted']}/s) |",
        f"| reporter drops / manager drops / rejected | {sat['reporter_dropped']} / {sat['manager_dropped']} / "
        f"{sat['rejected']} |",
        f"| messages (mean events per message) | {sat['messages']} ({sat.get('mean_batch_events')}) |",
        f"| CPU per event: trainer process / manager (us) | {sat['client_cpu_us_per_event']} / "
        f"{sat['manager_cpu_us_per_event']} |",
        f"| event delay p50 / p99 / p999 / max (ms) | {_p(sat['event_delay_ms'])} |",
        f"| manager RSS from {mem['warmup_s']:.0f} s on: first / last / max (MiB) | {mem['first_mib']:.1f} / "
        f"{mem['last_mib']:.1f} / {mem['max_mib']:.1f} |",
        f"| manager RSS slope (least squares over those samples) | {mem['slope_mib_per_min']:+.3f} MiB/min |",
        f"| that slope per event handled (an upper bound on any per-event leak) | "
        f"{mem['slope_mib_per_min'] * MiB / (60 * sat['events_per_s_accepted']):+.3f} bytes |",
        f"| submit latency p50 / p99 / max (ms), {tasks['submitted']} tasks | "
        f"{_p(tasks['submit_ms'], ('p50', 'p99', 'max'))} |",
        f"| List latency with {tasks['present_after']} tasks p50 / p99 / max (ms), {tasks['list_calls']} calls | "
        f"{_p(tasks['list_ms'], ('p50', 'p99', 'max'))} |",
        f"| all tasks present and SUBMITTED after the run | {tasks['all_present_and_submitted']} "
        f"({tasks['states_after']}) |",
        "",
        "At saturation every buffer on the path is full by construction (the producer's backlog, the 64 KiB "
        "HTTP/2 window, the loop's 2048-event inbox), so the event delay is their depth over the rate, "
        "stretched by CPU contention; the paced run below shows the delay under the saturation rate.",
        "",
        f"## Paced stream at {pac['mode'].split('at ')[-1]} (fresh manager, {pac['seconds']} s)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| events/s sent | {pac['events_per_s_sent']} |",
        f"| reporter drops / manager drops | {pac['reporter_dropped']} / {pac['manager_dropped']} |",
        f"| mean events per message | {pac.get('mean_batch_events')} |",
        f"| CPU per event: trainer process / manager (us) | {pac['client_cpu_us_per_event']} / "
        f"{pac['manager_cpu_us_per_event']} |",
        f"| event delay p50 / p99 / p999 / max (ms) | {_p(pac['event_delay_ms'])} |",
        "",
        "Event delay: the trainer's timestamp of a bubble start or end -> the manager's loop handing the event "
        "to the scheduler core (reporter queue, wire, servicer, loop inbox), from the manager's whole-run "
        "histogram (buckets within 1/32 of the value).",
        "",
    ]
    cmp_ = results.get("compare")
    if cmp_:
        b, a = cmp_["floods"]["before"], cmp_["floods"]["after"]
        lb, la = cmp_["lone_event_latency"]["before"], cmp_["lone_event_latency"]["after"]
        lines += [
            "## Before / after batching (same machine, one run, alternating)",
            "",
            f"Saturation floods without tasks, {results['args']['compare_seconds']} s each, "
            f"{len(b['events_per_s']['runs'])} per side; before = `{cmp_['baseline_src']}`.",
            "",
            "| figure | before | after |",
            "|---|---|---|",
            f"| events/s, best (median) | {b['events_per_s']['best']} ({b['events_per_s']['median']:.0f}) | "
            f"{a['events_per_s']['best']} ({a['events_per_s']['median']:.0f}) |",
            f"| CPU per event, trainer process (us, median) | {b['client_cpu_us_per_event']} | "
            f"{a['client_cpu_us_per_event']} |",
            f"| CPU per event, manager (us, median) | {b['manager_cpu_us_per_event']} | "
            f"{a['manager_cpu_us_per_event']} |",
            f"| lone event: bubble start -> first step p50 / p99 (ms) | {_p(lb['grant_latency_ms'], ('p50', 'p99'))} "
            f"| {_p(la['grant_latency_ms'], ('p50', 'p99'))} |",
            f"| lone event: bubble end -> worker parked p50 / p99 (ms) | {_p(lb['park_latency_ms'], ('p50', 'p99'))} "
            f"| {_p(la['park_latency_ms'], ('p50', 'p99'))} |",
            "",
            f"Lone-event latency from `bench.bench_control_plane --bubbles {lb['bubbles']}` run on each tree.",
            "",
        ]
    gar = results.get("garbage")
    if gar:
        lines += render_garbage(gar)
    return "\n".join(lines)


def render_garbage(gar: dict[str, Any]) -> list[str]:
    codes = ", ".join(f"{k} {v}" for k, v in sorted(gar["outcomes"].items()))
    example = next(iter(gar["details"].values()), "")
    return [
        "## Undecodable requests (fresh manager)",
        "",
        f"{gar['requests']} requests whose bytes (`{gar['bytes']}`) parse as no message, round-robin over "
        f"the {len(gar['methods'])} methods of Trainer, Control and health, from {gar['threads']} client "
        f"thread(s), after a warm-up of every path.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| answers | {codes} |",
        f"| an answer's details | `{example}` |",
        f"| requests/s | {gar['requests_per_s']} ({gar['wall_s']} s) |",
        f"| manager RSS before / after (MiB) | {gar['rss_before_mib']:.1f} / {gar['rss_after_mib']:.1f} |",
        f"| growth per request | {gar['bytes_per_request']:+.2f} bytes |",
        f"| RSS along the way (requests: MiB) | "
        f"{', '.join(f'{n}: {v:.1f}' for n, v in gar['rss_series'])} |",
        "",
        "Before (grpcio's own deserializer): INTERNAL \"Exception deserializing request!\", and 4-19 KiB kept "
        "per request for good (RSS 48 -> 141 MiB over ~2,700 of them).",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="saturation phase length")
    parser.add_argument("--tasks", type=int, default=300, help="tasks queued during the saturation phase")
    parser.add_argument("--submit-at-s", type=float, default=1.0, help="when the submissions start")
    parser.add_argument("--list-every-s", type=float, default=2.0, help="period of the timed List calls")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="RSS samples before this are warm-up")
    parser.add_argument("--backlog", type=int, default=512, help="most events the producer keeps queued")
    parser.add_argument("--stage", type=int, default=1, help="pipeline stage whose slots are reported (0-3)")
    parser.add_argument("--paced-rate", type=float, default=20_000.0, help="events/s of the paced phase")
    parser.add_argument("--paced-seconds", type=float, default=20.0, help="paced phase length (0: skip)")
    parser.add_argument("--baseline-src", type=Path, help="source tree of the code before, for a comparison")
    parser.add_argument("--compare-seconds", type=float, default=15.0, help="length of each comparison flood")
    parser.add_argument("--rounds", type=int, default=2, help="comparison floods per side")
    parser.add_argument("--latency-bubbles", type=int, default=1000, help="bubbles of the lone-event latency run")
    parser.add_argument("--garbage-requests", type=int, default=100_000,
                        help="undecodable requests of the garbage phase (0: skip)")
    parser.add_argument("--garbage-threads", type=int, default=2, help="client threads of the garbage phase")
    parser.add_argument("--garbage-only", action="store_true",
                        help="run the garbage phase alone; results in load_garbage.json and load_garbage.md")
    parser.add_argument("--note", default="", help="free text for the report (e.g. the machine was shared)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    parser.add_argument("--flood-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.flood_only:
        return flood_only(ns)
    if ns.garbage_only:
        return garbage_only(ns)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join(["python -m bench.bench_load", *sys.argv[1:]]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
        "note": ns.note,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    if ns.baseline_src:
        results["compare"] = compare(ns)
    results["saturation"] = saturation_with_tasks(ns)
    results["paced"] = paced(ns) if ns.paced_seconds > 0 else None
    results["garbage"] = garbage(ns) if ns.garbage_requests > 0 else None
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "load.json").write_text(json.dumps(results, indent=2) + "\n")
    if results["paced"] is not None:
        text = render(results)
        (ns.out / "load.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
