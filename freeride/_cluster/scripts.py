"""The cluster queue's Lua scripts: each queue operation that reads and then writes, atomic on the server.

Only :mod:`freeride._cluster.redis_queue` runs them. Keys and arguments are listed above each script;
the design is in that module's docstring and in ``docs/architecture.md`` ("Many nodes").

**Nothing a script reads is trusted.** A record may have been written by another version of freeride, by
hand, or cut short, so a script checks what it is about to use (:data:`_PRELUDE`'s ``problem``: the key is
a hash, its schema version is one this freeride reads, its state is known, its entry is a stream id, its
priority, sequence number and epoch are whole numbers in range) and *sets aside* a record that fails,
instead of raising: a Lua error would abort the script, and a script that aborts on one record aborts
every poll of every manager, which is how one bad record used to wedge the whole queue. Setting aside
retires the task's stream entry (it is then pending nowhere, so no sweep or claim meets it again), takes
it out of the waiting room, and writes the reason to the dead-letter hash (``{freeride}:aside``: field
the task id, or ``entry:<stream id>`` for an entry that names no task; value a JSON object with
``reason``, ``at_unix`` and ``entry``). The record itself is left as it was, for whoever looks into it.
Python checks the rest of a record (text is UTF-8, the spec parses, every field has its form) in
:mod:`freeride._cluster.schema` and sets aside what fails with the ``aside`` script.

**The contact clock** (``{freeride}:clock``, a hash: ``run``, ``seen``, ``since``). Every sweep and every
lease renewal calls ``contact``, which reads the server's own time (``TIME``) and run id (``INFO
server``), and returns for how long managers have been in continuous contact with this server: since its
(re)start, or since the last time no manager had reached it for longer than a lease (everyone was cut
off, or its clock stepped). A sweep expires nothing until that is a whole lease: see ``docs/architecture.md``
("Leases across a Redis restart") for why, and for the cases it covers.
"""

from __future__ import annotations

#: The record schema this freeride writes and reads. A record without a ``schema`` field predates the
#: field and is read as schema 1 (the fields are the same); a newer one is set aside, never misread.
SCHEMA = 1
#: The most a task's hash may take in Redis (``MEMORY USAGE``). What freeride writes is bounded far below it:
#: a spec under 60 KiB (``freeride._validation``), a failure under 100 KiB. A record over it (only a hand
#: write or another program makes one) is set aside unread: reading it would cost every claim, poll and
#: listing its whole size, and one of 200 MiB made every manager's poll time out.
MAX_RECORD_BYTES = 2**20
#: The longest member the index or the waiting room may hold: a cluster task id is at most 61 bytes.
MAX_ID_BYTES = 64

