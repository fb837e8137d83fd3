"""The Redis edge of the cluster queue: the only module that imports ``redis``.

Keys (one queue per Redis database; the ``{freeride}`` hash tag keeps them in one slot)::

    {freeride}:stream      STREAM  one entry per task, added at submission, deleted when it ends
    {freeride}:task:<id>   HASH    the task's record (records.py): spec, state, holder, progress, ...
    {freeride}:index       ZSET    every task id, scored by submission order (``ls`` reads it)
    {freeride}:waiting     ZSET    ids of queued tasks, scored by priority then submission order
    {freeride}:seq         STRING  the submission counter
    {freeride}:sweeper     STRING  which manager sweeps expired leases now (a short-lived lock)

The stream has one consumer group, ``managers``. Every entry is always pending (delivered, not
acknowledged) to exactly one consumer until its task ends:

* ``queue``, the group's own consumer, is the waiting room: a submission's entry is delivered to it
  at once (``XREADGROUP GROUP managers queue ... >``), and a task handed back returns to it
  (``XCLAIM ... queue JUSTID``);
* a manager's consumer (``node/device/pid-nonce``) while that manager holds the task. The pending
  entry's idle time is the lease: the holder renews it every third of the lease
  (``XCLAIM ... JUSTID``, which resets it), and ``XAUTOCLAIM ... queue <lease>`` moves entries whose
  holder stopped renewing back to the waiting room.

Each operation that reads and then writes is one Lua script, so it is atomic on the server: a claim
succeeds only if the task is queued and its entry is pending to ``queue``, so two managers can never
both take one task; renewals, progress, ends and hand-backs of a holder succeed only if it still
holds the task with the same claim epoch (a fencing token), so a manager that lost a task (its lease
expired while it could not reach Redis) learns so and writes nothing. A submission is one script
too: record, stream entry and delivery to the waiting room happen together or not at all.

Errors map onto freeride's tree in one place, :func:`redis_errors`: unreachable or timed out ->
:class:`~freeride.errors.QueueUnavailable` (exit 3), refused credentials ->
:class:`~freeride.errors.Unauthenticated` (exit 5), anything else -> :class:`~freeride.errors.FreerideError`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rx

from freeride._cluster.placement import Candidate
from freeride._cluster.records import (
    ClusterRecord,
    display_name,
    is_cluster_id,
    new_task_fields,
    record_from_fields,
)
from freeride._cluster.url import QueueURL
from freeride._validation import Submission, slug
from freeride.errors import FreerideError, QueueUnavailable, Unauthenticated

GROUP = "managers"
#: The group's own consumer: entries pending to it are the queued (waiting) tasks.
QUEUE_CONSUMER = "queue"
NAMESPACE = "freeride"
MS = 1_000_000

# A score that orders the waiting room by priority (highest first), then submission order. Exact in a
# double: |priority| <= 1e6 < 2**20 and seq < 2**33, so the sum stays below 2**53.
_SCORE_LUA = "(-tonumber(redis.call('HGET', key, 'priority') or '0') * 8589934592 + " \
             "tonumber(redis.call('HGET', key, 'seq') or '0'))"

_INTAKE_LUA = """
local function intake(stream, waiting, prefix, group, queue)
  local got = redis.call('XREADGROUP', 'GROUP', group, queue, 'COUNT', 1000, 'STREAMS', stream, '>')
  if not got then return 0 end
  local n = 0
  for _, e in ipairs(got[1][2]) do
    local tid = nil
    for i = 1, #e[2], 2 do if e[2][i] == 'task' then tid = e[2][i + 1] end end
    local key = tid and (prefix .. tid)
    if key and redis.call('EXISTS', key) == 1 then
      redis.call('ZADD', waiting, SCORE, tid)
      n = n + 1
    else
      redis.call('XACK', stream, group, e[1])
      redis.call('XDEL', stream, e[1])
    end
  end
  return n
end
""".replace("SCORE", _SCORE_LUA)

_HSET_ARGS_LUA = """
local function hset_from(key, first)
  if #ARGV >= first then
    local fv = {}
    for i = first, #ARGV do fv[#fv + 1] = ARGV[i] end
    redis.call('HSET', key, unpack(fv))
  end
