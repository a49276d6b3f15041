"""hsq's Redis scripts (Lua), as strings; the aggregates register the ones they use.

Every script that a worker's write runs is fenced: it starts with `_FENCE` and replies -1
when the run's generation is no longer the one the caller holds (hsq/store/fence.py).
Scripts that move a job move its count in the stats hash with it (docs/queue.md, "Counters").
"""

from __future__ import annotations

COUNTERS_VERSION = 1
"""The stats hash's `counters` field: the queue counters exist and are kept by the scripts."""

# Every fenced script starts with this: KEYS[1] is the run's config, ARGV[1] the generation
# the caller holds (as stored: JSON). -1 means the run is gone or was re-created.
_FENCE = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return -1 end
"""


def _fenced_once(first: str, then: str) -> str:
    """A fenced script: run `first`; only if it changed something, run `then`; 1 or 0."""
    return _FENCE + f"if {first} == 1 then\n{then}\n  return 1\nend\nreturn 0\n"


# Un-marks a sample (verify --requeue) and takes it out of the totals, exactly once.
UNDO_DONE = _fenced_once(
    "redis.call('HDEL', KEYS[2], ARGV[2])",
    "  redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(ARGV[3]))\n"
    "  redis.call('HINCRBY', KEYS[3], 'bytes', -tonumber(ARGV[4]))",
)
# Ownership-checked job moves: act only if the job is still in this worker's wip list.
FINISH = _fenced_once("redis.call('LREM', KEYS[2], 1, ARGV[2])", "  redis.call('DEL', KEYS[3])")
# Lua: a dead-letter entry's reason (entries are untrusted JSON), as dead_entries reads it.
_REASON = """
local function reason_of(v)
  local ok, e = pcall(cjson.decode, v)
  if ok and type(e) == 'table' and type(e.reason) == 'string' then return e.reason end
  return '?'
end
local function unreason(key, v)
  local r = reason_of(v)
  if redis.call('HINCRBY', key, r, -1) <= 0 then redis.call('HDEL', key, r) end
end
"""

# Marks a batch of samples done, each exactly once, and keeps the run's totals in step with
# the done hash. KEYS: config, done, stats, dead, dead reasons, a worker's wip list ('':
# none), the run's stream, its spool hash; ARGV: generation, then (sample id, manifest
# JSON, tokens, bytes, job id) per sample. With the wip list, a sample whose job ('' : none)
# is no longer in it is not marked (2): a worker whose jobs a reaper took never marks again.
# A newly done sample leaves the dead letter (done and dead stay disjoint, so status adds
# them up without reading either). In a streamed run (the config's spool_budget > 0) each
# newly done sample is published in the same step (XADD: id, stored entry) and its spool
# reservation becomes the file's real size: published iff done, exactly once per mark.
# Replies 1/0/2 per sample. Commands: HGET, HMGET, HSET, 2 HINCRBY, HLEN whatever the batch
# (a streamed run: plus an HGET, HSET and XADD a newly done sample).
MARK_DONE_MANY = (
    _FENCE
    + _REASON
    + """
local held = {}
local function holds(job)
  if KEYS[6] == '' or job == '' then return true end
  if held[job] == nil then held[job] = redis.call('LPOS', KEYS[6], job) ~= false end
  return held[job]