# The score that orders the waiting room: priority (highest first), then submission order. Exact in a double:
# |priority| <= 1e6 < 2**20 and seq < 2**33 (``problem`` checks both), so the sum stays below 2**53.
_PRELUDE = """
local SCHEMA = SCHEMA_VERSION
local MAX_RECORD = MAX_RECORD_SIZE
local MAX_ID = MAX_ID_SIZE
local KNOWN = {QUEUED = true, CLAIMED = true, SUBMITTED = true, STARTING = true, PARKED = true, RUNNING = true,
               FROZEN = true, EVICTED = true, FINISHED = true, FAILED = true, CANCELLED = true}

local function whole(s, lo, hi)
  if type(s) ~= 'string' or not string.match(s, '^%-?%d+$') then return nil end
  local n = tonumber(s)
  if n and n >= lo and n <= hi then return n end
  return nil
end

local function is_entry(s)
  return type(s) == 'string' and string.match(s, '^%d+%-%d+$') ~= nil
end

local function is_hash(key)
  return redis.call('TYPE', key)['ok'] == 'hash'
end

local function field(key, name)
  if not is_hash(key) then return false end
  return redis.call('HGET', key, name)
end

-- Why a task's hash is too large to read (its fields are never fetched), or nil.
local function oversized(key)
  local bytes = redis.call('MEMORY', 'USAGE', key, 'SAMPLES', '0')
  if bytes and bytes > MAX_RECORD then
    return 'its record takes ' .. bytes .. ' bytes, more than the ' .. MAX_RECORD .. ' a record may (it was not read)'
  end
  return nil
end

-- Why the scripts cannot use a task's record, or nil.
local function problem(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then return 'it has no record' end
  if kind ~= 'hash' then return 'its record is a ' .. kind .. ', not a hash' end
  local why = oversized(key)
  if why then return why end
  local f = redis.call('HMGET', key, 'schema', 'state', 'entry', 'priority', 'seq', 'epoch')
  if f[1] then
    local v = whole(f[1], 1, 1000000000)
    if not v then return 'its schema version is not a whole number above 0' end
    if v > SCHEMA then
      return 'it was written by a newer freeride (record schema ' .. f[1] .. '; this one reads up to ' .. SCHEMA .. ')'
    end
  end
  local missing = {}
  for i, name in ipairs({'state', 'entry', 'priority', 'seq', 'epoch'}) do
    if not f[i + 1] then missing[#missing + 1] = name end
  end
  if #missing > 0 then return 'it lacks the field(s) ' .. table.concat(missing, ', ') end
  if not KNOWN[f[2]] then return 'its state is not one freeride knows' end
  if not is_entry(f[3]) then return 'its entry is not a stream id' end
  if not whole(f[4], -1000000, 1000000) then return 'its priority is not a whole number within +-1000000' end
  if not whole(f[5], 1, 8589934591) then return 'its seq is not a whole number in [1, 2^33)' end
  if not whole(f[6], 0, 9007199254740991) then return 'its epoch is not a whole number >= 0' end
  return nil
end

-- Only for a record ``problem`` passed.
local function score(key)
  local f = redis.call('HMGET', key, 'priority', 'seq')
  return -tonumber(f[1]) * 8589934592 + tonumber(f[2])
end

local function set_aside(stream, group, waiting, aside, name, entry, reason, now)
  redis.call('ZREM', waiting, name)
  if is_entry(entry) then
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
  redis.call('HSET', aside, name, cjson.encode({reason = reason, at_unix = tonumber(now) or 0,
                                                 entry = is_entry(entry) and entry or ''}))
end

-- The task a stream entry names; nil if it names none, or a task field longer than any task id.
local function task_of(e)
  if type(e) ~= 'table' or type(e[2]) ~= 'table' then return nil end
  local f = e[2]
  for i = 1, #f - 1, 2 do
    local v = f[i + 1]
    if f[i] == 'task' and type(v) == 'string' and v ~= '' and #v <= MAX_ID then return v end
  end
  return nil
end

-- Take out of a sorted set (the index, the waiting room) every member longer than any task id, and record
-- each in the dead-letter hash by its first bytes: every reader of the set would otherwise fetch its whole
-- length, at every poll. Cheap when there is none: a set whose size allows no such member is not walked.
local function tidy(set, aside, what, tag, now)
  local n = redis.call('ZCARD', set)
  if n == 0 then return 0 end
  local bytes = redis.call('MEMORY', 'USAGE', set, 'SAMPLES', '0')
  if not bytes or bytes <= 4096 + n * 512 then return 0 end
  local removed, i = 0, 0
  while i < n - removed do
    local m = redis.call('ZRANGE', set, i, i)[1]
    if m and #m > MAX_ID then
      redis.call('ZREMRANGEBYRANK', set, i, i)
      redis.call('HSET', aside, 'member:' .. tag .. ':' .. string.sub(m, 1, 24) .. '...',
                 cjson.encode({reason = what .. ' held a member of ' .. #m .. ' bytes, longer than any task id: ' ..
                               'taken out, its first 24 bytes kept as this name', at_unix = tonumber(now) or 0,
                               entry = ''}))
      removed = removed + 1
    else
      i = i + 1
    end
  end
  return removed
end

local function holds(key, me, epoch)
  if not is_hash(key) then return false end
  local f = redis.call('HMGET', key, 'owner', 'epoch')
  return f[1] == me and f[2] == epoch
end

local function hset_from(key, first)
  if #ARGV >= first then
    local fv = {}
    for i = first, #ARGV do fv[#fv + 1] = ARGV[i] end
    redis.call('HSET', key, unpack(fv))
  end
end

-- Deliver new stream entries to the waiting room's consumer; set aside those that name no usable task.
local function intake(stream, waiting, aside, prefix, group, queue, now)
  local got = redis.call('XREADGROUP', 'GROUP', group, queue, 'COUNT', 1000, 'STREAMS', stream, '>')
  if not got then return 0 end
  local n = 0
  for _, e in ipairs(got[1][2]) do
    local tid = task_of(e)
    if not tid then
      set_aside(stream, group, waiting, aside, 'entry:' .. e[1], e[1], 'stream entry ' .. e[1] .. ' names no task', now)
      n = n + 1
    else
      local key = prefix .. tid
      local why = problem(key)
      if why then
        set_aside(stream, group, waiting, aside, tid, e[1], why, now)
        n = n + 1
      elseif redis.call('HGET', key, 'entry') ~= e[1] then
        set_aside(stream, group, waiting, aside, 'entry:' .. e[1], e[1],
                  'stream entry ' .. e[1] .. ' names a task whose record names another entry', now)
        n = n + 1
      elseif redis.call('HGET', key, 'state') == 'QUEUED' then
        redis.call('ZADD', waiting, score(key), tid)
      end
    end
  end
  return n
end
""".replace("SCHEMA_VERSION", str(SCHEMA)).replace("MAX_RECORD_SIZE", str(MAX_RECORD_BYTES)).replace(
    "MAX_ID_SIZE", str(MAX_ID_BYTES))