end
"""

_HOLDS_LUA = """
local function holds(key, me, epoch)
  return redis.call('HGET', key, 'owner') == me and redis.call('HGET', key, 'epoch') == epoch
end
"""

# KEYS: seq, index, waiting, stream. ARGV: prefix, slug, group, queue, field/value pairs...
_SUBMIT = _INTAKE_LUA + _HSET_ARGS_LUA + """
local seq = redis.call('INCR', KEYS[1])
local tid = ARGV[2] .. '-q' .. seq
local key = ARGV[1] .. tid
hset_from(key, 5)
local entry = redis.call('XADD', KEYS[4], '*', 'task', tid)
redis.call('HSET', key, 'seq', seq, 'entry', entry, 'state', 'QUEUED', 'owner', '', 'device', '')
redis.call('ZADD', KEYS[2], seq, tid)
intake(KEYS[4], KEYS[3], ARGV[1], ARGV[3], ARGV[4])
return {tid, entry}
"""

# KEYS: stream, waiting, sweeper lock. ARGV: prefix, group, queue, lease_ms, me, sweep_every_ms, now_unix
_SWEEP = _INTAKE_LUA + """
if not redis.call('SET', KEYS[3], ARGV[5], 'NX', 'PX', ARGV[6]) then return -1 end
intake(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
local moved = 0
local cursor = '0-0'
local rounds = 0
repeat
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[4], cursor, 'COUNT', 100)
  cursor = r[1]
  for _, e in ipairs(r[2]) do
    local tid = nil
    if e and e[2] then
      for i = 1, #e[2], 2 do if e[2][i] == 'task' then tid = e[2][i + 1] end end
    end
    local key = tid and (ARGV[1] .. tid)
    if key and redis.call('EXISTS', key) == 1 then
      local owner = redis.call('HGET', key, 'owner')
      if owner and owner ~= '' then
        redis.call('HSET', key, 'state', 'QUEUED', 'owner', '', 'device', '', 'updated_unix', ARGV[7],
                   'reason', 'lease expired: ' .. owner .. ' stopped renewing it')
        redis.call('HINCRBY', key, 'restarts', 1)
        redis.call('ZADD', KEYS[2], SCORE, tid)
        moved = moved + 1
      end
    elseif e then
      redis.call('XACK', KEYS[1], ARGV[2], e[1])
      redis.call('XDEL', KEYS[1], e[1])
    end
  end
  rounds = rounds + 1
until cursor == '0-0' or rounds >= 100
return moved
""".replace("SCORE", _SCORE_LUA)

# KEYS: stream, waiting, task. ARGV: group, queue, me, device, now_unix, task id
_CLAIM = """
if redis.call('HGET', KEYS[3], 'state') ~= 'QUEUED' then return false end
local entry = redis.call('HGET', KEYS[3], 'entry')
if not entry then return false end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return false end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, entry, 'JUSTID')
redis.call('HINCRBY', KEYS[3], 'epoch', 1)
redis.call('HSET', KEYS[3], 'state', 'CLAIMED', 'owner', ARGV[3], 'device', ARGV[4], 'updated_unix', ARGV[5],
           'reason', 'claimed by ' .. ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[6])
