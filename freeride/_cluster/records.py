"""A task's cluster record as plain data, and what a manager's loop and its queue agent tell each other.

The agent never imports the manager: the messages between them are defined here (the loop's
cluster bridge turns them into core events), and a cluster task travels between them as a
:class:`~freeride.messages.TaskRecord`, its figures as the :class:`~freeride.messages.TaskProgress`
every other record embeds.

The record lives in one Redis hash per task (:mod:`freeride._cluster.redis_queue` names the keys);
here it is a frozen dataclass. :func:`new_task_fields` and :func:`status_fields` write the hash's
fields; :mod:`freeride._cluster.schema` reads them back, strictly (a record that cannot be read is set
aside, never guessed at). The submission is kept as it travelled
(:class:`~freeride._validation.Submission`, arguments as JSON text): a manager validates
it, with the same function as ``Submit``, when it claims the task.

Record states: ``QUEUED`` (in the queue, nobody holds it), ``CLAIMED`` (a manager took it and is
about to add it), then the holding manager's own task states (``SUBMITTED`` ... ``FROZEN``), and
finally ``FINISHED``, ``FAILED`` or ``CANCELLED``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from freeride._cluster.placement import Capacity
from freeride._cluster.scripts import SCHEMA
from freeride._validation import Submission, slug
from freeride.messages import FailureRecord, ShowsProgress, TaskProgress, TaskRecord

QUEUED = "QUEUED"
CLAIMED = "CLAIMED"
#: Not a state a record holds: what a listing shows for a record the queue set aside (see ``schema.py``).
SET_ASIDE = "SET_ASIDE"
#: Not a state either: what a listing shows for a record it cannot read, not set aside, whose own state field
#: cannot be read either.
UNREADABLE = "UNREADABLE"
TERMINAL = ("FINISHED", "FAILED", "CANCELLED")
#: Cluster task ids end in ``-q<seq>``: a manager's own ids end in ``-<seq>``, so the two never meet
#: in one manager (both are ``[a-z0-9-]``, safe as directory names).
CLUSTER_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,40}-q[0-9]{1,18}")


def cluster_task_id(name: str, seq: int) -> str:
    return f"{slug(name)}-q{seq}"


def is_cluster_id(task_id: str) -> bool:
    return CLUSTER_ID_RE.fullmatch(task_id) is not None


def display_name(sub: Submission) -> str:
    if sub.name:
        return sub.name
    if sub.target:
        return sub.target.rsplit(":", 1)[-1]
    return sub.command[0].rsplit("/", 1)[-1] if sub.command else "task"


def encode_submission(sub: Submission) -> str:
    return json.dumps({
        "target": sub.target,
        "args_json": sub.args_json,
        "memory_bytes": sub.memory_bytes,
        "priority": sub.priority,
        "name": sub.name,
        "command": list(sub.command),
        "working_dir": sub.working_dir,
        "checkpoint_interval_s": sub.checkpoint_interval_s,
        "step_time_hint_ms": sub.step_time_hint_ms,
    }, separators=(",", ":"))


@dataclass(frozen=True)
class ClusterRecord(ShowsProgress):
    """One task of the cluster, as its hash says. Its submission is kept as it travelled: a manager
    validates it when it claims the task."""

    task_id: str
    submission: Submission
    seq: int = 0
    state: str = QUEUED
    owner: str = ""  # the holding manager's consumer name; "" while queued or done
    device: str = ""  # "node/device" of the holding manager
    epoch: int = 0  # claims so far: a fencing token, every write of a holder carries it
    entry: str = ""  # the task's stream entry
    figures: TaskProgress = field(default_factory=TaskProgress)
    checkpoint_path: str = ""
    failure: FailureRecord | None = None
    reason: str = ""  # why it last moved (claimed, lease expired, evicted, ...)
    submitted_unix: float = 0.0
    updated_unix: float = 0.0
    cancel_requested: bool = False
    #: Why the queue set this record aside (it cannot be read or used); "" for a record in use. The state
    #: is then ``SET_ASIDE``, whatever the record's own state field says.
    aside: str = ""
    aside_unix: float = 0.0
    #: Why a listing cannot read this record, which the queue has not set aside (yet: a manager does when its
    #: peek, claim, sweep or hand-back meets it; a task whose holder runs it keeps its record until it ends).
    #: The state is then the record's own where that reads, else ``UNREADABLE``; "" for a record that reads.
    unreadable: str = ""

    @property
    def name(self) -> str:
        return display_name(self.submission)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def new_task_fields(sub: Submission, now_unix: float) -> dict[str, str]:
    """The fields of a new submission's hash (the queue adds seq, entry and state)."""
    return {
        "schema": str(SCHEMA),
        "spec": encode_submission(sub),
        "name": display_name(sub),
        "memory_bytes": str(sub.memory_bytes),
        "priority": str(sub.priority),
        "step_hint_ms": repr(float(sub.step_time_hint_ms)),
        "epoch": "0",
        "steps": "0",
        "progress": "0.0",
        "progress_unit": "steps",
        "checkpoint_step": "-1",
        "checkpoint_path": "",
        "restarts": "0",
        "step_p95_ms": "0.0",
        "harvested_s": "0.0",
        "overruns": "0",
        "failure": "",
        "reason": "submitted",
        "submitted_unix": repr(now_unix),
        "updated_unix": repr(now_unix),
        "cancel": "0",
    }


