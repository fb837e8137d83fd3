"""The cluster-queue forms of ``submit``, ``ls``, ``show`` and ``cancel`` (``--queue URL``).

    freeride submit MODULE:CLASS --queue redis://host:6379/0 [--memory 2GiB ...]
    freeride ls --queue URL [--all]
    freeride show ID --queue URL
    freeride cancel ID --queue URL

A submission is validated here exactly as a manager's ``Submit`` validates it
(:func:`freeride._validation.validate_spec`), then put on the queue's stream; the managers
that joined the queue place it. ``ls`` shows every task of the cluster with the device holding it,
its state and progress; a record the queue set aside (it cannot be read or used: another version of
freeride wrote it, a hand edit, a write cut short) is listed by ``ls --all`` and ``show`` as
``SET_ASIDE`` with the reason, and never makes a listing fail. Exit codes: 2 for a malformed URL or a
rejected submission, 3 when the queue's Redis cannot be reached, 4 for an unknown task, 5 for refused credentials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

from freeride._cluster import require_client
from freeride._cluster.records import ClusterRecord
from freeride._cluster.url import parse_queue_url
from freeride._validation import submission_of, validate_spec
from freeride.errors import ConfigError, TaskNotFound
from freeride.messages import QueueStats, TaskSpec
from freeride.units import format_mib, format_progress, format_size


@contextlib.contextmanager
def open_queue(url_text: str) -> Iterator[Any]:
    """A connected :class:`~freeride._cluster.redis_queue.RedisQueue`, closed on exit."""
    url = parse_queue_url(url_text)
    require_client()
    from freeride._cluster.redis_queue import RedisQueue

    queue = RedisQueue(url)
    try:
        queue.connect()
        yield queue
    finally:
        queue.close()


def submit(url_text: str, spec: TaskSpec) -> ClusterRecord:
    """Validate ``spec`` as ``Submit`` does and put it on the queue; its new record."""
    parse_queue_url(url_text)  # a malformed URL is bad input before the submission is looked at
    checked = validate_spec(spec)
    with open_queue(url_text) as queue:
        _check_fits_a_device(checked, queue.devices(time.time()))
        task_id = queue.submit(submission_of(checked))
        record = queue.record(task_id)
    assert record is not None
    return record


def _check_fits_a_device(spec: TaskSpec, devices: list[tuple[str, int]]) -> None:
    """ConfigError when the queue's live managers announced devices, none as large as ``spec``'s cap: such a
    task was accepted and waited, QUEUED, for ever (a manager's ``Submit`` refuses it). With none announced
    (no manager up yet), the task is accepted."""
    if not devices:
        return
    where, largest = max(devices, key=lambda device: device[1])
    if spec.memory_bytes > largest:
        raise ConfigError(f"memory {format_mib(spec.memory_bytes)} is more than any device of this queue has in "
                          f"all (the largest: {where}, {format_mib(largest)}): the task could never be placed")


def records(url_text: str, include_finished: bool) -> list[ClusterRecord]:
    with open_queue(url_text) as queue:
        return list(queue.records(include_finished))


def record(url_text: str, task_id: str) -> ClusterRecord:
    with open_queue(url_text) as queue:
        found = queue.record(task_id)
    if found is None:
        raise TaskNotFound(f"no task {task_id!r} in the queue")
    return found


def cancel(url_text: str, task_id: str) -> str:
    """``CANCELLED`` (it was queued), ``REQUESTED`` (its holder cancels it), or its terminal state."""
    with open_queue(url_text) as queue:
        outcome = queue.cancel(task_id)
    if outcome == "MISSING":
        raise TaskNotFound(f"no task {task_id!r} in the queue")
    return outcome


def to_json(rec: ClusterRecord) -> dict[str, Any]:
    doc = dataclasses.asdict(rec)
    doc["name"] = rec.name
    doc["submission"]["command"] = list(rec.submission.command)
    return doc


def _progress(rec: ClusterRecord) -> str:
    return format_progress(rec.progress, rec.steps, rec.progress_unit)


def render_table(recs: Sequence[ClusterRecord], width: int | None = None) -> str:
    """The queue's ``ls``: one row per record; its last word (why it waits, was set aside or failed) as a last
    column, or under its row where the sentences would not fit in ``width`` (``tasks.with_reasons``)."""
    from freeride._cli.tasks import with_reasons

    rows = [["ID", "NAME", "STATE", "DEVICE", "PRIO", "MEMORY", "PROGRESS", "CHECKPOINT", "RESTARTS"]]
    for r in recs:
        rows.append([
            r.task_id, r.name, r.state, r.device or "-", str(r.submission.priority),
            format_size(r.submission.memory_bytes), _progress(r),
            f"step {r.checkpoint_step}" if r.checkpoint_step >= 0 else "-", str(r.restarts),
        ])
    reasons = [f"set aside: {r.aside}" if r.aside else f"cannot be read: {r.unreadable}" if r.unreadable
               else r.reason for r in recs]
    return "\n".join(with_reasons(rows, reasons, width, header="LAST"))


def render_record(rec: ClusterRecord) -> str:
    sub = rec.submission
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.submitted_unix)) if rec.submitted_unix else "-"
    fields = [
        ("task", rec.task_id),
        ("name", rec.name),
        ("state", rec.state + (" (cancel requested)" if rec.cancel_requested and not rec.terminal else "")),
        ("device", rec.device or "-"),
        ("command" if sub.command else "target", sub.target or " ".join(sub.command)),
        ("args", sub.args_json or "-"),
        ("memory", format_size(sub.memory_bytes)),
        ("priority", str(sub.priority)),
        ("progress", f"{_progress(rec)} ({rec.steps} steps)"),
        ("checkpoint", f"step {rec.checkpoint_step}" if rec.checkpoint_step >= 0 else "-"),
        ("step p95", f"{rec.step_p95_ms:.2f} ms" if rec.step_p95_ms else "-"),
        ("overruns", f"{rec.figures.overruns} (on its current holder)"),
        ("restarts", str(rec.restarts)),
        ("claims", str(rec.epoch)),
        ("last", rec.reason or "-"),
        ("submitted", when),
    ]
    if rec.aside:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.aside_unix)) if rec.aside_unix else ""
        fields.insert(3, ("set aside", rec.aside + (f" (at {when})" if when else "")))
    elif rec.unreadable:
        fields.insert(3, ("unreadable", f"{rec.unreadable} (the queue has not set it aside)"))
    text = "\n".join(f"{k + ':':<11} {v}" for k, v in fields)
    if rec.failure is not None:
        from freeride._cli.tasks import render_failure

        text += "\n" + render_failure(rec.failure)
    return text


def unusable_note(every: Sequence[ClusterRecord], listed_all: bool) -> str:
    """What ``ls --queue`` says under its table of the records that cannot be used: those the queue set aside
    (counted as ``stats`` counts them) and those it cannot read but has not set aside, each count apart, so
    that no such record goes unnoticed and the counts agree with the managers'; "" when there is none."""
    aside = sum(1 for r in every if r.aside)
    unread = [r for r in every if r.unreadable]
    lines = []
    if aside and not listed_all:
        lines.append(f"{aside} record(s) set aside because they cannot be read; --all lists them with the reason")
    if unread:
        hidden = sum(1 for r in unread if r.terminal) if not listed_all else 0
        more = f" ({hidden} ended: --all lists them)" if hidden else ""
        lines.append(f"{len(unread)} record(s) cannot be read, not set aside by the queue{more}; each is listed "
                     "with the reason")
    return "\n".join(lines)


def queue_line(q: QueueStats) -> str:
    """A manager's part in the cluster queue in one line (``stats`` and ``top`` show it)."""
    link = "connected" if q.connected else f"UNREACHABLE ({q.errors} failed polls: {q.last_error})"
    return (f"{link}  depth {q.depth}  held {q.held}  claims {q.claims}  reclaims {q.reclaims}  "
            f"renewals {q.renewals}  lost {q.lost}  set aside {q.set_aside} ({q.set_aside_here} here)  "
            f"lease {q.lease_ms} ms" + (f"  graces {q.graces}" if q.graces else ""))


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))