_CLOCK = """
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function server_run()
  local info = redis.pcall('INFO', 'server')
  if type(info) ~= 'string' then return '' end
  return string.match(info, 'run_id:(%x+)') or ''
end

-- Milliseconds of continuous contact with this server, and 1 if it starts now.
local function contact(clock, lease)
  local now = server_ms()
  local run = server_run()
  local kind = redis.call('TYPE', clock)['ok']
  local c = {false, false, false}
  if kind == 'hash' then
    c = redis.call('HMGET', clock, 'run', 'seen', 'since')
  elseif kind ~= 'none' then
    redis.call('DEL', clock)
  end
  local seen, since = tonumber(c[2]), tonumber(c[3])
  local fresh = 0
  if c[1] ~= run or not seen or not since or now < seen or now - seen > lease or since > now then
    since = now
    fresh = 1
  end
  redis.call('HSET', clock, 'run', run, 'seen', now, 'since', since)
  return now - since, fresh
end
"""

# KEYS: seq, index, waiting, stream, aside. ARGV: prefix, slug, group, queue, now_unix, field/value pairs...
SUBMIT = _PRELUDE + """
local seq, tid, key
repeat  -- a counter set back (a restore, a hand edit) must not merge a new task into an old record
  seq = redis.call('INCR', KEYS[1])
  tid = ARGV[2] .. '-q' .. seq
  key = ARGV[1] .. tid
until redis.call('EXISTS', key) == 0
hset_from(key, 6)
local entry = redis.call('XADD', KEYS[4], '*', 'task', tid)
redis.call('HSET', key, 'seq', seq, 'entry', entry, 'state', 'QUEUED', 'owner', '', 'device', '')
redis.call('ZADD', KEYS[2], seq, tid)
intake(KEYS[4], KEYS[3], KEYS[5], ARGV[1], ARGV[3], ARGV[4], ARGV[5])
return {tid, entry}
"""

# KEYS: stream, waiting, sweeper lock, clock, aside, index.
# ARGV: prefix, group, queue, lease_ms, me, sweep_every_ms, now_unix.
# Returns {status, moved, set aside, ms of grace left, 1 if contact (re)started now}; status is 'busy'
# (another manager swept within sweep_every_ms), 'grace' or 'swept'.
SWEEP = "redis.replicate_commands()\n" + _PRELUDE + _CLOCK + """
local aside = intake(KEYS[1], KEYS[2], KEYS[5], ARGV[1], ARGV[2], ARGV[3], ARGV[7])
if not redis.call('SET', KEYS[3], ARGV[5], 'NX', 'PX', ARGV[6]) then return {'busy', 0, aside, 0, 0} end
aside = aside + tidy(KEYS[6], KEYS[5], 'the index', 'index', ARGV[7])  -- what no manager reads: the listings do
local lease = tonumber(ARGV[4])
local up, fresh = contact(KEYS[4], lease)
if up < lease then return {'grace', 0, aside, lease - up, fresh} end
local moved = 0
local cursor = '0-0'
local rounds = 0
repeat
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[4], cursor, 'COUNT', 100)
  cursor = r[1]
  for _, e in ipairs(r[2]) do
    if type(e) == 'table' then
      local tid = task_of(e)
      if not tid then
        set_aside(KEYS[1], ARGV[2], KEYS[2], KEYS[5], 'entry:' .. e[1], e[1],
                  'stream entry ' .. e[1] .. ' names no task', ARGV[7])
        aside = aside + 1
      else
        local key = ARGV[1] .. tid
        local why = problem(key)
        if why then
          set_aside(KEYS[1], ARGV[2], KEYS[2], KEYS[5], tid, e[1], why, ARGV[7])
          aside = aside + 1
        elseif redis.call('HGET', key, 'entry') ~= e[1] then
          set_aside(KEYS[1], ARGV[2], KEYS[2], KEYS[5], 'entry:' .. e[1], e[1],
                    'stream entry ' .. e[1] .. ' names a task whose record names another entry', ARGV[7])
          aside = aside + 1
        else
          local owner = redis.call('HGET', key, 'owner')
          if owner and owner ~= '' then
            redis.call('HSET', key, 'state', 'QUEUED', 'owner', '', 'device', '', 'updated_unix', ARGV[7],
                       'reason', 'lease expired: ' .. owner .. ' stopped renewing it')
            if whole(redis.call('HGET', key, 'restarts'), 0, 1000000000) then
              redis.call('HINCRBY', key, 'restarts', 1)
            else
              redis.call('HSET', key, 'restarts', 1)
            end
            redis.call('ZADD', KEYS[2], score(key), tid)
            moved = moved + 1
          end
        end
      end
    end
  end
  rounds = rounds + 1
until cursor == '0-0' or rounds >= 100
return {'swept', moved, aside, 0, fresh}
"""

