"""CPU time the manager's loop thread spends on each bubble event, and the time a start takes to reach the
worker's channel: the latency-critical paths (bubble start -> grant sent, bubble end -> park sent).

An in-process manager on cpu:0 with one real worker (``bench.bench_tasks:SpinStep``); bubble events are
posted straight to the loop (no gRPC, so the figures are the loop's own), paced in real time. For each
start and end the loop thread's CPU time (``time.thread_time_ns``) is measured around its handling of
the event (the core, the actions it returns, the grant or park on the worker's channel); CPU time is
what a loaded machine disturbs least. Also measured: post -> the grant written to the worker's channel,
in wall time (this one moves with the load).

``--compare DIR [DIR ...]`` runs the same measurement against other source trees (a checkout of
another revision), interleaved round by round with this one, each in its own process, and prints one
table: that is how a change to the loop is measured against its base on a shared machine. Run:
``python -m bench.bench_loop_cost --bubbles 2000 --rounds 3 --compare /path/to/main/checkout``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MS = 1_000_000


def measure(bubbles: int, cpu: str) -> dict[str, Any]:
    """One measurement against the freeride this interpreter imports."""
    from freeride._manager import core as C
    from freeride._manager.daemon import Manager
    from freeride._wire.client import ControlClient
    from freeride.endpoints import Endpoint
    from freeride.messages import BubbleEnd, BubbleStart, TaskSpec

    tmp = Path(tempfile.mkdtemp(prefix="fr-loopcost-"))
    sock = Path(f"/tmp/fr-loopcost-{os.getpid()}.sock")
    manager = Manager(cpu, endpoint=Endpoint("unix", str(sock)), state_dir=tmp / "state", memory_poll_ms=50.0)
    manager.start()
    loop = manager.loop
    cpu_ns: dict[str, list[int]] = {"start": [], "end": []}
    posted = [0]  # when the current bubble's start was posted
    to_channel: list[int] = []
    original_feed = loop._feed

    def timed_feed(event: Any, now_ns: int | None = None) -> None:
        kind = "start" if isinstance(event, C.BubbleStarted) else "end" if isinstance(event, C.BubbleEnded) else ""
        before = time.thread_time_ns()
        original_feed(event, now_ns)
        if kind:
            cpu_ns[kind].append(time.thread_time_ns() - before)

    loop._feed = timed_feed  # type: ignore[method-assign]
    try:
        with ControlClient(manager.endpoint) as client:
            task = client.submit(TaskSpec(target="bench.bench_tasks:SpinStep", args={"step_us": 100},
                                          memory_bytes=256 * 2**20, working_dir=str(REPO)))
            deadline = time.monotonic() + 60
            while client.get(task.task_id).state != "PARKED":
                if time.monotonic() > deadline:
                    raise SystemExit("the worker did not come up")
                time.sleep(0.05)
            handle = next(iter(_workers(loop).values()))
            channel = handle.channel
            real_send = channel.send

            def stamped_send(message: Any) -> None:
                real_send(message)
                tag = message["t"] if isinstance(message, dict) else message.TAG
                if tag == "grant" and posted[0]:
                    to_channel.append(time.monotonic_ns() - posted[0])
                    posted[0] = 0

            channel.send = stamped_send
            for it in range(bubbles + 20):
                start = time.monotonic_ns()
                posted[0] = start
                loop.post_bubbles([BubbleStart(0, 0, it, 0, "bench", start, 4 * MS, 16 * 2**30)], start)
                time.sleep(0.003)
                end = time.monotonic_ns()
                loop.post_bubbles([BubbleEnd(0, 0, it, 0, end)], end)
                time.sleep(0.002)
            time.sleep(0.2)
    finally:
        manager.stop()
    skip = 20  # the worker's setup and first estimates
    return {"start_cpu_us": _pct([v / 1e3 for v in cpu_ns["start"][skip:]]),
            "end_cpu_us": _pct([v / 1e3 for v in cpu_ns["end"][skip:]]),
            "post_to_channel_us": _pct([v / 1e3 for v in to_channel[skip:]]),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def _workers(loop: Any) -> dict[str, Any]:
    workers = getattr(loop, "workers", None)
    if workers is not None and hasattr(workers, "workers"):
        return dict(workers.workers)
    return dict(loop._workers)  # a loop from before the split (issue 22)


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[max(0, int(-(-len(ordered) * p // 100)) - 1)]  # nearest rank

    return {"count": len(ordered), "p50": round(q(50), 2), "p90": round(q(90), 2), "p99": round(q(99), 2),
            "mean": round(sum(ordered) / len(ordered), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bubbles", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", default="cpu:0")
    parser.add_argument("--compare", nargs="*", type=Path, default=[], help="other source trees to measure")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    if ns.once:
        print(json.dumps(measure(ns.bubbles, ns.cpu)))
        return 0
    trees = [REPO, *[p.resolve() for p in ns.compare]]
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for _ in range(ns.rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            out = subprocess.run([sys.executable, "-m", "bench.bench_loop_cost", "--once", "--bubbles",
                                  str(ns.bubbles), "--cpu", ns.cpu], cwd=tree, env=env, capture_output=True,
                                 text=True, check=True)
            runs[str(tree)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = ["| tree | round | start: loop CPU us p50 / p90 / p99 | end: loop CPU us p50 / p90 / p99 "
             "| post -> grant on the channel us p50 / p99 | load average |", "|---|---|---|---|---|---|"]
    for tree, results in runs.items():
        for i, r in enumerate(results, 1):
            s, e, c = r["start_cpu_us"], r["end_cpu_us"], r["post_to_channel_us"]
            lines.append(f"| {tree} | {i} | {s['p50']} / {s['p90']} / {s['p99']} | {e['p50']} / {e['p90']} / "
                         f"{e['p99']} | {c.get('p50', '-')} / {c.get('p99', '-')} | {r['loadavg'][0]} |")
    print("\n".join(lines))
    if ns.out is not None:
        ns.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
