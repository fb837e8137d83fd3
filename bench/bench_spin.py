"""What ``--event-spin-us`` does to the trainer's event delay, with the manager's core to itself and shared.

The event delay is a manager's own figure (``freeride stats``: the trainer's stamp of a bubble event to the
loop handing it to the scheduler). A real manager, asleep between events (no spin) or staying awake
:data:`SPIN_US` after each (``--event-spin-us``), on the control cores
(:func:`bench.bench_control_plane.control_cpus`), receives the events of a replay: an Interleaved1F1B rank's
actions on the training core (``bench.hot_path``'s walker, ~48 events an iteration), sent by the training
thread on the manager's local socket, ``--rounds`` times. Each kind of manager runs alone, a fresh one per
condition, so its cumulative figures are that condition's:

``alone``
    nothing else on the manager's cores but its own threads (and the replay's reporter), as a manager given a
    core of its own;
``shared``
    with a busy process pinned to each control core at the manager's priority (another job, another
    manager's loop): the case the spin's probe found its rarest delays growing in (p99.9 2.7-4.6 ms against
    1.3-1.5 ms asleep), which a spinning loop now gives way to (``ManagerLoop._still_spinning``).

Beside the delays: the training thread's cost an iteration (``bench.hot_path.paired_ns``), as in
``bench.hot_path``'s ``local`` and ``awake`` routes.

    python -m bench.bench_spin [--rounds 2] [--batches 20] [--results-name NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

SPIN_US = 5000
MANAGERS = ("asleep", "awake")
CONDITIONS = ("alone", "shared")


@contextmanager
def competitors(cpus: set[int]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """A busy process pinned to each of ``cpus``, at the default priority, until the block ends."""
    busy = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", busy, str(cpu)]) for cpu in sorted(cpus)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def run(rounds: int, batches: int, schedule: str = "interleaved-1f1b", microbatches: int = 8) -> dict[str, Any]:
    """Per condition and manager: the training thread's us an iteration (one per round) and the manager's event
    delay percentiles (ms) over every round."""
    from bench import bench_schedules, hot_path
    from bench.bench_control_plane import control_cpus
    from freeride._wire.client import ControlClient

    csv_path = bench_schedules.temporary_csv_order(microbatches, "fr-spin-")
    out: dict[str, Any] = {}
    for condition in CONDITIONS:
        out[condition] = {}
        for manager in MANAGERS:
            with ExitStack() as stack:
                options = ("--event-spin-us", str(SPIN_US)) if manager == "awake" else ()
                endpoint = stack.enter_context(hot_path._manager(*options))
                if condition == "shared":
                    stack.enter_context(competitors(control_cpus()))
                cost: list[float] = []
                for _ in range(rounds):
                    case = bench_schedules._torch_case(schedule, 0, microbatches, csv_path)
                    reporter = hot_path._reporter(endpoint, 0, "local")
                    try:
                        cost.append(hot_path.replay_cost_ns(case, reporter, 6, batches) / 1e3)
                    finally:
                        reporter.close()
                with ControlClient(endpoint) as client:
                    delay = client.stats().event_delay_ms
                out[condition][manager] = {
                    "us_per_iteration": cost,
                    "event_delay_ms": {"count": delay.count, "p50": delay.p50, "p90": delay.p90, "p99": delay.p99,
                                       "p999": delay.p999, "max": delay.max},
                }
    return out


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    m = doc["machine"]
    lines = [
        "# The event delay with and without `--event-spin-us`, alone and beside a busy process",
        "",
        f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores): `bench/bench_spin.py` (its docstring has the "
        f"method). `asleep`: no spin; `awake`: `--event-spin-us {SPIN_US}`. Event delay: the manager's own "
        "figure, trainer stamp to its scheduler, over every event of the condition (ms). Cost: the training "
        "thread's us an iteration, one figure a round.",
        "",
        "| condition | manager | cost us/it | events | p50 | p90 | p99 | p99.9 | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for condition, managers in doc["results"].items():
        for manager, r in managers.items():
            d = r["event_delay_ms"]
            cost = ", ".join(f"{c:.0f}" for c in r["us_per_iteration"])
            lines.append(f"| {condition} | {manager} | {cost} | {d['count']} | {d['p50']:.3f} | {d['p90']:.3f} | "
                         f"{d['p99']:.3f} | {d['p999']:.3f} | {d['max']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine_info

    p = argparse.ArgumentParser(prog="python -m bench.bench_spin", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", type=int, default=20, help="paired batches a replay (bench.hot_path.paired_ns)")
    p.add_argument("--results-name", help="also write bench/results/cpu/NAME.json and NAME.md")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.batches < 1:
        p.error("--rounds and --batches take 1 or more")
    results = run(args.rounds, args.batches)
    for condition, managers in results.items():
        for manager, r in managers.items():
            d = r["event_delay_ms"]
            print(f"{condition:<6} {manager:<6} cost {', '.join(f'{c:.0f}' for c in r['us_per_iteration'])} us/it; "
                  f"event delay p50 {d['p50']:.3f} p99 {d['p99']:.3f} p99.9 {d['p999']:.3f} max {d['max']:.3f} ms "
                  f"({d['count']} events)", flush=True)
    if args.results_name:
        command = " ".join(["python -m bench.bench_spin", *(sys.argv[1:] if argv is None else argv)])
        doc = {"command": command, "machine": machine_info(), "spin_us": SPIN_US, "results": results}
        out = Path(__file__).resolve().parent / "results" / "cpu"
        (out / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        write_markdown(doc, out / f"{args.results_name}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