# ---------------------------------------------------------------- loop <-> agent


@dataclass(frozen=True)
class ClaimedTask:
    """The agent claimed this task from the queue (posted to the loop, which adds it): its spec validated,
    its figures and checkpoint as its last holder left them, ``state`` ``CLAIMED``; ``epoch``, the claim's
    fencing token, names the directory its checkpoints go to (``<checkpoint root>/<id>/e<epoch>``)."""

    record: TaskRecord
    epoch: int = 1

    @property
    def task_id(self) -> str:
        return self.record.task_id


@dataclass(frozen=True)
class ReleaseTask:
    """The agent asks the loop to let a cluster task go: hand it back with a checkpoint (it waited here
    for memory too long), or, without one, kill the copy here (its lease was lost to another manager)."""

    task_id: str
    reason: str
    checkpoint: bool = True


@dataclass(frozen=True)
class CancelTask:
    """A user cancelled a cluster task through the queue (``freeride cancel --queue``)."""

    task_id: str


@dataclass(frozen=True)
class GetQueueView:
    """The agent's question to the loop at each poll (``call_async``): answered with a :class:`QueueView`."""


def status_fields(record: TaskRecord, now_unix: float) -> dict[str, str]:
    """The hash fields a holder writes for a task it holds (``record``: the task as the holder sees it now)."""
    figures = record.figures
    return {
        "state": record.state,
        "steps": str(figures.steps),
        "progress": repr(float(figures.progress)),
        "progress_unit": figures.progress_unit,
        "checkpoint_step": str(figures.checkpoint_step),
        "checkpoint_path": record.checkpoint_path,
        "restarts": str(figures.restarts),
        "step_p95_ms": repr(float(figures.step_p95_ms)),
        "harvested_s": repr(float(figures.harvested_s)),
        "overruns": str(figures.overruns),
        "failure": json.dumps(record.failure.to_json()) if record.failure is not None else "",
        "updated_unix": repr(now_unix),
    }


@dataclass(frozen=True)
class QueueView:
    """What the agent asks the loop for at each poll: room for more, and the cluster tasks held here."""

    capacity: Capacity
    tasks: tuple[TaskRecord, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class QueueNote:
    """The loop tells the agent that a cluster task is done here.

    ``ended``: it reached a terminal state (the queue records it and forgets the task).
    ``left``: it left this device (evicted, drained, released) and goes back to the queue.
    ``lost``: another manager holds it now; this copy is gone and writes nothing.
    """

    kind: str
    record: TaskRecord
    reason: str = ""