return redis.call('HGETALL', KEYS[3])
"""

# KEYS: stream, task keys... ARGV: group, me, then (entry, epoch) per task key
_HEARTBEAT = _HOLDS_LUA + """
local lost, cancel = {}, {}
for i = 2, #KEYS do
  local entry, epoch = ARGV[2 * i - 1], ARGV[2 * i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
  if holds(KEYS[i], ARGV[2], epoch) and #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry, 'JUSTID')
    if redis.call('HGET', KEYS[i], 'cancel') == '1' then cancel[#cancel + 1] = i - 1 end
  else
    lost[#lost + 1] = i - 1
  end
end
return {lost, cancel}
"""

# KEYS: task. ARGV: me, epoch, field/value pairs...
_UPDATE = _HOLDS_LUA + _HSET_ARGS_LUA + """
if not holds(KEYS[1], ARGV[1], ARGV[2]) then return 0 end
hset_from(KEYS[1], 3)
return 1
"""

# KEYS: stream, task. ARGV: group, me, epoch, field/value pairs...
_FINISH = _HOLDS_LUA + _HSET_ARGS_LUA + """
if not holds(KEYS[2], ARGV[2], ARGV[3]) then return 0 end
local entry = redis.call('HGET', KEYS[2], 'entry')
redis.call('XACK', KEYS[1], ARGV[1], entry)
redis.call('XDEL', KEYS[1], entry)
hset_from(KEYS[2], 4)
redis.call('HSET', KEYS[2], 'owner', '')
return 1
"""

# KEYS: stream, waiting, task. ARGV: group, queue, me, epoch, task id, field/value pairs...
_RELEASE = _HOLDS_LUA + _HSET_ARGS_LUA + """
local key = KEYS[3]
if not holds(key, ARGV[3], ARGV[4]) then return 0 end
local entry = redis.call('HGET', key, 'entry')
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry, 'JUSTID')
hset_from(key, 6)
redis.call('HSET', key, 'state', 'QUEUED', 'owner', '', 'device', '')
redis.call('ZADD', KEYS[2], SCORE, ARGV[5])
return 1
""".replace("SCORE", _SCORE_LUA)

# KEYS: stream, waiting, task. ARGV: group, task id, now_unix
_CANCEL = """
local state = redis.call('HGET', KEYS[3], 'state')
if not state then return 'MISSING' end
if state == 'FINISHED' or state == 'FAILED' or state == 'CANCELLED' then return state end
if state == 'QUEUED' then
  local entry = redis.call('HGET', KEYS[3], 'entry')
  redis.call('XACK', KEYS[1], ARGV[1], entry)
  redis.call('XDEL', KEYS[1], entry)
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('HSET', KEYS[3], 'state', 'CANCELLED', 'reason', 'cancelled while queued', 'updated_unix', ARGV[3])
  return 'CANCELLED'
end
redis.call('HSET', KEYS[3], 'cancel', '1')
return 'REQUESTED'
"""

# KEYS: stream. ARGV: group, me. A consumer with nothing pending goes; one that holds tasks stays.
_RETIRE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


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
        raise FreerideError(f"the queue at {url} answered with an error: {text}") from None
    except rx.RedisError as exc:
        raise FreerideError(f"queue error at {url}: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class Held:
    """A task this manager holds: what a renewal and every write must present."""

    task_id: str
    entry: str
    epoch: int


class RedisQueue:
    """One connection (pool) to the queue's Redis; every method raises from the freeride error tree.

    Thread-confined by convention: the agent's thread, or a CLI command, owns an instance.
    """

    def __init__(self, url: QueueURL, namespace: str = NAMESPACE, timeout_s: float = 2.0) -> None:
        self.url = url
        ns = "{" + namespace + "}"
        self.stream_key = f"{ns}:stream"
        self.index_key = f"{ns}:index"
        self.waiting_key = f"{ns}:waiting"
        self.seq_key = f"{ns}:seq"
        self.sweeper_key = f"{ns}:sweeper"
        self.task_prefix = f"{ns}:task:"
        with redis_errors(url):
            self._r = redis.Redis.from_url(
                url.text,
                decode_responses=True,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                health_check_interval=30,
            )
        self._scripts = {
            name: self._r.register_script(body)
            for name, body in (("submit", _SUBMIT), ("sweep", _SWEEP), ("claim", _CLAIM),
                               ("heartbeat", _HEARTBEAT), ("update", _UPDATE), ("finish", _FINISH),
                               ("release", _RELEASE), ("cancel", _CANCEL), ("retire", _RETIRE))
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._r.close()

    def task_key(self, task_id: str) -> str:
        return self.task_prefix + task_id

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
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
        fields = new_task_fields(sub, time.time() if now_unix is None else now_unix)
        args: list[Any] = [self.task_prefix, slug(display_name(sub)), GROUP, QUEUE_CONSUMER]
        for key, value in fields.items():
            args += [key, value]
        task_id, _entry = self._run("submit", [self.seq_key, self.index_key, self.waiting_key, self.stream_key], args)
        return str(task_id)

    def records(self, include_finished: bool = True) -> list[ClusterRecord]:
        """Every task of the cluster, in submission order: one index read and one pipelined fetch."""
        with redis_errors(self.url):
            ids = [str(i) for i in self._r.zrange(self.index_key, 0, -1) if is_cluster_id(str(i))]
            pipe = self._r.pipeline(transaction=False)
            for task_id in ids:
                pipe.hgetall(self.task_key(task_id))
            hashes = pipe.execute() if ids else []
        out = [record_from_fields(t, h) for t, h in zip(ids, hashes, strict=True) if h]
        return [r for r in out if include_finished or not r.terminal]

    def record(self, task_id: str) -> ClusterRecord | None:
        with redis_errors(self.url):
            raw = self._r.hgetall(self.task_key(task_id)) if is_cluster_id(task_id) else {}
        fields = {str(k): str(v) for k, v in raw.items()}
        return record_from_fields(task_id, fields) if fields else None

    def cancel(self, task_id: str, now_unix: float | None = None) -> str:
        """Cancel a queued task at once, or ask its holder to (``REQUESTED``); ``MISSING`` if unknown."""
        if not is_cluster_id(task_id):
            return "MISSING"
        now = repr(time.time() if now_unix is None else now_unix)
        return str(self._run("cancel", [self.stream_key, self.waiting_key, self.task_key(task_id)],
                             [GROUP, task_id, now]))

    # ------------------------------------------------------------ managers

    def sweep(self, me: str, lease_ms: int, sweep_every_ms: int, now_unix: float) -> int:
        """Move tasks whose holder's lease expired back to the waiting room; -1 if another manager
        swept within ``sweep_every_ms`` (one sweep at a time is enough for the whole cluster)."""
        return int(self._run("sweep", [self.stream_key, self.waiting_key, self.sweeper_key],
                             [self.task_prefix, GROUP, QUEUE_CONSUMER, lease_ms, me, sweep_every_ms,
                              repr(now_unix)]))

    def waiting(self, limit: int = 64) -> list[Candidate]:
        """The first ``limit`` queued tasks in claim order, with what placement needs of them."""
        with redis_errors(self.url):
            ids = [str(i) for i in self._r.zrange(self.waiting_key, 0, limit - 1) if is_cluster_id(str(i))]
            pipe = self._r.pipeline(transaction=False)
            for task_id in ids:
                pipe.hmget(self.task_key(task_id), "memory_bytes", "priority", "seq", "step_hint_ms", "step_p95_ms")
            rows = pipe.execute() if ids else []
        out = []
        for task_id, row in zip(ids, rows, strict=True):
            try:
                memory, priority, seq = int(row[0]), int(row[1]), int(row[2])
                hint, learned = float(row[3] or 0), float(row[4] or 0)
            except (TypeError, ValueError):
                continue  # a record without these cannot be placed; the claim's validation reports it
            step_ms = learned if learned > 0 else hint
            out.append(Candidate(task_id, memory, priority, seq, int(step_ms * MS) if step_ms > 0 else None))
        return out

    def claim(self, task_id: str, me: str, device: str, now_unix: float) -> ClusterRecord | None:
        """Take a queued task; its record, or None if it is no longer queued (another manager took it)."""
        flat = self._run("claim", [self.stream_key, self.waiting_key, self.task_key(task_id)],
                         [GROUP, QUEUE_CONSUMER, me, device, repr(now_unix), task_id])
        if not flat:
            return None
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        return record_from_fields(task_id, fields)

    def heartbeat(self, me: str, held: Sequence[Held]) -> tuple[list[str], list[str]]:
        """Renew the leases of ``held``; the ids lost to another manager, and those a user cancelled."""
        if not held:
            return [], []
        args: list[Any] = [GROUP, me]
        for h in held:
            args += [h.entry, str(h.epoch)]
        lost, cancel = self._run("heartbeat", [self.stream_key, *(self.task_key(h.task_id) for h in held)], args)
        return [held[int(i) - 1].task_id for i in lost], [held[int(i) - 1].task_id for i in cancel]

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

    def release(self, me: str, h: Held, fields: dict[str, str]) -> bool:
        """Hand a held task back to the waiting room; False if no longer held."""
        args: list[Any] = [GROUP, QUEUE_CONSUMER, me, str(h.epoch), h.task_id]
        for key, value in fields.items():
            args += [key, value]
        return bool(self._run("release", [self.stream_key, self.waiting_key, self.task_key(h.task_id)], args))

    def retire(self, me: str) -> bool:
        """Remove this manager's consumer from the group if it holds nothing."""
        return bool(self._run("retire", [self.stream_key], [GROUP, me]))
