"""What the framework jobs (:mod:`~freeride.workload.deepspeed_job`, :mod:`~freeride.workload.torchtitan_job`)
share with each other and with the reference trainer: a rank pinned to its core, the options the bench
drives every job with, and the reference trainer's per-rank log (one JSON line per iteration, then a
summary line), so that ``bench/bench_schedules.py`` reads them all alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from freeride.training.tracker import MeasuredBubble


def pin_rank(local_rank: int) -> tuple[str, set[int]]:
    """Pin this process to one of the cores it may use (in order of local rank), with one torch thread.

    Returns the device name (``cpu:N``) and the cores the process was given, for the threads that should
    stay off the training thread's core (the reporter's sender).
    """
    import torch

    given = set(os.sched_getaffinity(0))
    core = sorted(given)[local_rank % len(given)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return f"cpu:{core}", given


def job_main(
    run: Callable[[argparse.Namespace], object],
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace],
    argv: Sequence[str] | None = None,
) -> int:
    """A job's ``main``: logging as the reference trainer's (``FREERIDE_LOG_LEVEL``), then ``run``."""
    logging.basicConfig(level=os.environ.get("FREERIDE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(name)s: %(message)s")
    run(parse_args(argv))
    return 0


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The options every framework job takes (names are no prefixes of torchrun's own)."""
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="iterations marked as warm-up in the log")
    p.add_argument("--slow-stage", type=int, default=1, help="model stage made slower by --slow-ms (-1: none)")
    p.add_argument("--slow-ms", type=float, default=5.0, help="busy milliseconds added to each of its forwards")
    p.add_argument("--twin", action="store_true", help="also train a bare twin with the same weights and batches")
    p.add_argument("--report", action="store_true", help="report to this rank's manager")
    p.add_argument("--endpoint-template", default="", help="manager endpoint per rank ({slug}, {rank}, ...); "
                   "default: the device's default endpoint")
    p.add_argument("--idle-probe", action="store_true", help="log every idle gap between compute actions")
    p.add_argument("--snippet", default="", help="user code to run instead of the built-in instrumentation and loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iteration-log", dest="log", default="", help="JSON lines per rank ({rank} substituted)")


class IterationLog:
    """One rank's log in the reference trainer's format (``iteration``, ``warmup``, ``time_ms``, ``end_ns``,
    ``loss``, ``bubbles``, ``idle_gaps``; a closing ``summary`` record)."""

    def __init__(self, template: str, rank: int, device: str, warmup: int) -> None:
        from freeride.workload.run import rank_log_path

        self.rank, self.device, self.warmup = rank, device, warmup
        self.records: list[dict[str, Any]] = []
        self._out: IO[str] | None = None
        if template:
            path = rank_log_path(template, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out = path.open("w")

    def record(self, iteration: int, start_ns: int, loss: float | None,
               idle_gaps: list[tuple[int, int, int]] | None, **extra: Any) -> dict[str, Any]:
        """An iteration's record, ended now; :meth:`write` it once its bubbles are known."""
        end_ns = time.monotonic_ns()
        record = {"iteration": iteration, "rank": self.rank, "stage": self.rank, "device": self.device,
                  "warmup": iteration < self.warmup, "time_ms": (end_ns - start_ns) / 1e6, "end_ns": end_ns,
                  "loss": loss, "bubbles": [], **extra}
        if idle_gaps is not None:
            record["idle_gaps"] = [list(gap) for gap in idle_gaps]  # (start, wall, idle), as the trainer logs them
        return record

    def write(self, record: dict[str, Any], bubbles: list[MeasuredBubble]) -> None:
        from freeride.workload.run import bubble_record

        record["bubbles"] = [bubble_record(b) for b in bubbles]
        self._write(record)

    def summary(self, tracker: Any, reporter: Any, **checks: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"summary": True, "rank": self.rank, "device": self.device, **checks}
        if tracker is not None:
            record.update(slots=[{"slot": s.index, "kind": s.kind} for s in tracker.slots],
                          learned_slots=[{"slot": s.index, "kind": s.kind} for s in tracker.learned.opens.values()],
                          unplanned_waits=tracker.unplanned_waits, unplanned_wait_ms=tracker.unplanned_wait_ns / 1e6)
        if reporter is not None:
            record["reporter"] = asdict(reporter.counters())
        self._write(record)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._out is not None:
            self._out.write(json.dumps(record) + "\n")
            self._out.flush()

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def read_log(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A rank's log: its iteration records and its summary."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if not r.get("summary")], next(r for r in records if r.get("summary"))