# KEYS: stream, waiting, aside. ARGV: prefix, limit, now_unix, placement fields...
# The head of the waiting room, for placement: {depth, set aside, ids, rows}; each row is the placement
# fields (HMGET) or, for a record that cannot be read here, why (a string).
PEEK = _PRELUDE + """
tidy(KEYS[2], KEYS[3], 'the waiting room', 'waiting', ARGV[3])
local ids = redis.call('ZRANGE', KEYS[2], 0, tonumber(ARGV[2]) - 1)
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local rows = {}
for i, tid in ipairs(ids) do
  local key = ARGV[1] .. tid
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    rows[i] = 'it has no record'
  elseif kind ~= 'hash' then
    rows[i] = 'its record is a ' .. kind .. ', not a hash'
  else
    rows[i] = oversized(key) or redis.call('HMGET', key, unpack(fields))
  end
end
return {redis.call('ZCARD', KEYS[2]), redis.call('HLEN', KEYS[3]), ids, rows}
"""

# KEYS: index, aside. ARGV: prefix, now_unix.
# {ids, sizes, states}: every task id in submission order, what each record takes in Redis (0: no record),
# and the state of each one over MAX_RECORD ('' for the rest): a listing fetches the records it can read,
# and none that would cost it their whole size.
LIST = _PRELUDE + """
tidy(KEYS[1], KEYS[2], 'the index', 'index', ARGV[2])
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local sizes, states = {}, {}
for i, tid in ipairs(ids) do
  local key = ARGV[1] .. tid
  sizes[i] = redis.call('MEMORY', 'USAGE', key, 'SAMPLES', '0') or 0
  states[i] = ''
  if sizes[i] > MAX_RECORD and is_hash(key) and redis.call('HSTRLEN', key, 'state') <= 16 then
    states[i] = redis.call('HGET', key, 'state') or ''
  end
end
return {ids, sizes, states}
"""

# KEYS: stream, waiting, task, aside. ARGV: group, queue, me, device, now_unix, task id.
# Returns {'claimed', fields...}, {'gone'} (not queued), {'busy'} (its entry is pending to a manager) or
# {'aside', reason}.
CLAIM = _PRELUDE + """
if redis.call('HEXISTS', KEYS[4], ARGV[6]) == 1 then
  redis.call('ZREM', KEYS[2], ARGV[6])
  return {'gone'}
end
local why = problem(KEYS[3])
if why then
  set_aside(KEYS[1], ARGV[1], KEYS[2], KEYS[4], ARGV[6], field(KEYS[3], 'entry'), why, ARGV[5])
  return {'aside', why}
end
if redis.call('HGET', KEYS[3], 'state') ~= 'QUEUED' then
  redis.call('ZREM', KEYS[2], ARGV[6])  -- the waiting room holds queued tasks only
  return {'gone'}
end
local entry = redis.call('HGET', KEYS[3], 'entry')
local p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
if #p == 0 then
  why = 'its stream entry is pending nowhere (acknowledged or deleted)'
  set_aside(KEYS[1], ARGV[1], KEYS[2], KEYS[4], ARGV[6], entry, why, ARGV[5])
  return {'aside', why}
end
if p[1][2] ~= ARGV[2] then return {'busy'} end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, entry, 'JUSTID')
redis.call('HINCRBY', KEYS[3], 'epoch', 1)
redis.call('HSET', KEYS[3], 'state', 'CLAIMED', 'owner', ARGV[3], 'device', ARGV[4], 'updated_unix', ARGV[5],
           'reason', 'claimed by ' .. ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[6])
return {'claimed', redis.call('HGETALL', KEYS[3])}
"""

