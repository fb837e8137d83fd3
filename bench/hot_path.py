"""What the instrumentation costs the training thread per iteration: one harness for every adapter.

``bench.bench_schedules`` (torch's schedules, DeepSpeed, torchtitan) and ``bench.bench_megatron`` measure
their adapters here. A :class:`Case` is one pipeline rank's iteration replayed on its framework's real
action order (torch's ``pipeline_order_with_comms``, DeepSpeed's instruction stream, Megatron's timer
calls), each compute action ``compute_us`` of busy time and every transfer free: bare, and through the
adapter's hooks, the rank tracker and a real :class:`~freeride.training.reporter.BubbleReporter`
connected to a real manager. Batches of the two alternate in a fresh random order; the figure is the
median over pairs of the per-iteration difference, on the training thread pinned to one core, with the
manager (and the reporter's sender thread) on the others, as on a GPU host.

**Three routes**, the two a trainer on the manager's host can take (:class:`BubbleReporter`), the second
also to a manager kept awake:

``queue``
    ``local_events=False``: the training thread puts each event on the reporter's queue, and its
    sender thread, on a core of its own, streams it over gRPC (issue 21's "sender on its own core").
``local``
    the default: the training thread itself sends each event as one message on the manager's local
    socket (:mod:`freeride._local_events`), which wakes the manager's loop.
``awake``
    ``local`` to a second manager started with ``--event-spin-us`` (:data:`AWAKE_SPIN_US`): its loop turns
    without sleeping after each event, so that the next one finds it awake, as a manager with a core of its
    own may (``LoopConfig.event_spin_ns``): the send without the wake-up.

**Everything the real run reports is reported.** No wait lasts in a replay, and the tracker stops
reporting a planned position whose waits are all short (a bubble nothing fits in): the harness makes
every planned position report (``report_min_ns=0``), as the real runs' long waits do, so that the
events' cost is in the figure. (Until this harness, the replays reported nothing after their second
iteration, and the figures held the hooks and the bookkeeping only.)

``tracker``
    not a route: the adapter's hooks and the rank tracker with a sink that drops every event, so that the
    marks' own share of the figure shows (``python -m bench.hot_path --routes tracker,queue,local``).

**Spaced as in training.** Each action computes ``compute_us`` (300 us: longer than the manager takes to
handle an event), so the manager's loop is asleep when an event comes, as between a trainer's actions,
and the reporter's sender thread has sent the last event: a replay without compute would send a burst
that finds the manager awake (cheaper sends) or a queue still draining. Both sides compute alike; the
difference is the instrumentation's.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bench_control_plane import control_cpus, start_manager
from freeride.endpoints import Endpoint
from freeride.measure import median
from freeride.training.reporter import BubbleReporter
from freeride.training.tracker import BubbleSink

ROUTES = ("queue", "local", "awake")
#: The ``awake`` route's manager stays awake this long after each event: longer than the compute between two
#: events of a replayed iteration (a few actions of :data:`COMPUTE_US`), shorter than a bench run's gap
#: between iterations.
AWAKE_SPIN_US = 5000
#: The marks alone: every event dropped at the sink (module doc).
TRACKER = "tracker"
#: Busy time per compute action of a replay (module doc); the replays read it when they are built.
COMPUTE_US = 1000.0


def _bytes_per_us() -> float:
    """How many bytes SHA-256 hashes per microsecond here (best of a few tries)."""
    data = bytes(1 << 18)
    best_ns = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        hashlib.sha256(data)
        best_ns = min(best_ns, time.perf_counter_ns() - t0)
    return len(data) / max(best_ns / 1000, 1.0)


_compute_buffers: dict[float, bytes] = {}
#: Wall ns spent in :func:`compute` so far: a batch's time less this is the time between compute actions.
_computed_ns = 0


def compute(us: float) -> None:
    """A replayed compute action of about ``us`` microseconds, as a framework's compute is: one call into C
    that holds the GIL released throughout and touches memory (hashing ``us`` worth of bytes), so that the
    training thread's own Python runs cache-cold after it and the reporter's sender thread may take the GIL
    meanwhile, as beside torch's kernels. (A Python spin would hold the GIL and bill the sender thread's
    Python to the training thread; a sleep would leave the core idle.)"""
    global _computed_ns
    if us <= 0:
        return
    data = _compute_buffers.get(us)
    if data is None:
        data = _compute_buffers[us] = bytes(int(us * _bytes_per_us()))
    t0 = time.perf_counter_ns()
    hashlib.sha256(data)
    _computed_ns += time.perf_counter_ns() - t0


@dataclass(frozen=True)
class Case:
    """One pipeline rank's replayed iteration: ``bare()`` runs it uninstrumented; ``instrument(reporter)``
    returns an instrumented one that reports to ``reporter`` (every planned position reported) and the
    call that undoes it."""

    bare: Callable[[], object]
    instrument: Callable[[BubbleSink], tuple[Callable[[], object], Callable[[], None]]]


@contextmanager
def _manager(*options: str) -> Iterator[Endpoint]:
    """A real manager on a fresh unix socket, its threads on every core but the training thread's."""
    work = Path(tempfile.mkdtemp(prefix="fr-hot-"))
    sock = work / "m.sock"
    proc = start_manager(sock, work / "state", *options, cpus=control_cpus())
    try:
        yield Endpoint("unix", str(sock))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


