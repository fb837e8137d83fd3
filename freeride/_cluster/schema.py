"""Reading the queue's keys: every value that comes back from Redis is decoded here, and none is trusted.

Anyone who can reach the queue's Redis can write to it, and a record may come from another version of
freeride, a hand edit, or a write cut short. So :class:`~freeride._cluster.redis_queue.RedisQueue` asks
Redis for bytes (never for decoded text: one byte that is not UTF-8 would then fail the whole reply,
and with it every listing and every claim loop), and this module turns them into plain data strictly:

* :func:`decode_record` reads a task's hash into a :class:`~freeride._cluster.records.ClusterRecord`, or
  raises :class:`Unreadable` with a reason naming the field and what is wrong with it (not UTF-8, missing,
  not a number, not a known state, a spec that does not parse, a schema version newer than this freeride
  reads). Nothing is guessed: a field that does not parse never silently takes a default.
* :func:`candidate_of` reads the fields placement needs of a waiting task (the claim loop's peek).
* :func:`text_of` / :func:`task_id_of` read ids from the index, the waiting room and the dead-letter hash.
* :func:`salvage`, :func:`set_aside_record` and :func:`unreadable_record` build what a listing shows for a
  record that cannot be read: whatever fields do parse and the reason, with the state ``SET_ASIDE`` once the
  queue set it aside (the dead-letter hash names it), and the record's own state until then.

The managers *set aside* what cannot be read (``redis_queue.py``): a claim loop, a sweep or a listing
never stops on it. Records carry a schema version (``schema``; :data:`~freeride._cluster.scripts.SCHEMA`);
one without the field predates it and is read as schema 1, whose fields it has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from freeride._cluster.placement import Candidate
from freeride._cluster.records import CLAIMED, QUEUED, SET_ASIDE, UNREADABLE, ClusterRecord, is_cluster_id
from freeride._cluster.scripts import SCHEMA
from freeride._validation import MAX_PRIORITY, Submission
from freeride.messages import FailureRecord, TaskProgress
from freeride.states import TaskState

MS = 1_000_000
#: Every state a record may be in.
STATES = frozenset({QUEUED, CLAIMED, *(s.value for s in TaskState)})
#: The fields every schema-1 record has (freeride has written all of them since the queue exists).
REQUIRED = (
    "spec", "name", "memory_bytes", "priority", "seq", "state", "entry", "epoch", "owner", "device", "step_hint_ms",
    "steps", "progress", "progress_unit", "checkpoint_step", "checkpoint_path", "restarts", "step_p95_ms",
    "harvested_s", "failure", "reason", "submitted_unix", "updated_unix", "cancel",
)
#: What placement reads of a waiting task (:meth:`RedisQueue.waiting` fetches these, in this order).
PLACEMENT_FIELDS = ("schema", "memory_bytes", "priority", "seq", "step_hint_ms", "step_p95_ms")
_ENTRY_RE = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
_INT_RE = re.compile(r"-?[0-9]{1,19}")
_SHOWN = 60


class Unreadable(ValueError):
    """A value read from the queue cannot be used; ``str()`` says which and why."""


def shown(raw: bytes | str) -> str:
    """A printable form of a value as stored: bytes that are not UTF-8 as ``\\xNN``, cut to a line."""
    text = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def text_of(raw: bytes | None, what: str) -> str:
    if raw is None:
        raise Unreadable(f"it has no {what} field")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable(f"its {what} is not UTF-8 text ({shown(raw)})") from None


def task_id_of(raw: bytes) -> str:
    """A task id as stored in the index or the waiting room."""
    try:
        task_id = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable(f"the id {shown(raw)} is not UTF-8 text") from None
    if not is_cluster_id(task_id):
        raise Unreadable(f"{shown(task_id)} is not a cluster task id")
    return task_id


def _whole(text: str, what: str, lo: int, hi: int) -> int:
    if not _INT_RE.fullmatch(text):
        raise Unreadable(f"its {what} is not a whole number ({shown(text)})")
    value = int(text)
    if not lo <= value <= hi:
        raise Unreadable(f"its {what} ({value}) is out of range [{lo}, {hi}]")
    return value


def _real(text: str, what: str, lo: float = -math.inf) -> float:
    try:
        value = float(text)
    except ValueError:
        raise Unreadable(f"its {what} is not a number ({shown(text)})") from None
    if not math.isfinite(value) or value < lo:
        raise Unreadable(f"its {what} ({shown(text)}) is not a finite number >= {lo}")
    return value


def schema_of(raw: bytes | None) -> int:
    """The record's schema version; :class:`Unreadable` if it is not one this freeride reads."""
    if raw is None:
        return 1  # written before records carried the field: schema 1's fields
    version = _whole(text_of(raw, "schema version"), "schema version", 1, 10**9)
    if version > SCHEMA:
        raise Unreadable(f"it was written by a newer freeride (record schema {version}; this one reads up to "
                         f"{SCHEMA})")
    return version