end
local ids = {}
for i = 2, #ARGV, 5 do ids[#ids + 1] = ARGV[i] end
local have = redis.call('HMGET', KEYS[2], unpack(ids))
local out, put, new, seen, sizes, stored = {}, {}, {}, {}, {}, {}
local tokens, nbytes = 0, 0
for j, sid in ipairs(ids) do
  local i = 2 + (j - 1) * 5
  if not holds(ARGV[i + 4]) then
    out[j] = 2
  elseif have[j] or seen[sid] then
    out[j] = 0
  else
    seen[sid] = true
    out[j] = 1
    put[#put + 1] = sid
    put[#put + 1] = ARGV[i + 1]
    new[#new + 1] = sid
    sizes[sid] = tonumber(ARGV[i + 3])
    stored[sid] = ARGV[i + 1]
    tokens = tokens + tonumber(ARGV[i + 2])
    nbytes = nbytes + tonumber(ARGV[i + 3])
  end
end
if #new > 0 then
  redis.call('HSET', KEYS[2], unpack(put))
  redis.call('HINCRBY', KEYS[3], 'tokens', tokens)
  redis.call('HINCRBY', KEYS[3], 'bytes', nbytes)
  if redis.call('HLEN', KEYS[4]) > 0 then
    local dead = redis.call('HMGET', KEYS[4], unpack(new))
    for j, sid in ipairs(new) do
      if dead[j] then
        unreason(KEYS[5], dead[j])
        redis.call('HDEL', KEYS[4], sid)
      end
    end
  end
  if (tonumber(redis.call('HGET', KEYS[1], 'spool_budget') or '0') or 0) > 0 then
    local delta = 0
    for _, sid in ipairs(new) do
      local old = tonumber(redis.call('HGET', KEYS[8], sid) or '0') or 0
      redis.call('HSET', KEYS[8], sid, sizes[sid])
      delta = delta + sizes[sid] - old
      redis.call('XADD', KEYS[7], '*', 'id', sid, 'm', stored[sid])
    end
    redis.call('HINCRBY', KEYS[3], 'spool_bytes', delta)
  end
end
return out
"""
)

# Lua: releases a sample's spool reservation (KEYS[SPOOL] the spool hash, KEYS[STATS] the
# stats hash with the total): the bytes reserved, 0 if none was.
_RELEASE = """
local function release(sid)
  local r = redis.call('HGET', KEYS[SPOOL], sid)
  if not r then return 0 end
  redis.call('HDEL', KEYS[SPOOL], sid)
  redis.call('HINCRBY', KEYS[STATS], 'spool_bytes', -tonumber(r))
  return tonumber(r)
end
"""


def _with_release(script: str, spool: int, stats: int) -> str:
    return _RELEASE.replace("SPOOL", str(spool)).replace("STATS", str(stats)) + script


# Puts a dead-letter entry and counts its reason. KEYS: config, dead, reasons, done, spool,
# stats; ARGV: generation, key, entry JSON, reason. A sample already done is not
# dead-lettered (0). A dead sample's spool reservation is released: it will have no file.
TO_DEAD = _FENCE + _with_release(
    _REASON
    + """
if redis.call('HMGET', KEYS[4], ARGV[2])[1] then return 0 end
local old = redis.call('HGET', KEYS[2], ARGV[2])
if old then unreason(KEYS[3], old) end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
release(ARGV[2])
return 1
""",
    5,
    6,
)

# Reserves a sample's output bytes in the spool before it is dispatched, atomically against
# the budget. KEYS: config, spool, stats; ARGV: generation, sample id, bytes (-1: not known
# yet, the whole budget). 1: reserved (or already: a re-dispatch counts once; or no
# stream), 0: the spool is full, -budget - 1: the sample alone is larger than the budget
# (never fits: the worker pauses, naming the number needed, until the budget is raised).
# A sample of known size within the budget always fits an empty spool.
RESERVE = (
    _FENCE
    + """
local budget = tonumber(redis.call('HGET', KEYS[1], 'spool_budget') or '0') or 0
if budget <= 0 then return 1 end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 1 end
local total = tonumber(redis.call('HGET', KEYS[3], 'spool_bytes') or '0') or 0
local n = tonumber(ARGV[3])
if n > budget then return -budget - 1 end
if n < 0 then n = budget end
if total > 0 and total + n > budget then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], n)
redis.call('HINCRBY', KEYS[3], 'spool_bytes', n)
return 1
"""
)

# A sample sent to the retry queue leaves the worker without a file: its reservation is
# released (a reservation of the whole budget, made before the size was known, would
# otherwise hold the spool full while the sample waits in the retry queue). A done
# sample's reservation is its file's and stays. KEYS: config, spool, stats, done; ARGV:
# generation, sample id. The bytes released.
RELEASE_UNDONE = _FENCE + _with_release(
    """
if redis.call('HEXISTS', KEYS[4], ARGV[2]) == 1 then return 0 end
return release(ARGV[2])
""",
    2,
    3,
)

# A streamed run's new byte budget. KEYS: config; ARGV: generation, bytes. Refused (0) for
# a run without a stream: a budget cannot turn an offline run into a streamed one.
SET_BUDGET = (
    _FENCE
    + """
local budget = tonumber(redis.call('HGET', KEYS[1], 'spool_budget') or '0') or 0
if budget <= 0 then return 0 end
redis.call('HSET', KEYS[1], 'spool_budget', ARGV[2])
return 1
"""
)

# Lua: the sample id of a stream entry (nil if the entry is gone).
_ENTRY_SID = """
local function entry_field(id, name)
  local e = redis.call('XRANGE', KEYS[2], id, id)
  if #e == 0 then return nil end
  local f = e[1][2]
  for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end
  return nil
end
"""

# Commits a consumer's pending entries up to an id (what a trainer's checkpoint covers):
# XACK in the group and, the first time, a count of groups per entry; once every group
# committed an entry its sample goes to the removal set (or, keep_after_commit, its
# reservation is released and the file stays). Idempotent: XACK of an acked entry is 0.
# KEYS: config, stream, acks, spool-gc, spool, stats; ARGV: generation, group, consumer,
# last id, number of groups, keep (0/1), count. Replies {entries acked now, entries seen}.
COMMIT = _FENCE + _with_release(
    _ENTRY_SID
    + """
local pend = redis.call('XPENDING', KEYS[2], ARGV[2], '-', ARGV[4], tonumber(ARGV[7]), ARGV[3])
local n = 0
for _, p in ipairs(pend) do
  local id = p[1]
  if redis.call('XACK', KEYS[2], ARGV[2], id) == 1 then
    n = n + 1
    if redis.call('HINCRBY', KEYS[3], id, 1) >= tonumber(ARGV[5]) then
      redis.call('HDEL', KEYS[3], id)
      local sid = entry_field(id, 'id')
      if sid then
        if ARGV[6] == '1' then release(sid) else redis.call('SADD', KEYS[4], sid) end
      end
    end
  end
end
return {n, #pend}
""",
    5,
    6,
)

# A removed output's last step: out of the removal set, reservation released, recorded as
# consumed. KEYS: config, spool-gc, spool, stats, consumed; ARGV: generation, sample id.
# 0 if another remover did it first.
RELEASE_REMOVED = _FENCE + _with_release(
    """
if redis.call('SREM', KEYS[2], ARGV[2]) == 0 then return 0 end
release(ARGV[2])
redis.call('SADD', KEYS[5], ARGV[2])
return 1
""",
    3,
    4,
)

# A stream entry whose file failed its checks on read: if the entry is still the sample's
# done mark (the stored entry it carries), un-mark it (totals too), dead-letter it with the
# reason and release its reservation (its file is removed next, then it is requeued); in
# any case ack it in this group and forget its commit count. KEYS: config, stream, done,
# stats, dead, reasons, acks, spool; ARGV: generation, group, entry id, sample id, stored
# entry, tokens, bytes, dead entry JSON, reason. 1: rejected, 0: the entry was stale.
REJECT = _FENCE + _with_release(
    _REASON
    + """
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[7], ARGV[3])
if redis.call('HGET', KEYS[3], ARGV[4]) ~= ARGV[5] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[4])
redis.call('HINCRBY', KEYS[4], 'tokens', -tonumber(ARGV[6]))
redis.call('HINCRBY', KEYS[4], 'bytes', -tonumber(ARGV[7]))
local old = redis.call('HGET', KEYS[5], ARGV[4])
if old then unreason(KEYS[6], old) end
redis.call('HSET', KEYS[5], ARGV[4], ARGV[8])
redis.call('HINCRBY', KEYS[6], ARGV[9], 1)
release(ARGV[4])
return 1
""",
    8,
    4,
)

# Takes entries out of the dead letter, keeping the reason counts. KEYS: dead, reasons.
DEAD_REMOVE = (
    _REASON
    + """