class _Dropped:
    """The ``tracker`` part's sink: every event dropped."""

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        pass

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        pass


def _reporter(endpoint: Endpoint, rank: int, route: str) -> BubbleReporter:
    reporter = BubbleReporter("cpu:0", stage=rank, rank=rank, endpoint=endpoint, local_events=route != "queue",
                              cpu_affinity=control_cpus())
    deadline = time.monotonic() + 30
    while not (reporter.counters().connected and (route == "queue" or reporter._local is not None)):
        if time.monotonic() > deadline:
            reporter.close()
            raise SystemExit(f"hot path: the {route} reporter did not connect to {endpoint}")
        time.sleep(0.01)
    return reporter


def paired_ns(bare: Callable[[], object], inst: Callable[[], object], rounds: int, per_batch: int) -> float:
    """The median over ``rounds`` pairs of batches (each ``per_batch`` iterations, the pair in random order)
    of the instrumented iteration's ns less the bare one's, each counted outside its compute actions (a
    batch's wall time less the time in :func:`compute`: the compute's own jitter, a few percent of it, would
    otherwise swamp the difference)."""
    for _ in range(3):  # warm-up: the tracker's model and the reporter's route settle
        bare()
        inst()
    diffs = []
    for _ in range(rounds):
        means: dict[str, float] = {}
        pair = [("bare", bare), ("inst", inst)]
        random.shuffle(pair)
        for key, step in pair:
            computed, t0 = _computed_ns, time.perf_counter_ns()
            for _ in range(per_batch):
                step()
            means[key] = (time.perf_counter_ns() - t0 - (_computed_ns - computed)) / per_batch
        diffs.append(means["inst"] - means["bare"])
    return median(diffs)


def costs_ns(case_of: Callable[[int], Case], ranks: tuple[int, ...] = (0, 1), *, rounds: int = 10,
             per_batch: int = 20, routes: tuple[str, ...] = ROUTES) -> dict[str, list[float]]:
    """Per route (:data:`ROUTES`, or :data:`TRACKER`), the training thread's ns per iteration the
    instrumentation adds, per rank."""
    unknown = set(routes) - {*ROUTES, TRACKER}
    if unknown:
        raise ValueError(f"unknown route(s) {sorted(unknown)}: pick from {', '.join((*ROUTES, TRACKER))}")
    out: dict[str, list[float]] = {route: [] for route in routes}
    with ExitStack() as managers:
        endpoints: dict[str, Endpoint] = {}
        if {"queue", "local"} & set(routes):
            endpoints["queue"] = endpoints["local"] = managers.enter_context(_manager())
        if "awake" in routes:
            endpoints["awake"] = managers.enter_context(_manager("--event-spin-us", str(AWAKE_SPIN_US)))
        for rank in ranks:
            case = case_of(rank)
            for route in routes:
                reporter = None if route == TRACKER else _reporter(endpoints[route], rank, route)  # thread unpinned
                try:
                    out[route].append(replay_cost_ns(case, _Dropped() if reporter is None else reporter, rounds,
                                                     per_batch))
                finally:
                    if reporter is not None:
                        reporter.close()
    return out