def decode_submission(text: str) -> Submission:
    """The stored submission; :class:`Unreadable` if it is not one (validation proper comes at the claim)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise Unreadable(f"its spec is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise Unreadable("its spec is not a JSON object")

    def get(key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in data:
            raise Unreadable(f"its spec has no {key!r}")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise Unreadable(f"its spec's {key!r} is not a {getattr(kind, '__name__', 'number')}")
        return value

    command = get("command", list)
    if not all(isinstance(a, str) for a in command):
        raise Unreadable("its spec's command is not a list of strings")
    return Submission(
        target=get("target", str), args_json=get("args_json", str), memory_bytes=get("memory_bytes", int),
        priority=get("priority", int), name=get("name", str), command=tuple(command),
        working_dir=get("working_dir", str), checkpoint_interval_s=float(get("checkpoint_interval_s", (int, float))),
        step_time_hint_ms=float(get("step_time_hint_ms", (int, float))),
    )


def _texts(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """Every field as text; :class:`Unreadable` naming the first that is not UTF-8."""
    out = {}
    for key, value in raw.items():
        name = text_of(key, "field name")
        out[name] = text_of(value, name)
    return out


def decode_record(task_id: str, raw: Mapping[bytes, bytes]) -> ClusterRecord:
    """A task's hash as stored, read strictly; :class:`Unreadable` says why it cannot be."""
    if not raw:
        raise Unreadable("it has no record")
    schema_of(raw.get(b"schema"))
    f = _texts(raw)
    missing = [name for name in REQUIRED if name not in f]
    if missing:
        raise Unreadable(f"it lacks the field(s) {', '.join(missing)}")
    sub = decode_submission(f["spec"])
    memory = _whole(f["memory_bytes"], "memory_bytes", 0, 2**62)
    priority = _whole(f["priority"], "priority", -MAX_PRIORITY, MAX_PRIORITY)
    if (memory, priority) != (sub.memory_bytes, sub.priority):
        raise Unreadable(f"its memory_bytes and priority ({memory}, {priority}) differ from its spec's "
                         f"({sub.memory_bytes}, {sub.priority})")
    if f["state"] not in STATES:
        raise Unreadable(f"its state {shown(f['state'])} is not one freeride knows")
    if not _ENTRY_RE.fullmatch(f["entry"]):
        raise Unreadable(f"its entry {shown(f['entry'])} is not a stream id")
    if f["cancel"] not in ("0", "1"):
        raise Unreadable(f"its cancel flag {shown(f['cancel'])} is neither 0 nor 1")
    failure = None
    if f["failure"]:
        try:
            data = json.loads(f["failure"])
            failure = FailureRecord.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise Unreadable("its failure is not a failure record") from None
    _real(f["step_hint_ms"], "step_hint_ms", 0.0)
    return ClusterRecord(
        task_id=task_id,
        submission=sub,
        seq=_whole(f["seq"], "seq", 1, 2**33 - 1),
        state=f["state"],
        owner=f["owner"],
        device=f["device"],
        epoch=_whole(f["epoch"], "epoch", 0, 2**53),
        entry=f["entry"],
        figures=TaskProgress(
            steps=_whole(f["steps"], "steps", 0, 2**62),
            progress=_real(f["progress"], "progress"),
            progress_unit=f["progress_unit"] or "steps",
            checkpoint_step=_whole(f["checkpoint_step"], "checkpoint_step", -1, 2**62),
            restarts=_whole(f["restarts"], "restarts", 0, 2**62),
            step_p95_ms=_real(f["step_p95_ms"], "step_p95_ms", 0.0),
            harvested_s=_real(f["harvested_s"], "harvested_s", 0.0),
            # Written since the queue's records carry it (they all read "overruns 0" before): optional.
            overruns=_whole(f.get("overruns") or "0", "overruns", 0, 2**62),
        ),
        checkpoint_path=f["checkpoint_path"],
        failure=failure,
        reason=f["reason"],
        submitted_unix=_real(f["submitted_unix"], "submitted_unix", 0.0),
        updated_unix=_real(f["updated_unix"], "updated_unix", 0.0),
        cancel_requested=f["cancel"] == "1",
    )