local n = 0
for _, key in ipairs(ARGV) do
  local old = redis.call('HGET', KEYS[1], key)
  if old then
    unreason(KEYS[2], old)
    n = n + redis.call('HDEL', KEYS[1], key)
  end
end
return n
"""
)

# Lua: the samples of a job: its id ends in -n<count>; a job enqueued before counters existed
# has its count in the job-sizes hash (recount_queues writes it), KEYS[SIZES] of the script.
_SIZE = """
local function size_of(id)
  local n = string.match(id, '%-n(%d+)$')
  if n then return tonumber(n) end
  return tonumber(redis.call('HGET', KEYS[SIZES], id) or '1')
end
"""


def _with_sizes(script: str, key_index: int) -> str:
    return _SIZE.replace("SIZES", str(key_index)) + script


# KEYS: config, wip, origin queue, stats, sizes; ARGV: generation, job id, origin's counter
# prefix ('main' or 'retry').
GIVE_BACK = _with_sizes(
    _fenced_once(
        "redis.call('LREM', KEYS[2], 1, ARGV[2])",
        "  redis.call('LPUSH', KEYS[3], ARGV[2])\n"
        "  redis.call('HINCRBY', KEYS[4], ARGV[3] .. '_samples', size_of(ARGV[2]))\n"
        "  redis.call('HINCRBY', KEYS[4], ARGV[3] .. '_jobs', 1)",
    ),
    5,
)

# Claims the first job of the retry queue, else of the main queue, into a worker's wip list,
# moving its count out of that queue's counters. KEYS: retry, main, wip, stats, config,
# sizes. Replies the job id and its queue ('retry' or 'main'), or nil.
CLAIM = _with_sizes(
    """
