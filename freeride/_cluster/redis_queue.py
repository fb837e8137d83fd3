"""The Redis edge of the cluster queue: the only module that imports ``redis``.

Keys (one queue per Redis database; the ``{freeride}`` hash tag keeps them in one slot)::

    {freeride}:stream      STREAM  one entry per task, added at submission, deleted when it ends
    {freeride}:task:<id>   HASH    the task's record (records.py): schema, spec, state, holder, progress, ...
    {freeride}:index       ZSET    every task id, scored by submission order (``ls`` reads it)
    {freeride}:waiting     ZSET    ids of queued tasks, scored by priority then submission order
    {freeride}:aside       HASH    records set aside (the dead letters): id -> {reason, at_unix, entry}
    {freeride}:clock       HASH    the contact clock: the server's run id, last contact, contact since
    {freeride}:seq         STRING  the submission counter
    {freeride}:sweeper     STRING  which manager sweeps expired leases now (a short-lived lock)

The stream has one consumer group, ``managers``. Every entry is always pending (delivered, not
acknowledged) to exactly one consumer until its task ends or is set aside:

* ``queue``, the group's own consumer, is the waiting room: a submission's entry is delivered to it
  at once (``XREADGROUP GROUP managers queue ... >``), and a task handed back returns to it
  (``XCLAIM ... queue JUSTID``);
* a manager's consumer (``node/device/pid-nonce``) while that manager holds the task. The pending
  entry's idle time is the lease: the holder renews it every third of the lease
  (``XCLAIM ... JUSTID``, which resets it), and ``XAUTOCLAIM ... queue <lease>`` moves entries whose
  holder stopped renewing back to the waiting room -- but only once managers have been in contact with
  the server for a whole lease (the contact clock, :mod:`~freeride._cluster.scripts`), so that a restart
  or an outage every manager saw never counts as the holders' silence.

Each operation that reads and then writes is one Lua script (:mod:`~freeride._cluster.scripts`), so it is
atomic on the server: a claim succeeds only if the task is queued and its entry is pending to ``queue``,
so two managers can never both take one task; renewals, progress, ends and hand-backs of a holder
succeed only if it still holds the task with the same claim epoch (a fencing token), so a manager that
lost a task (its lease expired while it could not reach Redis) learns so and writes nothing. A
submission is one script too: record, stream entry and delivery to the waiting room happen together or
not at all.

**Replies are bytes.** The client never decodes (``decode_responses=False``): every value is read by
:mod:`~freeride._cluster.schema`, and a record that cannot be read is set aside with the reason
(:meth:`RedisQueue.set_aside`, or the scripts themselves), so no value stored in Redis can make a claim
loop, a sweep or a listing fail.

Errors map onto freeride's tree in one place, :func:`redis_errors`: unreachable or timed out ->
:class:`~freeride.errors.QueueUnavailable` (exit 3), refused credentials ->
:class:`~freeride.errors.Unauthenticated` (exit 5), anything else -> :class:`~freeride.errors.FreerideError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.exceptions as rx

from freeride._cluster import schema, scripts
from freeride._cluster.placement import Candidate, Capacity
from freeride._cluster.records import ClusterRecord, display_name, is_cluster_id, new_task_fields
from freeride._cluster.url import QueueURL
from freeride._validation import Submission, slug
from freeride.errors import ConfigError, FreerideError, QueueUnavailable, Unauthenticated

GROUP = "managers"
#: The group's own consumer: entries pending to it are the queued (waiting) tasks.
QUEUE_CONSUMER = "queue"
NAMESPACE = "freeride"


@contextlib.contextmanager
def redis_errors(url: QueueURL) -> Iterator[None]:
    """Translate Redis client errors into the freeride error tree (the one place that does)."""
    try:
        yield
    except (rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError) as exc:
        raise Unauthenticated(f"the queue at {url} refused the credentials: {exc}") from None
    except rx.NoPermissionError as exc:
        raise Unauthenticated(f"the queue at {url} denied a command to this user: {exc}") from None
    except (rx.ConnectionError, rx.TimeoutError, OSError) as exc:
        raise QueueUnavailable(f"cannot reach the queue at {url}: {exc}") from None
    except rx.ResponseError as exc:
        text = str(exc)
        if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            raise Unauthenticated(f"the queue at {url} refused the credentials: {text}") from None
        if "DB index is out of range" in text:  # the URL's database number: bad input (exit 2), not a failure (1)
            raise ConfigError(f"the queue URL's database {url.db} is not one the server at {url} has: {text}") from None
        raise FreerideError(f"the queue at {url} answered with an error: {text}") from None
    except rx.RedisError as exc:
        raise FreerideError(f"queue error at {url}: {type(exc).__name__}: {exc}") from None



def _text(raw: Any) -> str:
    """A reply the scripts made themselves (a status, an id they built): ASCII, shown as-is if not."""
    return raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else str(raw)


@dataclass(frozen=True)
class Held:
    """A task this manager holds: what a renewal and every write must present."""

    task_id: str
    entry: str
    epoch: int


@dataclass(frozen=True)
class Peek:
    """The head of the waiting room as placement sees it, and the queue's depth.

    ``unreadable``: waiting ids whose placement fields cannot be read, each with why (set them aside);
    ``depth``: tasks waiting in the whole queue; ``set_aside``: records set aside so far.
    """

    candidates: list[Candidate] = field(default_factory=list)
    unreadable: list[tuple[bytes, str]] = field(default_factory=list)
    depth: int = 0
    set_aside: int = 0


@dataclass(frozen=True)
class Claim:
    """What a claim did: ``claimed`` (``record``), ``unreadable`` (claimed, but the record cannot be read:
    the claimer sets it aside as its holder, ``held`` and ``reason``), ``aside`` (the script set it aside,
    ``reason``), ``gone`` (no longer queued) or ``busy`` (its entry is pending to a manager)."""

    status: str
    record: ClusterRecord | None = None
    held: Held | None = None
    reason: str = ""


@dataclass(frozen=True)
class Sweep:
    """What a sweep did: ``busy`` (another manager swept within the period), ``grace`` (managers have not
    been in contact with the server for a whole lease yet: ``grace_ms`` left) or ``swept``; ``moved``:
    expired leases returned to the waiting room; ``set_aside``: records set aside on the way; ``fresh``:
    this sweep found the contact broken (a restart, or no manager had reached the server for a lease)."""

    status: str
    moved: int = 0
    set_aside: int = 0
    grace_ms: int = 0
    fresh: bool = False


@dataclass(frozen=True)
class Renewal:
    """What a heartbeat did: ids lost to another manager, ids a user cancelled, leases renewed."""

    lost: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    renewed: int = 0


class RedisQueue:
    """One connection (pool) to the queue's Redis; every method raises from the freeride error tree.

    Thread-confined by convention: the agent's thread, or a CLI command, owns an instance. ``timeout_s``
    bounds each command (a manager's agent passes a share of its lease, so that one stuck command cannot
    outlast a renewal).
    """

    def __init__(self, url: QueueURL, namespace: str = NAMESPACE, timeout_s: float = 2.0) -> None:
        self.url = url
        ns = "{" + namespace + "}"
        self.stream_key = f"{ns}:stream"
        self.index_key = f"{ns}:index"
        self.waiting_key = f"{ns}:waiting"
        self.aside_key = f"{ns}:aside"
        self.clock_key = f"{ns}:clock"
        self.seq_key = f"{ns}:seq"
        self.sweeper_key = f"{ns}:sweeper"
        self.devices_key = f"{ns}:devices"
        self.task_prefix = f"{ns}:task:"
        with redis_errors(url):
            self._r = redis.Redis.from_url(
                url.text,
                decode_responses=False,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                health_check_interval=30,
            )
        self._scripts = {
            name: self._r.register_script(getattr(scripts, name.upper()))
            for name in ("submit", "sweep", "peek", "claim", "heartbeat", "update", "finish", "release", "aside",
                         "cancel", "retire", "list")
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._r.close()

    def task_key(self, task_id: str | bytes) -> bytes:
        raw = task_id.encode("utf-8") if isinstance(task_id, str) else task_id
        return self.task_prefix.encode("ascii") + raw

    def _run(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        with redis_errors(self.url):
            return self._scripts[name](keys=list(keys), args=list(args))

    # ------------------------------------------------------------ setup

    def connect(self) -> None:
        """Check that the queue answers, and create the stream and its group if they do not exist."""
        with redis_errors(self.url):
            self._r.ping()
            try:
                self._r.xgroup_create(self.stream_key, GROUP, id="0", mkstream=True)
            except rx.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # ------------------------------------------------------------ users

    def submit(self, sub: Submission, now_unix: float | None = None) -> str:
        """Put a (validated) submission on the queue; its cluster task id."""
        now = time.time() if now_unix is None else now_unix
        args: list[Any] = [self.task_prefix, slug(display_name(sub)), GROUP, QUEUE_CONSUMER, repr(now)]
        for key, value in new_task_fields(sub, now).items():
            args += [key, value]
        task_id, _entry = self._run("submit", [self.seq_key, self.index_key, self.waiting_key, self.stream_key,
                                               self.aside_key], args)
        return _text(task_id)

    def records(self, include_finished: bool = True) -> list[ClusterRecord]:
        """Every task of the cluster in submission order, then records set aside that the index does not
        name (an entry that named no task): the ids with each record's size (one script), then one pipelined
        fetch of the records small enough to read. A record that cannot be read never fails the listing: it
        is listed with the reason, as ``SET_ASIDE`` if the queue set it aside, else in its own state
        (:func:`~freeride._cluster.schema.unreadable_record`); one over :data:`~scripts.MAX_RECORD_BYTES` is
        never fetched."""
        ids, sizes, states = self._run("list", [self.index_key, self.aside_key],
                                       [self.task_prefix, repr(time.time())])
        readable = [raw_id for raw_id, size in zip(ids, sizes, strict=True) if int(size) <= scripts.MAX_RECORD_BYTES]
        with redis_errors(self.url):
            pipe = self._r.pipeline(transaction=False)
            pipe.hgetall(self.aside_key)
            for raw_id in readable:
                pipe.hgetall(self.task_key(raw_id))
            replies = pipe.execute(raise_on_error=False)
        aside = _aside_map(replies[0])
        fetched = dict(zip(readable, replies[1:], strict=True))
        out = []
        for raw_id, size, state in zip(ids, sizes, states, strict=True):
            raw = fetched[raw_id] if raw_id in fetched else _Oversized(int(size), _text(state))
            out.append(self._row(raw_id, raw, aside.pop(raw_id, None)))
        for raw_id, why in aside.items():
            out.append(schema.set_aside_record(schema.shown(raw_id), {}, *why))
        return [r for r in out if include_finished or not (r.terminal or r.aside)]

    def record(self, task_id: str) -> ClusterRecord | None:
        """One task (or set-aside entry) by id; None if the queue has neither."""
        raw_id = task_id.encode("utf-8", "surrogateescape")
        key = self.task_key(raw_id)
        with redis_errors(self.url):
            pipe = self._r.pipeline(transaction=False)
            pipe.hget(self.aside_key, raw_id)
            pipe.memory_usage(key, samples=0)
            pipe.hstrlen(key, "state")
            dead, size, state_len = pipe.execute(raise_on_error=False)
            pipe = self._r.pipeline(transaction=False)
            oversized = isinstance(size, int) and size > scripts.MAX_RECORD_BYTES
            if not oversized:
                pipe.hgetall(key)
            elif isinstance(state_len, int) and state_len <= 16:  # short enough to be a state
                pipe.hget(key, "state")
            else:
                pipe.echo(b"")
            [raw] = pipe.execute(raise_on_error=False)  # WRONGTYPE comes back as the reply: not a hash
            if oversized:
                raw = _Oversized(int(size), _text(raw or b""))
        why = schema.dead_letter(dead) if isinstance(dead, bytes) else None
        if why is None and not isinstance(raw, (Exception, _Oversized)) and not raw:
            return None
        return self._row(raw_id, raw, why)

    @staticmethod
    def _row(raw_id: bytes, raw: Any, aside: tuple[str, float] | None) -> ClusterRecord:
        try:
            task_id = schema.task_id_of(raw_id)
            if isinstance(raw, Exception):  # WRONGTYPE: the key is not a hash
                raise schema.Unreadable("its record is not a hash")
            if isinstance(raw, _Oversized):
                raise schema.Unreadable(raw.reason)
        except schema.Unreadable as exc:
            if aside is not None:
                return schema.set_aside_record(schema.shown(raw_id), {}, *aside)
            state = raw.state if isinstance(raw, _Oversized) else ""
            return schema.unreadable_record(schema.shown(raw_id), {}, str(exc), state)
        return schema.record_or_aside(task_id, raw, aside)

    def cancel(self, task_id: str, now_unix: float | None = None) -> str:
        """Cancel a queued task at once, or ask its holder to (``REQUESTED``); its terminal state if it has
        one; ``SET_ASIDE`` if it was set aside; ``MISSING`` if unknown."""
        if not is_cluster_id(task_id):
            return "MISSING"
        now = repr(time.time() if now_unix is None else now_unix)
        return _text(self._run("cancel", [self.stream_key, self.waiting_key, self.task_key(task_id), self.aside_key],
                               [GROUP, task_id, now]))

    # ------------------------------------------------------------ managers

    def sweep(self, me: str, lease_ms: int, sweep_every_ms: int, now_unix: float) -> Sweep:
        """Move tasks whose holder's lease expired back to the waiting room (see :class:`Sweep`)."""
        status, moved, aside, grace_ms, fresh = self._run(
            "sweep", [self.stream_key, self.waiting_key, self.sweeper_key, self.clock_key, self.aside_key,
                      self.index_key],
            [self.task_prefix, GROUP, QUEUE_CONSUMER, lease_ms, me, sweep_every_ms, repr(now_unix)])
        return Sweep(_text(status), int(moved), int(aside), int(grace_ms), bool(int(fresh)))

    def waiting(self, limit: int = 64) -> Peek:
        """The first ``limit`` queued tasks in claim order, with what placement needs of them; the ones that
        cannot be read apart, with why; and the queue's depth and count of set-aside records. One script:
        members of the waiting room longer than any task id are set aside on the way, and a record over
        :data:`~scripts.MAX_RECORD_BYTES` is named unreadable without its fields being read."""
        depth, set_aside, ids, rows = self._run(
            "peek", [self.stream_key, self.waiting_key, self.aside_key],
            [self.task_prefix, limit, repr(time.time()), *schema.PLACEMENT_FIELDS])
        candidates, unreadable = [], []
        for raw_id, row in zip(ids, rows, strict=True):
            try:
                task_id = schema.task_id_of(raw_id)
                if isinstance(row, bytes):
                    raise schema.Unreadable(_text(row))
                candidates.append(schema.candidate_of(task_id, row))
            except schema.Unreadable as exc:
                unreadable.append((bytes(raw_id), str(exc)))
        return Peek(candidates, unreadable, int(depth), int(set_aside))

    def claim(self, task_id: str, me: str, device: str, now_unix: float) -> Claim:
        """Take a queued task (see :class:`Claim` for what can come of it)."""
        reply = self._run("claim", [self.stream_key, self.waiting_key, self.task_key(task_id), self.aside_key],
                          [GROUP, QUEUE_CONSUMER, me, device, repr(now_unix), task_id])
        status = _text(reply[0])
        if status == "aside":
            return Claim("aside", reason=_text(reply[1]))
        if status != "claimed":
            return Claim(status)
        flat = reply[1]
        raw = dict(zip(flat[::2], flat[1::2], strict=True))
        # The script checked these two (entry a stream id, epoch a whole number): the claimer can always
        # name what it holds, even when the rest of the record cannot be read.
        held = Held(task_id, _text(raw[b"entry"]), int(raw[b"epoch"]))
        try:
            return Claim("claimed", schema.decode_record(task_id, raw), held)
        except schema.Unreadable as exc:
            return Claim("unreadable", held=held, reason=str(exc))

    def set_aside(self, task_id: str | bytes, reason: str, now_unix: float, me: str = "",
                  held: Held | None = None) -> bool:
        """Set a record Python cannot read aside, with ``reason``: one this manager (``me``) holds (``held``:
        it claimed it), or one in the waiting room that nobody holds. False if that no longer applies."""
        raw_id = task_id.encode("utf-8") if isinstance(task_id, str) else task_id
        args = [GROUP, raw_id, repr(now_unix), reason, me if held else "", str(held.epoch) if held else ""]
        return bool(self._run("aside", [self.stream_key, self.waiting_key, self.task_key(raw_id), self.aside_key],
                              args))

    def heartbeat(self, me: str, held: Sequence[Held], lease_ms: int) -> Renewal:
        """Renew the leases of ``held`` (and mark the contact clock, even with nothing held)."""
        args: list[Any] = [GROUP, me, lease_ms]
        for h in held:
            args += [h.entry, str(h.epoch)]
        lost, cancel, renewed = self._run(
            "heartbeat", [self.stream_key, self.clock_key, *(self.task_key(h.task_id) for h in held)], args)
        return Renewal([held[int(i) - 1].task_id for i in lost], [held[int(i) - 1].task_id for i in cancel],
                       int(renewed))

    def update(self, me: str, writes: Sequence[tuple[Held, dict[str, str]]]) -> list[bool]:
        """Write progress of held tasks, one round trip; False where the task is no longer held."""
        if not writes:
            return []
        with redis_errors(self.url):
            pipe = self._r.pipeline(transaction=False)
            for h, fields in writes:
                args: list[Any] = [me, str(h.epoch)]
                for key, value in fields.items():
                    args += [key, value]
                self._scripts["update"](keys=[self.task_key(h.task_id)], args=args, client=pipe)
            return [bool(x) for x in pipe.execute()]

    def finish(self, me: str, h: Held, fields: dict[str, str]) -> bool:
        """Record a terminal state and acknowledge the task's entry; False if no longer held."""
        args: list[Any] = [GROUP, me, str(h.epoch)]
        for key, value in fields.items():
            args += [key, value]
        return bool(self._run("finish", [self.stream_key, self.task_key(h.task_id)], args))

    def release(self, me: str, h: Held, fields: dict[str, str], now_unix: float) -> str:
        """Hand a held task back to the waiting room: ``released``, ``lost`` (no longer held) or ``aside``
        (its record can no longer be queued: set aside)."""
        args: list[Any] = [GROUP, QUEUE_CONSUMER, me, str(h.epoch), h.task_id, repr(now_unix)]
        for key, value in fields.items():
            args += [key, value]
        done = int(self._run("release", [self.stream_key, self.waiting_key, self.task_key(h.task_id),
                                         self.aside_key], args))
        return {1: "released", 2: "aside"}.get(done, "lost")

    def retire(self, me: str) -> bool:
        """Remove this manager's consumer from the group if it holds nothing, and its device's entry."""
        with redis_errors(self.url):
            self._r.hdel(self.devices_key, me)
        return bool(self._run("retire", [self.stream_key], [GROUP, me]))

    # ------------------------------------------------------------ the devices that serve the queue

    def announce(self, me: str, where: str, capacity: Capacity, held: int, lease_ms: int,
                 now_unix: float) -> list[Peer]:
        """Manager ``me`` serves ``where`` now, holding ``held`` cluster tasks, with room as ``capacity`` says (its
        device's size, for ``submit --queue`` to check a cap against; what it could place, for an overloaded
        manager to hand a task over to it). Returns the other live managers as the same read found them
        (:meth:`peers`); entries of managers gone longer than a day are dropped here."""
        entry = json.dumps({
            "where": where, "total_bytes": int(capacity.total_bytes), "lease_ms": int(lease_ms), "at_unix": now_unix,
            "held": int(held), "capacity": dataclasses.asdict(capacity),
        })
        with redis_errors(self.url):
            self._r.hset(self.devices_key, me, entry)
            read = {k: _peer(k, v) for k, v in self._r.hgetall(self.devices_key).items()}
            stale = [k for k, peer in read.items() if peer is None or peer.at_unix < now_unix - DEVICE_ENTRY_KEPT_S]
            if stale:
                self._r.hdel(self.devices_key, *stale)
        return [p for p in _live(read.values(), now_unix) if p.me != me]

    def peers(self, now_unix: float) -> list[Peer]:
        """The managers that announced themselves within three of their leases; an entry that does not decode
        is skipped (and dropped at the next :meth:`announce`)."""
        with redis_errors(self.url):
            raw = self._r.hgetall(self.devices_key)
        return _live((_peer(k, v) for k, v in raw.items()), now_unix)

    def devices(self, now_unix: float) -> list[tuple[str, int]]:
        """(where, total bytes) of each live manager's device (:meth:`peers`) that knows its size."""
        return [(p.where, p.total_bytes) for p in self.peers(now_unix) if p.total_bytes > 0]