# KEYS: stream, clock, task keys... ARGV: group, me, lease_ms, then (entry, epoch) per task key.
# Returns {lost, cancelled, renewed} (1-based positions among the task keys, and a count).
HEARTBEAT = "redis.replicate_commands()\n" + _PRELUDE + _CLOCK + """
contact(KEYS[2], tonumber(ARGV[3]))
local lost, cancel, renewed = {}, {}, 0
for i = 3, #KEYS do
  local j = i - 2
  local entry, epoch = ARGV[2 + 2 * j], ARGV[3 + 2 * j]
  local p = {}
  if is_entry(entry) then p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1) end
  if holds(KEYS[i], ARGV[2], epoch) and #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry, 'JUSTID')
    renewed = renewed + 1
    if redis.call('HGET', KEYS[i], 'cancel') == '1' then cancel[#cancel + 1] = j end
  else
    lost[#lost + 1] = j
  end
end
return {lost, cancel, renewed}
"""

# KEYS: task. ARGV: me, epoch, field/value pairs...
UPDATE = _PRELUDE + """
if not holds(KEYS[1], ARGV[1], ARGV[2]) then return 0 end
hset_from(KEYS[1], 3)
return 1
"""

# KEYS: stream, task. ARGV: group, me, epoch, field/value pairs...
FINISH = _PRELUDE + """
if not holds(KEYS[2], ARGV[2], ARGV[3]) then return 0 end
local entry = redis.call('HGET', KEYS[2], 'entry')
if is_entry(entry) then
  redis.call('XACK', KEYS[1], ARGV[1], entry)
  redis.call('XDEL', KEYS[1], entry)
end
hset_from(KEYS[2], 4)
redis.call('HSET', KEYS[2], 'owner', '')
return 1
"""

# KEYS: stream, waiting, task, aside. ARGV: group, queue, me, epoch, task id, now_unix, field/value pairs...
# Returns 1 (handed back), 0 (not held) or 2 (its record cannot be queued again: set aside).
RELEASE = _PRELUDE + """
local key = KEYS[3]
if not holds(key, ARGV[3], ARGV[4]) then return 0 end
local why = problem(key)
if why then
  set_aside(KEYS[1], ARGV[1], KEYS[2], KEYS[4], ARGV[5], field(key, 'entry'), why, ARGV[6])
  return 2
end
local entry = redis.call('HGET', key, 'entry')
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry, 'JUSTID')
hset_from(key, 7)
redis.call('HSET', key, 'state', 'QUEUED', 'owner', '', 'device', '')
redis.call('ZADD', KEYS[2], score(key), ARGV[5])
return 1
"""

# KEYS: stream, waiting, task, aside. ARGV: group, task id, now_unix, reason, me, epoch.
# A record Python could not read: set it aside. With ``me`` the caller holds the task (it claimed it, then
# found it unreadable) and must still hold it; without, it must be held by nobody (it was in the waiting room).
# Returns 1 if set aside, 0 if not.
ASIDE = _PRELUDE + """
local key = KEYS[3]
if redis.call('HEXISTS', KEYS[4], ARGV[2]) == 1 then  -- another manager set it aside first
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 0
end
if ARGV[5] ~= '' then
  if not holds(key, ARGV[5], ARGV[6]) then return 0 end
elseif is_hash(key) then
  local owner = redis.call('HGET', key, 'owner')
  if owner and owner ~= '' then
    redis.call('ZREM', KEYS[2], ARGV[2])  -- held: it does not belong in the waiting room
    return 0
  end
end
set_aside(KEYS[1], ARGV[1], KEYS[2], KEYS[4], ARGV[2], field(key, 'entry'), ARGV[4], ARGV[3])
return 1
"""

# KEYS: stream, waiting, task, aside. ARGV: group, task id, now_unix.
CANCEL = _PRELUDE + """
if redis.call('HEXISTS', KEYS[4], ARGV[2]) == 1 then return 'SET_ASIDE' end
if redis.call('TYPE', KEYS[3])['ok'] == 'none' then return 'MISSING' end
local why = problem(KEYS[3])
if why then
  set_aside(KEYS[1], ARGV[1], KEYS[2], KEYS[4], ARGV[2], field(KEYS[3], 'entry'), why, ARGV[3])
  return 'SET_ASIDE'
end
local state = redis.call('HGET', KEYS[3], 'state')
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
RETIRE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
