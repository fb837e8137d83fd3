"""What an event costs the training thread when its receiver sleeps on another core: the cross-core wake.

    python -m bench.bench_wake [--events 3000] [--gap-us 300] [--results-name wake]

The instrumentation's per-event cost on the training thread (``bench/hot_path.py``: 12-16 us an event on
the 2-core VM, most of the multi-stage schedules' ``instr. cost``) is mostly not freeride's Python: it is the
wake of a receiver asleep on another core. This measures that alone, on two cores, the sender pinned to the
first and the receiver to the second, with ``--gap-us`` of busy work between sends (as compute actions
separate a rank's events; the work releases the GIL, as a compute action's does), for the two routes the
reporter uses:

* **local**: a 60-byte ``send`` on a ``SOCK_SEQPACKET`` Unix socket (the manager's local event socket)
  to a process that sleeps in ``select`` (as the manager's loop does), and to one that polls without
  sleeping (``MSG_DONTWAIT`` in a loop: it is awake when the datagram comes);
* **local-eventfd**, **local-pipe**: the same with an ``eventfd`` write (what a shared-memory ring of events
  would still need to wake its reader) or a pipe's write in place of the datagram: whether another
  primitive would wake the manager for less (on the 2-core VM it would not: the wake is the cost);
* **queue**: ``queue.SimpleQueue.put`` to a thread blocked in ``get`` (the reporter's sender thread), and
  to one that polls ``get_nowait``.

The sender's time per call (``perf_counter_ns`` around it), p50 and p90. The difference between the two
receivers is the wake: on a VM an inter-processor interrupt is a trip through the hypervisor. Results:
``bench/results/cpu/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAYLOAD = b"x" * 60
#: ``local``: the manager's datagram; ``local-eventfd`` and ``local-pipe``: other wakes, for comparison.
ROUTES = ("local", "local-eventfd", "local-pipe", "queue")


_BLOCK = bytes(1 << 16)


def _busy(us: int) -> None:
    """``us`` of busy work without the GIL (hashing 64 KiB blocks releases it), as a rank's compute runs."""
    until = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < until:
        hashlib.sha256(_BLOCK).digest()


def _quantiles(costs: list[int]) -> dict[str, float]:
    costs = sorted(costs)
    return {"p50_us": costs[len(costs) // 2] / 1e3, "p90_us": costs[int(len(costs) * 0.9)] / 1e3}


def local_route(events: int, gap_us: int, receiver_sleeps: bool, cores: tuple[int, int],
                primitive: str = "seqpacket") -> dict[str, float]:
    """A send to a process on the other core (asleep in select, or polling): ``primitive`` is the manager's
    ``seqpacket`` datagram, or, for comparison, an ``eventfd`` write (the wake a shared-memory ring would
    need beside its store) or a ``pipe`` write."""
    if primitive == "seqpacket":
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.setblocking(False)  # the polling receiver must not sleep in its read
        read_fd, closes = theirs.fileno(), [mine, theirs]

        def send() -> None:
            mine.send(PAYLOAD, socket.MSG_DONTWAIT)
    elif primitive == "eventfd":
        read_fd = write_fd = os.eventfd(0, os.EFD_NONBLOCK)
        closes = []

        def send() -> None:
            os.eventfd_write(write_fd, 1)
    elif primitive == "pipe":
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        closes = []

        def send() -> None:
            os.write(write_fd, PAYLOAD)
    else:
        raise ValueError(f"unknown primitive {primitive!r}")
    pid = os.fork()
    if pid == 0:  # the receiver: reads until killed
        try:
            os.sched_setaffinity(0, {cores[1]})
            while True:
                if receiver_sleeps:
                    select.select([read_fd], [], [])
                try:
                    os.read(read_fd, 256)
                except BlockingIOError:
                    continue
        finally:
            os._exit(0)
    os.sched_setaffinity(0, {cores[0]})
    costs = []
    try:
        for _ in range(events):
            _busy(gap_us)
            t0 = time.perf_counter_ns()
            send()
            costs.append(time.perf_counter_ns() - t0)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for sock in closes:
            sock.close()
        if primitive == "pipe":
            os.close(write_fd)
        if primitive != "seqpacket":
            os.close(read_fd)
    return _quantiles(costs)


def queue_route(events: int, gap_us: int, receiver_sleeps: bool, cores: tuple[int, int]) -> dict[str, float]:
    """A ``SimpleQueue.put``, its receiver a thread on the other core (blocked in get, or polling).

    The polling thread holds the GIL between polls; it sleeps in ``time.sleep(0)`` to let the sender have
    it, so this side measures the put's own cost with no wake, not a fair share of one interpreter."""
    q: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def receive() -> None:
        os.sched_setaffinity(0, {cores[1]})
        while True:
            if receiver_sleeps:
                item = q.get()
            else:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    time.sleep(0)
                    continue
            if item == b"q":
                return

    thread = threading.Thread(target=receive, daemon=True)
    os.sched_setaffinity(0, {cores[0]})
    thread.start()
    costs = []
    for _ in range(events):
        _busy(gap_us)
        t0 = time.perf_counter_ns()
        q.put(PAYLOAD)
        costs.append(time.perf_counter_ns() - t0)
    q.put(b"q")
    thread.join()
    return _quantiles(costs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_wake", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=3000)
    p.add_argument("--gap-us", type=int, default=300, help="busy time between two sends")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    p.add_argument("--results-name", default="wake")
    args = p.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        p.error("needs two cores (the sender's and the receiver's)")
    cores = (allowed[0], allowed[1])
    from bench.machine import machine_info

    rows: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for route in ROUTES:
            for sleeps in (True, False):
                load = os.getloadavg()[0]
                if route == "queue":
                    figures = queue_route(args.events, args.gap_us, sleeps, cores)
                else:
                    figures = local_route(args.events, args.gap_us, sleeps, cores, route.removeprefix("local-") if
                                          route != "local" else "seqpacket")
                rows.append({"round": round_, "route": route, "receiver": "asleep" if sleeps else "awake",
                             **figures, "load": round(load, 2)})
                print(rows[-1], flush=True)
    command = "python -m bench.bench_wake" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("events", args.events), ("gap_us", args.gap_us),
                                                    ("rounds", args.rounds)) if v != p.get_default(k))
    machine = machine_info()
    config = {"events": args.events, "gap_us": args.gap_us, "cores": list(cores)}
    doc: dict[str, Any] = {"command": command, "machine": machine, "config": config, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = ["# An event's cost on the sender: its receiver asleep on another core, or awake", "",
          f"`{command}` on {machine.get('cpu') or 'this machine'}: sender on core {cores[0]}, receiver on "
          f"core {cores[1]}, {args.gap_us} us of busy work between two sends, {args.events} sends per row.", "",
          "| round | route | receiver | send p50 us | send p90 us | load |", "|---|---|---|---|---|---|"]
    md += [f"| {r['round']} | {r['route']} | {r['receiver']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} | {r['load']} |"
           for r in rows]
    (args.out / f"{args.results_name}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