def replay_cost_ns(case: Case, sink: Any, rounds: int, per_batch: int) -> float:
    """The training thread's ns per iteration that ``case``'s instrumentation, reporting to ``sink``, adds
    (:func:`paired_ns`), with this thread pinned to the training core meanwhile: the core that is not the control
    plane's (:func:`control_cpus`), as a trainer pins its rank (instrumenting an unpinned cpu:N rank is warned
    about). Only this thread is pinned, before it is instrumented; the sink's threads stay where they are."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed - control_cpus() or allowed)})
    try:
        step, undo = case.instrument(sink)
        try:
            return paired_ns(case.bare, step, rounds, per_batch)
        finally:
            undo()
    finally:
        os.sched_setaffinity(0, allowed)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.hot_path [--schedules a,b] [--routes r,s] [--compute-us N] [--results-name NAME]``: the
    figures alone, per rank and route, in us per iteration and as a share of the median iteration of the last
    committed run of the same schedule (``bench/results/cpu/{schedules,frameworks,megatron}-spin.json``);
    with ``--results-name``, also written to ``bench/results/cpu/NAME.{json,md}``."""
    import argparse
    import json
    import sys

    from bench import bench_megatron, bench_schedules
    from bench.machine import machine_info

    global COMPUTE_US
    p = argparse.ArgumentParser(prog="python -m bench.hot_path", description=main.__doc__)
    p.add_argument("--schedules", default=",".join(bench_schedules.SCHEDULES),
                   help="comma-separated torch schedules, frameworks (deepspeed, deepspeed-dualpipev, torchtitan) "
                        "and megatron-1f1b, megatron-interleaved")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--routes", default=",".join(ROUTES),
                   help=f"comma-separated, of {', '.join((*ROUTES, TRACKER))} ({TRACKER}: the marks alone, every "
                        "event dropped)")
    p.add_argument("--compute-us", type=float, default=COMPUTE_US,
                   help="busy time per compute action (0: the marks back to back, cache-warm)")
    p.add_argument("--results-name", help="also write bench/results/cpu/NAME.json and NAME.md")
    args = p.parse_args(argv)
    routes = tuple(r.strip() for r in args.routes.split(",") if r.strip())
    bad = [r for r in routes if r not in (*ROUTES, TRACKER)]
    if bad or not routes or args.compute_us < 0:
        p.error(f"--routes takes {', '.join((*ROUTES, TRACKER))}; --compute-us 0 or more")
    import bench.hot_path as harness  # the module the replays read: this file may run as __main__

    COMPUTE_US = harness.COMPUTE_US = args.compute_us
    results = Path(__file__).resolve().parent / "results" / "cpu"
    iteration_ms: dict[str, list[float]] = {}
    for name, prefix in (("schedules-spin", ""), ("frameworks-spin", ""), ("megatron-spin", "megatron-")):
        path = results / f"{name}.json"
        if path.exists():
            for run in json.loads(path.read_text())["runs"]:
                iteration_ms[prefix + run["schedule"]] = [r["iteration_ms_p50"] for r in run["ranks"]]
    csv_path = bench_schedules.temporary_csv_order(args.microbatches, "fr-hot-")
    rows: list[dict[str, object]] = []
    for name in [n.strip() for n in args.schedules.split(",") if n.strip()]:
        if name.startswith("megatron-"):
            costs = bench_megatron.hot_path_ns(name.removeprefix("megatron-"), args.microbatches, routes)
        else:
            costs = bench_schedules.hot_path_ns(name, args.microbatches, csv_path, routes)
        for rank in (0, 1):
            its = iteration_ms.get(name)
            row = {"schedule": name, "rank": rank, "us_per_iteration": {r: costs[r][rank] / 1e3 for r in routes},
                   "last_iteration_ms_p50": its[rank] if its else None}
            rows.append(row)
            shares = " / ".join(f"{100 * costs[r][rank] / 1e6 / its[rank]:.3f}%" for r in routes) if its else "-"
            print(f"{name} rank {rank}: " + " / ".join(f"{costs[r][rank] / 1e3:.0f}" for r in routes)
                  + f" us an iteration ({' / '.join(routes)}); {shares} of the last run's median iteration",
                  flush=True)
    if args.results_name:
        command = " ".join(["python -m bench.hot_path", *(sys.argv[1:] if argv is None else argv)])
        doc = {"command": command, "machine": machine_info(), "compute_us": COMPUTE_US,
               "microbatches": args.microbatches, "routes": list(routes), "rows": rows}
        (results / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        write_markdown(doc, results / f"{args.results_name}.md")
    return 0


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    """``doc`` (:func:`main`'s results) as a table: us per iteration per route, and each as a share of the last
    committed run's median iteration."""
    m = doc["machine"]
    routes = doc["routes"]
    lines = [
        "# What the instrumentation costs the training thread, by part",
        "",
        f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), {doc['microbatches']} micro-batches, "
        f"{doc['compute_us']:g} us of compute per action (`bench.hot_path`: the median over paired, shuffled "
        "batches of the time outside compute; the training thread pinned to one core, the manager and the "
        f"reporter's sender thread on the others). `{TRACKER}`: the adapter's hooks and the tracker, every "
        "event dropped at the sink; `queue`: events to the reporter's sender thread; `local`: each event sent "
        "on the manager's local socket by the training thread; `awake`: the same, to a manager that stays awake "
        f"{AWAKE_SPIN_US} us after each event (`--event-spin-us`, on a core of its own). Share: of the median "
        "iteration of the last "
        "committed bench run of that schedule (`*-spin.json`).",
        "",
        "| schedule | rank | " + " | ".join(f"{r} us/it" for r in routes) + " | " + " | ".join(
            f"{r} share" for r in routes) + " |",
        "|---|---|" + "---|" * (2 * len(routes)),
    ]
    for row in doc["rows"]:
        us = row["us_per_iteration"]
        its = row["last_iteration_ms_p50"]
        shares = [f"{100 * us[r] / 1e3 / its:.3f}%" if its else "-" for r in routes]
        lines.append(f"| {row['schedule']} | {row['rank']} | " + " | ".join(f"{us[r]:.0f}" for r in routes)
                     + " | " + " | ".join(shares) + " |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
