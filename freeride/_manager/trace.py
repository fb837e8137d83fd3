"""An opt-in timeline of what a manager did: ``freeride manager --trace FILE``.

One JSON object per line, written by the loop thread only, times in CLOCK_MONOTONIC nanoseconds
(the clock the trainer's bubble events use, shared by every process on the host), so a trace can be
laid beside the trainer's iteration logs. The demo turns it into a timeline picture and a
Perfetto trace. Records (``ev`` names the kind; every record has ``device``):

* ``bubble_start``: ``stage, rank, iteration, slot, kind, start_ns, predicted_ns, received_ns`` (and
  ``learned: true`` for a learned slot: a recurring wait the trainer's schedule model does not list)
* ``bubble_end``: ``stage, rank, iteration, slot, end_ns, received_ns``
* ``end_seen``: ``task, grant, end_ns, at_ns``: the trainer's end of that grant's bubble, from its local event
* ``grant``: ``task, grant, deadline_ns, margin_ns, at_ns`` (``thaw`` when it also thawed a frozen worker)
* ``park`` / ``freeze``: ``task, grant`` / ``task``, ``at_ns`` (what the manager sent or did)

  A grant and a freeze carry ``cpu_ns``: the worker process's CPU time, read once the action was applied
  (the grant sent, the stop signalled), where it could be. With the steps' ``start_cpu_ns`` they bound
  what a worker ran between a bubble's end and its freeze (:mod:`freeride.harvest`).
* ``steps``: ``task, grant, reason, count, spans`` (``count`` steps ran in that grant; ``spans`` are
  [start_ns, end_ns] of the most recent of them, at most 64, as the worker reported them), and
  ``start_cpu_ns``: the worker process's CPU time when the last of them began; ``costs``, each span's cost
  where they differ (less what the step waited for the device: what the step-time estimate learned), and
  ``worked_ns``, every step's cost summed (the grant's harvested time)
* ``state``: ``task, old, new, reason, at_ns``
* ``opened``: ``pid, at_ns``: a manager began writing. The file is appended to, so a restarted
  manager (``kill -9``, a supervisor's restart) adds its records after the earlier run's, and a
  reader can tell the runs apart.

Writes are buffered and handed to the kernel once a second (the loop never waits on a disk for a
trace: no fsync) and when the manager stops, so a trace can be followed while the manager runs and a
``kill -9`` loses at most its last second; a trace that cannot be written is logged once and
switched off, never fatal.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from freeride._channel import Parked
from freeride._manager import core as C

log = logging.getLogger(__name__)

BUFFER_BYTES = 1 << 20
#: How often the loop hands the buffer to the kernel.
FLUSH_INTERVAL_NS = 1_000_000_000


class TraceWriter:
    """Buffered JSON-lines writer; :meth:`write` never raises."""

    def __init__(self, path: Path, device: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.device = device
        self._fh: IO[str] | None = path.open("a", buffering=BUFFER_BYTES)
        if self._fh.tell() > 0 and not _ends_with_newline(path):
            self._fh.write("\n")  # after a torn last line (a killed manager): keep the next record whole
        self.write("opened", pid=os.getpid(), at_ns=time.monotonic_ns())

    def write(self, ev: str, **fields: Any) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps({"ev": ev, "device": self.device, **fields}, separators=(",", ":")) + "\n")
        except (OSError, ValueError) as exc:
            log.warning("[%s] trace %s could not be written (%s); tracing is off", self.device, self.path, exc)
            self._close_quietly()

    def flush(self) -> None:
        if self._fh is not None:
            try:
                self._fh.flush()
            except OSError as exc:
                log.warning("[%s] trace %s could not be flushed (%s); tracing is off", self.device, self.path, exc)
                self._close_quietly()

    def close(self) -> None:
        self.flush()
        self._close_quietly()

    def _close_quietly(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass


class LoopTrace:
    """What the loop traces: the core's inputs and decisions, and the steps workers report."""

    def __init__(self, writer: TraceWriter, now_ns: Callable[[], int],
                 cpu_of: Callable[[str], int | None] = lambda task_id: None) -> None:
        self.writer = writer
        self.now_ns = now_ns
        #: A task's worker's CPU time so far (None: no worker, or unreadable).
        self.cpu_of = cpu_of
        self._next_flush_ns = 0

    def event(self, event: Any) -> None:
        write = self.writer.write
        if isinstance(event, C.BubbleStarted):
            b = event.bubble
            write("bubble_start", stage=b.stage, rank=b.rank, iteration=b.iteration, slot=b.slot, kind=b.kind,
                  start_ns=b.start_ns, predicted_ns=b.predicted_ns, received_ns=event.received_ns,
                  **({"learned": True} if b.learned else {}))
        elif isinstance(event, C.BubbleEnded):
            e = event.bubble
            write("bubble_end", stage=e.stage, rank=e.rank, iteration=e.iteration, slot=e.slot, end_ns=e.end_ns,
                  received_ns=event.received_ns)
        elif isinstance(event, C.TrainerEndSeen):
            write("end_seen", task=event.task_id, grant=event.grant_id, end_ns=event.end_ns, at_ns=self.now_ns())
        elif isinstance(event, C.LayoutChanged):
            lay = event.layout
            write("layout", schedule=lay.schedule, stages=lay.stages, microbatches=lay.microbatches,
                  stage_devices=list(lay.stage_devices), at_ns=lay.at_ns, received_ns=event.received_ns)

    def sent(self, grant: C.Grant) -> dict[str, int]:
        """What a grant's record says of when it went (its worker's CPU time, then the time), read as it is
        sent, for :meth:`action` to write later."""
        cpu = self._cpu(grant.task_id)  # read before the time it is stamped with: a bound stays a bound
        return {"at_ns": self.now_ns(), **cpu}

    def action(self, action: Any, sent: dict[str, int] | None = None) -> None:
        """An action, once the loop applied it (a grant: ``sent`` from :meth:`sent`, else read now)."""
        write = self.writer.write
        if isinstance(action, C.Grant):
            write("grant", task=action.task_id, grant=action.grant_id, deadline_ns=action.deadline_ns,
                  margin_ns=action.margin_ns, thaw=action.thaw, **({"late": True} if action.late else {}),
                  **(sent or self.sent(action)))
        elif isinstance(action, C.Park):
            write("park", task=action.task_id, grant=action.grant_id, at_ns=self.now_ns())
        elif isinstance(action, C.Freeze):
            # At the trainer's stop, where it stopped the step at the end (the worker's CPU time stood still since).
            write("freeze", task=action.task_id, at_ns=action.at_ns or self.now_ns(), **self._cpu(action.task_id),
                  **({"by": "trainer"} if action.at_ns else {}))
        elif isinstance(action, C.StateChanged):
            write("state", task=action.task_id, old=action.old.value if action.old else None, new=action.new.value,
                  reason=action.reason, at_ns=self.now_ns())

    def _cpu(self, task_id: str) -> dict[str, int]:
        cpu = self.cpu_of(task_id)
        return {} if cpu is None else {"cpu_ns": cpu}

    def steps(self, task_id: str, parked: Parked) -> None:
        # A worker of an older version sends no starts: its grant then has no spans.
        spans = [[s, s + d] for s, d in zip(parked.starts_ns, parked.durations_ns, strict=False)]
        extra: dict[str, Any] = {"start_cpu_ns": parked.last_start_cpu_ns} if parked.last_start_cpu_ns else {}
        if parked.costs_ns:  # what the step-time estimate learned of each span, where it differs from the span
            extra["costs"] = list(parked.costs_ns)
        if parked.worked_ns:
            extra["worked_ns"] = parked.worked_ns
        self.writer.write("steps", task=task_id, grant=parked.grant_id, reason=parked.reason, count=parked.steps,
                          spans=spans, **extra)

    def poll(self, now: int) -> None:
        """Once a second: the trace can be followed while the manager runs, and a kill -9 loses at most
        that second (a write to the page cache, not an fsync)."""
        if now >= self._next_flush_ns:
            self._next_flush_ns = now + FLUSH_INTERVAL_NS
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The records of a trace file, in order; a torn last line (a killed manager) is skipped."""
    records: list[dict[str, Any]] = []
    with path.open() as fh:
        for line in fh:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