local id = redis.call('LMOVE', KEYS[1], KEYS[3], 'LEFT', 'RIGHT')
local which = 'retry'
if not id then
  id = redis.call('LMOVE', KEYS[2], KEYS[3], 'LEFT', 'RIGHT')
  which = 'main'
end
if not id then return false end
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('HINCRBY', KEYS[4], which .. '_samples', -size_of(id))
  redis.call('HINCRBY', KEYS[4], which .. '_jobs', -1)
end
return {id, which}
""",
    6,
)

# The jobs queued or held by a registered worker, counted in one step: counted by separate
# reads, a job moving between a wip list and a queue (a reaper's hand-back, a claim) could
# be in neither when each was read, and a run with work left looked finished. KEYS: main
# queue, retry queue, workers set; ARGV: the wip lists' key prefix (a worker id completes
# it: those keys come from the set, so they cannot be named in KEYS beforehand).
OUTSTANDING = """
local n = redis.call('LLEN', KEYS[1]) + redis.call('LLEN', KEYS[2])
for _, w in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  n = n + redis.call('LLEN', ARGV[1] .. w)
end
return n
"""

# Moves the last job of a wip list to the front of the main queue, with its count.
# KEYS: wip, main, stats, config, sizes.
RELEASE_ONE = _with_sizes(
    """
local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
if id and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'main_samples', size_of(id))
  redis.call('HINCRBY', KEYS[3], 'main_jobs', 1)
end
return id
""",
    5,
)

# Re-derives the queue counters and the dead letter's reason counts from the lists and the
# dead hash, atomically (O(jobs + dead entries): the repair and migration path, not status).
# KEYS: config, main, retry, stats, sizes, dead, reasons.
RECOUNT = _with_sizes(
    _REASON
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local function sum(key)
  local ids = redis.call('LRANGE', key, 0, -1)
  local n = 0
  for _, id in ipairs(ids) do n = n + size_of(id) end
  return n, #ids
end
local ms, mj = sum(KEYS[2])
local rs, rj = sum(KEYS[3])
redis.call('HSET', KEYS[4], 'main_samples', ms, 'main_jobs', mj, 'retry_samples', rs,
           'retry_jobs', rj, 'counters', ARGV[1])
redis.call('DEL', KEYS[7])
local counts = {}
local dead = redis.call('HGETALL', KEYS[6])
for i = 2, #dead, 2 do
  local r = reason_of(dead[i])
  counts[r] = (counts[r] or 0) + 1
end
for r, n in pairs(counts) do redis.call('HSET', KEYS[7], r, n) end
return ms + rs
""",
    5,
)
# The reaper's lock, only in a run that exists (a purged run gets no key back).
REAP_LOCK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
"""
FORGET_LOST = """
if redis.call('HINCRBY', KEYS[1], 'lost', -tonumber(ARGV[1])) < 0 then
  redis.call('HSET', KEYS[1], 'lost', 0)
end
return 1
"""

HINCR = _FENCE + "return redis.call('HINCRBY', KEYS[2], ARGV[2], 1)"

# Model and layers of the first valid dump: HSETNX, only into the run we read.
PIN = (
    _FENCE
    + """
for i = 2, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
)

HEARTBEAT = (
    _FENCE
    + """
redis.call('SADD', KEYS[2], ARGV[2])
if #ARGV >= 5 then redis.call('HSET', KEYS[3], unpack(ARGV, 4)) end
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
return 1
"""
)

# Creates a run's config if there is none (one enqueue wins); 0 if it exists. Its counters
# start exact (a new run has no job): KEYS[2] is the stats hash. ARGV: field, value pairs.
CREATE = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[2], 'counters', {COUNTERS_VERSION})
return 1
"""

ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSETNX', KEYS[1], 'generation', ARGV[1]) end
return 1
"""

# Releases a lock only if we still hold it.
UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