#: How long the entry of a manager that stopped announcing itself stays in the devices hash.
DEVICE_ENTRY_KEPT_S = 86_400.0


@dataclass(frozen=True)
class Peer:
    """A manager of the queue as it last announced itself: ``capacity`` None for one that did not say (an older
    freeride: it is never handed a task)."""

    me: str
    where: str
    total_bytes: int
    at_unix: float
    live_s: float
    held: int = 0
    capacity: Capacity | None = None


def _live(peers: Iterable[Peer | None], now_unix: float) -> list[Peer]:
    """The entries that decode and whose manager announced itself within three of its leases."""
    return [p for p in peers if p is not None and now_unix - p.at_unix <= p.live_s]


def _peer(key: Any, raw: Any) -> Peer | None:
    """A devices-hash entry, or None if it does not decode."""
    try:
        data = json.loads(raw)
        return Peer(_text(key), str(data["where"]), int(data["total_bytes"]), float(data["at_unix"]),
                    3 * int(data["lease_ms"]) / 1000, int(data.get("held", 0)), _capacity(data.get("capacity")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _capacity(raw: Any) -> Capacity | None:
    """An announced :class:`Capacity`, each field of its type; None if any is not."""
    if not isinstance(raw, dict):
        return None
    kinds: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(Capacity)}
    values: dict[str, Any] = {}
    for name, kind in kinds.items():
        value = raw.get(name)
        ok = {"int": type(value) is int, "bool": type(value) is bool, "str": type(value) is str,
              "int | None": value is None or type(value) is int}.get(str(kind), False)
        if not ok:
            return None
        values[name] = value
    return Capacity(**values)


@dataclass(frozen=True)
class _Oversized:
    """A record a listing did not fetch: it takes ``size`` bytes, over :data:`~scripts.MAX_RECORD_BYTES`;
    ``state``, its state field if that is short enough to be one ("" if not)."""

    size: int
    state: str = ""

    @property
    def reason(self) -> str:
        return (f"its record takes {self.size} bytes, more than the {scripts.MAX_RECORD_BYTES} a record may "
                f"(it was not read)")


def _aside_map(reply: Any) -> dict[bytes, tuple[str, float]]:
    if not isinstance(reply, dict):
        return {}
    return {bytes(k): schema.dead_letter(v) for k, v in reply.items()}