def candidate_of(task_id: str, row: Sequence[bytes | None]) -> Candidate:
    """A waiting task as placement sees it, from :data:`PLACEMENT_FIELDS`; :class:`Unreadable` if it cannot be.

    Every claim attempt reads up to 64 of these, so well-formed values take a short path (ASCII digits, a
    finite float, checked on the bytes); anything else goes through the strict readers for the reason.
    """
    schema_raw, memory, priority, seq, hint, p95 = row
    if schema_raw != b"1":
        schema_of(schema_raw)
    step_ms = _fast_real(p95, "step_p95_ms") or _fast_real(hint, "step_hint_ms")
    return Candidate(
        task_id,
        _fast_whole(memory, "memory_bytes", 0, 2**62),
        _fast_whole(priority, "priority", -MAX_PRIORITY, MAX_PRIORITY),
        _fast_whole(seq, "seq", 1, 2**33 - 1),
        int(step_ms * MS) if step_ms > 0 else None,
    )


def _fast_whole(raw: bytes | None, what: str, lo: int, hi: int) -> int:
    if raw is not None and 0 < len(raw) <= 19 and (raw.isdigit() or (raw[:1] == b"-" and raw[1:].isdigit())):
        value = int(raw)
        if lo <= value <= hi:
            return value
    return _whole(text_of(raw, what), what, lo, hi)


def _fast_real(raw: bytes | None, what: str) -> float:
    try:
        value = float(raw) if raw is not None and raw.isascii() else math.nan
    except ValueError:
        value = math.nan
    return value if math.isfinite(value) and value >= 0.0 else _real(text_of(raw, what), what, 0.0)


# ------------------------------------------------------------------ what a listing shows of the rest


def dead_letter(raw: bytes) -> tuple[str, float]:
    """The reason and time of a dead-letter entry (a JSON object the scripts or the agent wrote)."""
    text = raw.decode("utf-8", "replace")
    try:
        data = json.loads(text)
        return str(data["reason"]), float(data.get("at_unix") or 0.0)
    except (ValueError, KeyError, TypeError):
        return shown(text), 0.0


def dead_letter_value(reason: str, at_unix: float, entry: str = "") -> str:
    return json.dumps({"reason": reason, "at_unix": at_unix, "entry": entry})


def salvage(task_id: str, raw: Mapping[bytes, bytes]) -> ClusterRecord:
    """What can be read of a record that does not decode: every field that parses, defaults for the rest."""
    f = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}

    def num(key: str, kind: Any, default: Any) -> Any:
        try:
            value = kind(f[key])
            return value if math.isfinite(value) else default
        except (KeyError, ValueError, OverflowError):
            return default

    try:
        sub = decode_submission(f.get("spec", ""))
    except Unreadable:
        sub = Submission(name=f.get("name", ""), memory_bytes=num("memory_bytes", int, 0),
                         priority=num("priority", int, 0))
    return ClusterRecord(
        task_id=task_id, submission=sub, seq=num("seq", int, 0), state=f.get("state", ""),
        owner=f.get("owner", ""), device=f.get("device", ""), epoch=num("epoch", int, 0), entry=f.get("entry", ""),
        figures=TaskProgress(steps=num("steps", int, 0), progress=num("progress", float, 0.0),
                             checkpoint_step=num("checkpoint_step", int, -1), restarts=num("restarts", int, 0)),
        checkpoint_path=f.get("checkpoint_path", ""), reason=f.get("reason", ""),
        submitted_unix=num("submitted_unix", float, 0.0), updated_unix=num("updated_unix", float, 0.0),
    )


def _base_row(task_id: str, raw: Mapping[bytes, bytes]) -> ClusterRecord:
    """What fields of a record that cannot be used do parse (:func:`salvage`); a bare row without any."""
    return salvage(task_id, raw) if raw else ClusterRecord(task_id, Submission(name="-"))


def set_aside_record(task_id: str, raw: Mapping[bytes, bytes], reason: str, at_unix: float = 0.0) -> ClusterRecord:
    """A record as a listing shows it once the queue set it aside: state ``SET_ASIDE``, the reason."""
    return dataclasses.replace(_base_row(task_id, raw), state=SET_ASIDE, aside=reason, aside_unix=at_unix, owner="",
                               device="")


def unreadable_record(task_id: str, raw: Mapping[bytes, bytes], reason: str, state: str = "") -> ClusterRecord:
    """A record a listing cannot read and the queue has not set aside: what fields do parse, the reason, and the
    record's own state (``state`` where the caller read only that field) if it is one, else ``UNREADABLE``.
    Counted apart from set-aside records, so that a listing agrees with the queue's figures (``stats``)."""
    base = _base_row(task_id, raw)
    own = state or base.state
    return dataclasses.replace(base, state=own if own in STATES else UNREADABLE, unreadable=reason)


def record_or_aside(task_id: str, raw: Mapping[bytes, bytes], aside: tuple[str, float] | None) -> ClusterRecord:
    """A listing's row: the record if it reads and was not set aside, else what can be shown of it and why."""
    if aside is not None:
        return set_aside_record(task_id, raw, aside[0], aside[1])
    try:
        return decode_record(task_id, raw)
    except Unreadable as exc:
        return unreadable_record(task_id, raw, str(exc))

