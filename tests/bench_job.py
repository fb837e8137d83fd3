"""A small instrumented "training job" for ``freeride bench``'s tests: no torch, starts in a blink.

    python tests/bench_job.py --devices cpu:0[,cpu:1] [--iterations N] [--compute-ms C] [--bubble-ms B]
                              [--exit-code K] [--hang]

One thread per device, pinned to its core, does C ms of busy work and then waits B ms (a bubble,
reported through a real ``BubbleReporter`` to the device's default endpoint, with its predicted
length), N times. Where its manager's socket exists (not in the bench's "alone" runs), each stage waits (up
to 30 s) for the manager to answer before its first bubble: a real trainer does not wait, and bubbles it
reports before the connection is up are dropped by design, but the bench tests count every bubble.
``--exit-code K`` exits K after the iterations; ``--hang`` sleeps forever instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from freeride.endpoints import default_endpoint
from freeride.training.reporter import BubbleReporter


def stage(device: str, rank: int, iterations: int, compute_ms: float, bubble_ms: float) -> None:
    os.sched_setaffinity(0, {int(device.split(":")[1])})
    with BubbleReporter(device, stage=rank, rank=rank) as reporter:
        deadline = time.monotonic() + 30
        listening = os.path.exists(default_endpoint(device).address)
        while listening and not reporter.connected and time.monotonic() < deadline:  # polled: the reporter has no wait
            time.sleep(0.005)
        for it in range(iterations):
            end = time.monotonic() + compute_ms / 1e3
            while time.monotonic() < end:  # the stage's compute: it holds the core
                pass
            reporter.bubble_start(it, 0, "turnaround", int(bubble_ms * 1e6))
            time.sleep(bubble_ms / 1e3)
            reporter.bubble_end(it, 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", required=True)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--compute-ms", type=float, default=10.0)
    p.add_argument("--bubble-ms", type=float, default=30.0)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--hang", action="store_true")
    args = p.parse_args()
    threads = [threading.Thread(target=stage, args=(d, r, args.iterations, args.compute_ms, args.bubble_ms))
               for r, d in enumerate(args.devices.split(","))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if args.hang:
        time.sleep(3600)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
