"""All of hsq's Redis traffic. Keys come from hsq.keys, jobs are RQ jobs.

Nothing else imports redis or rq (the test harness that starts redis-server aside). Every public
method turns Redis errors into hsq errors: StoreUnavailableError (unreachable or timing out:
transient) or StoreError; a write to a run that was purged or re-created since this store
read its config raises RunChangedError.

RQ provides the queue format (JSON-serialized jobs in `rq:queue:*` lists, visible to `rq info`)
and enqueueing, through its public API only (Queue.prepare_data / enqueue_many, Job.fetch_many;
docs/queue.md says why). hsq's worker dequeues on its own with the reliable-queue pattern
(LMOVE into a per-worker wip list) because RQ's own worker brings back a SIGKILLed job only
after timeout + 60 s + up to 600 s and spends about 52 Redis commands per job. A job is a
chunk of sample ids, so queue overhead is paid once per chunk; a worker marks the samples it
finished done in batches (`mark_done_many`: one script call per batch, a fixed handful of
commands whatever its size).

Counters (docs/queue.md "Counters"): the stats hash holds the samples and jobs in the main and
retry queues and the samples known lost; every script or MULTI that moves a job moves its
count with it (a job id ends in `-n<samples>`), so `hsq status` reads a handful of O(1)
values instead of every job. `recount_queues` re-derives them.

Fencing: a run's config holds a random `generation` made when the run is created. Every write
a worker makes (done-mark, finish, give-back, retry enqueue, dead letter, model pin, worker
heartbeat) is conditional on the generation this store read (Lua, or WATCH for RQ's enqueue),
so a purge, a Redis wipe or a re-created run is never written into by a worker that holds the
old one, and a purged done hash never comes back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from hsq import jsonsafe
from hsq.dataset import IndexEntry
from hsq.errors import (
    ConfigError,
    RunChangedError,
    StoreError,
    StoreUnavailableError,
)
from hsq.keys import RUNS, RunKeys, rq_job_key, rq_queue_key
from hsq.outputs.manifest import ManifestEntry, encode_manifest, manifest_json
from hsq.redisurl import check_url, scrub
from hsq.redisurl import redact as redact  # re-exported: callers and tests use hsq.store.redact
from hsq.runconfig import RunConfig

JOB_FUNC = "hsq.workers.jobs.extract_chunk"
HEARTBEAT_TTL_S = 10
ENQUEUE_LOCK_TTL_S = 60
REAP_LOCK_MS = 1000
MAX_DEAD_ENTRY = 64 * 1024
SampleRef = tuple[str, IndexEntry]
AnyRef = tuple[str, IndexEntry | str]
"""A sample and its index entry, or the entry already encoded (the producer's fast path)."""
Client = redis.Redis
"""The client type, for modules that hold a connection without importing redis."""
P = ParamSpec("P")
R = TypeVar("R")

# TLS options for rediss:// URLs: a flag (CLI), an env var, or a URL query parameter.
TLS_ENV = {
    "ssl_ca_certs": "HSQ_REDIS_CA",
    "ssl_certfile": "HSQ_REDIS_CERT",
    "ssl_keyfile": "HSQ_REDIS_KEY",
}

# Every fenced script starts with this: KEYS[1] is the run's config, ARGV[1] the generation
# the caller holds (as stored: JSON). -1 means the run is gone or was re-created.
_FENCE = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return -1 end
"""


def _fenced_once(first: str, then: str) -> str:
    """A fenced script: run `first`; only if it changed something, run `then`; 1 or 0."""
    return _FENCE + f"if {first} == 1 then\n{then}\n  return 1\nend\nreturn 0\n"


# Un-marks a sample (verify --requeue) and takes it out of the totals, exactly once.
_UNDO_DONE = _fenced_once(
    "redis.call('HDEL', KEYS[2], ARGV[2])",
    "  redis.call('HINCRBY', KEYS[3], 'tokens', -tonumber(ARGV[3]))\n"
    "  redis.call('HINCRBY', KEYS[3], 'bytes', -tonumber(ARGV[4]))",
)
# Ownership-checked job moves: act only if the job is still in this worker's wip list.
_FINISH = _fenced_once("redis.call('LREM', KEYS[2], 1, ARGV[2])", "  redis.call('DEL', KEYS[3])")
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
# the done hash. KEYS: config, done, stats, dead, dead reasons; ARGV: generation, then
# (sample id, manifest JSON, tokens, bytes) per sample. A newly done sample leaves the dead
# letter (done and dead stay disjoint, so status adds them up without reading either).
# Replies 1/0 per sample. Commands: HGET, HMGET, HSET, 2 HINCRBY, HLEN whatever the batch.
_MARK_DONE_MANY = (
    _FENCE
    + _REASON
    + """
local ids = {}
for i = 2, #ARGV, 4 do ids[#ids + 1] = ARGV[i] end
local have = redis.call('HMGET', KEYS[2], unpack(ids))
local out, put, new, seen = {}, {}, {}, {}
local tokens, nbytes = 0, 0
for j, sid in ipairs(ids) do
  local i = 2 + (j - 1) * 4
  if have[j] or seen[sid] then
    out[j] = 0
  else
    seen[sid] = true
    out[j] = 1
    put[#put + 1] = sid
    put[#put + 1] = ARGV[i + 1]
    new[#new + 1] = sid
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
end
return out
"""
)
MAX_MARK_BATCH = 500
"""Samples per mark_done_many script call (Lua's unpack takes a few thousand arguments)."""

# Puts a dead-letter entry and counts its reason. KEYS: config, dead, reasons, done; ARGV:
# generation, key, entry JSON, reason. A sample already done is not dead-lettered (0).
_TO_DEAD = (
    _FENCE
    + _REASON
    + """
if redis.call('HMGET', KEYS[4], ARGV[2])[1] then return 0 end
local old = redis.call('HGET', KEYS[2], ARGV[2])
if old then unreason(KEYS[3], old) end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""
)

# Takes entries out of the dead letter, keeping the reason counts. KEYS: dead, reasons.
_DEAD_REMOVE = (
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
_GIVE_BACK = _with_sizes(
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
_CLAIM = _with_sizes(
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

# Moves the last job of a wip list to the front of the main queue, with its count.
# KEYS: wip, main, stats, config, sizes.
_RELEASE_ONE = _with_sizes(
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
_RECOUNT = _with_sizes(
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
COUNTERS_VERSION = 1
# The reaper's lock, only in a run that exists (a purged run gets no key back).
_REAP_LOCK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
"""
_FORGET_LOST = """
if redis.call('HINCRBY', KEYS[1], 'lost', -tonumber(ARGV[1])) < 0 then
  redis.call('HSET', KEYS[1], 'lost', 0)
end
return 1
"""

_HINCR = _FENCE + "return redis.call('HINCRBY', KEYS[2], ARGV[2], 1)"

# Model and layers of the first valid dump: HSETNX, only into the run we read.
_PIN = (
    _FENCE
    + """
for i = 2, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
)

_HEARTBEAT = (
    _FENCE
    + """
redis.call('SADD', KEYS[2], ARGV[2])
if #ARGV >= 5 then redis.call('HSET', KEYS[3], unpack(ARGV, 4)) end
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
return 1
"""
)

# Creates a run's config if there is none (one enqueue wins); 0 if it exists. Its counters
# start exact (a new run has no job): KEYS[3] is the stats hash.
_CREATE = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'counters', {COUNTERS_VERSION})
return 1
"""

_ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSETNX', KEYS[1], 'generation', ARGV[1]) end
return 1
"""

# Releases a lock only if we still hold it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


@contextlib.contextmanager
def _redis_errors(where: str = "Redis") -> Iterator[None]:
    """Redis exceptions as hsq errors: unreachable is transient, the rest is not."""
    try:
        yield
    except redis.exceptions.AuthenticationError as exc:
        raise StoreError(f"{where} refused the credentials: {exc}") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise StoreUnavailableError(f"cannot reach {where}: {exc}") from exc
    except redis.exceptions.NoPermissionError as exc:
        raise StoreError(f"the user of {where} lacks a permission hsq needs: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"{where}: {exc}") from exc


def _translated(fn: Callable[P, R]) -> Callable[P, R]:
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            with _redis_errors():
                yield from fn(*args, **kwargs)

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with _redis_errors():
            return fn(*args, **kwargs)

    return wrapper


T = TypeVar("T")


def _translate_public(cls: type[T]) -> type[T]:
    """Wrap every public method: callers see hsq errors only, never redis exceptions."""
    for name, attr in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(attr):
            setattr(cls, name, _translated(attr))
    return cls


def connect(url: str) -> redis.Redis:
    """A client from a URL (auth, db and TLS files come from it, or from HSQ_REDIS_CA /
    HSQ_REDIS_CERT / HSQ_REDIS_KEY for rediss://); retries transient connection errors."""
    check_url(url)  # before any parser sees it: a reserved character would leak (redisurl.py)
    kwargs: dict[str, Any] = {}
    if url.startswith("rediss://"):
        query = dict(parse_qsl(urlsplit(url).query))
        for opt, env in TLS_ENV.items():
            if opt not in query and os.environ.get(env):
                kwargs[opt] = os.environ[env]
    try:
        with _redis_errors(f"Redis at {redact(url)}"):
            client = redis.Redis.from_url(
                url,
                socket_connect_timeout=5,
                socket_timeout=30,
                health_check_interval=15,
                retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 5),
                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
                **kwargs,
            )
            client.ping()
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"bad Redis URL {redact(url)}: {scrub(str(exc), url)}") from None
    except StoreError as exc:  # redis-py's messages name what it parsed: never a password
        raise type(exc)(scrub(str(exc), url)) from None
    return client


_redact = redact  # the name older callers use


def list_runs(client: redis.Redis) -> list[str]:
    with _redis_errors():
        return sorted(_s(r) for r in client.smembers(RUNS))


def redis_calls(client: redis.Redis) -> int:
    """Commands Redis executed so far (INFO commandstats, all commands)."""
    with _redis_errors():
        stats = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


@dataclass(frozen=True)
class ChunkJob:
    """A claimed job: which queue it came from and what it holds."""

    job_id: str
    origin: str
    samples: list[SampleRef]
    attempt: int
    reason: str | None


@dataclass(frozen=True)
class Snapshot:
    """A run's O(1) counters, read in one round trip (status and the exporter)."""

    index: int
    done: int
    dead: int
    dead_lines: int
    main_jobs: int
    retry_jobs: int
    held_jobs: int
    live_workers: int
    stats: dict[str, int]
    out: str | None


@dataclass(frozen=True)
class Counts:
    """A run's counters, read in one transaction (so they agree with each other)."""

    index: int
    done: int
    dead: int
    main_jobs_listed: int
    retry_jobs_listed: int
    stats: dict[str, int]
    dead_reasons: dict[str, int]

    @property
    def consistent(self) -> bool:
        """The queue counters can be trusted: they exist, and the job counts they keep
        match the queues' lengths (a queue damaged from outside, e.g. a DEL, breaks this)."""
        st = self.stats
        return (
            st.get("counters") == COUNTERS_VERSION
            and st.get("main_jobs", 0) == self.main_jobs_listed
            and st.get("retry_jobs", 0) == self.retry_jobs_listed
        )


_JOB_SIZE_RE = re.compile(r"-n([0-9]{1,9})$")


def job_id_for(run: str, samples: int) -> str:
    """A new job id; it carries the job's sample count, which the scripts read."""
    return RunKeys(run).job_id(secrets.token_hex(8), samples)


def job_size(job_id: str) -> int | None:
    """The sample count a job id carries (None for ids made before they carried one)."""
    m = _JOB_SIZE_RE.search(job_id)
    return int(m.group(1)) if m else None


def _job_kwargs(
    run: str, samples: Iterable[AnyRef], attempt: int, reason: str | None
) -> dict[str, Any]:
    return {
        "run": run,
        "samples": [[sid, e if isinstance(e, str) else e.encode()] for sid, e in samples],
        "attempt": attempt,
        "reason": reason,
    }


@_translate_public
class RunStore:
    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.run = run
        try:
            self.keys = RunKeys(run)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._generation: str | None = None  # as stored (JSON), for the fence
        self._held: set[str] = set()  # job ids claim() handed out and not yet finished
        self._held_lock = threading.RLock()
        reg = client.register_script
        self._mark_done_many = reg(_MARK_DONE_MANY)
        self._to_dead = reg(_TO_DEAD)
        self._dead_remove = reg(_DEAD_REMOVE)
        self._claim = reg(_CLAIM)
        self._release_one = reg(_RELEASE_ONE)
        self._recount = reg(_RECOUNT)
        self._forget_lost = reg(_FORGET_LOST)
        self._reap_lock = reg(_REAP_LOCK)
        self._undo_done = reg(_UNDO_DONE)
        self._finish = reg(_FINISH)
        self._give_back = reg(_GIVE_BACK)
        self._hincr = reg(_HINCR)
        self._pin = reg(_PIN)
        self._heartbeat = reg(_HEARTBEAT)
        self._create = reg(_CREATE)
        self._adopt = reg(_ADOPT)
        self._unlock = reg(_UNLOCK)
        self._extend = reg(_EXTEND)
        self._queues = {
            name: Queue(name, connection=client, serializer=JSONSerializer)
            for name in (self.keys.main_queue, self.keys.retry_queue)
        }

    # ------------------------------------------------------------------ config and index
    def load_config(self) -> RunConfig | None:
        """The run's config (None if there is none); refreshes the generation we hold."""
        raw = self.client.hgetall(self.keys.config)
        if not raw:
            return None
        cfg = RunConfig.from_redis(raw)  # type: ignore[arg-type]
        if cfg.generation is None:
            # A run created before generations existed gets one now (once, atomically).
            self._adopt(keys=[self.keys.config], args=[json.dumps(secrets.token_hex(8))])
            return self.load_config()
        self._generation = json.dumps(cfg.generation)
        return cfg

    def require_config(self) -> RunConfig:
        cfg = self.load_config()
        if cfg is None:
            raise ConfigError(f"run {self.run!r} does not exist (run `hsq enqueue` first)")
        return cfg

    @property
    def generation(self) -> str | None:
        return None if self._generation is None else json.loads(self._generation)

    def create_config(self, cfg: RunConfig) -> tuple[RunConfig, bool]:
        """Record the run's config with a fresh generation unless one exists (atomic: of two
        concurrent creators one wins). Returns (the recorded config, whether we created it)."""
        fresh = replace(cfg, generation=secrets.token_hex(8))
        flat = [x for kv in fresh.to_redis().items() for x in kv]
        created = bool(
            self._create(keys=[self.keys.config, RUNS, self.keys.stats], args=[self.run, *flat])
        )
        return self.require_config(), created

    def save_config(self, cfg: RunConfig) -> None:
        """Create the run's config (kept for callers of the old name)."""
        self.create_config(cfg)

    def _fence_args(self) -> str:
        if self._generation is None:
            self.require_config()
        assert self._generation is not None
        return self._generation

    def _fenced(self, script: Any, keys: list[str], args: list[Any]) -> int:
        return int(self._fenced_raw(script, keys, args))

    def _fenced_raw(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        res = script(keys=[self.keys.config, *keys], args=[self._fence_args(), *args])
        if res == -1:
            raise RunChangedError(
                f"run {self.run!r} was purged or re-created (generation {self.generation} "
                "is no longer current); re-read its config"
            )
        return res

    def pin_model(self, model_id: str, layer_ids: list[int]) -> tuple[str, list[int]]:
        """Record the model and layers of the first valid dump (atomic HSETNX); return the
        recorded ones, so a worker behind a different model sees the mismatch."""
        self._fenced(
            self._pin, [], ["model_id", json.dumps(model_id), "layer_ids", json.dumps(layer_ids)]
        )
        cfg = self.require_config()
        assert cfg.model_id is not None and cfg.layer_ids is not None
        return cfg.model_id, cfg.layer_ids

    def pin_dump_identity(
        self, model_id: str, layer_ids: list[int], dump_dtype: str, hidden_size: int
    ) -> dict[str, Any]:
        """Record what the first fully valid dump showed (model, layers, dtype, hidden size;
        each HSETNX, so the first worker wins) and return the recorded values by name."""
        values = {
            "model_id": model_id,
            "layer_ids": layer_ids,
            "dump_dtype": dump_dtype,
            "hidden_size": hidden_size,
        }
        pairs = [x for name, value in values.items() for x in (name, json.dumps(value))]
        self._fenced(self._pin, [], pairs)  # never pins into a purged or re-created run
        recorded = self.client.hmget(self.keys.config, list(values))
        return {
            name: json.loads(raw) if raw is not None else None
            for name, raw in zip(values, recorded, strict=True)
        }

    def put_index(self, entries: Iterable[AnyRef], batch: int = 5000) -> int:
        n = 0
        buf: dict[str, str] = {}
        for sid, e in entries:
            buf[sid] = e if isinstance(e, str) else e.encode()
            if len(buf) >= batch:
                self.client.hset(self.keys.index, mapping=buf)  # type: ignore[arg-type]
                n += len(buf)
                buf = {}
        if buf:
            self.client.hset(self.keys.index, mapping=buf)  # type: ignore[arg-type]
            n += len(buf)
        return n

    def delete_fields(self, key: str, fields: Iterable[str], batch: int = 5000) -> int:
        """HDEL in batches (pruning the index and the dead letter: the dead letter's through
        a script that keeps its reason counts)."""
        items = list(fields)
        n = 0
        for i in range(0, len(items), batch):
            part = items[i : i + batch]
            if key == self.keys.dead:
                n += int(self._dead_remove(keys=[key, self.keys.dead_reasons], args=part))
            else:
                n += int(self.client.hdel(key, *part))
        return n

    def set_totals(self, *, samples: int, tokens: int, invalid_lines: int) -> None:
        self.client.hset(
            self.keys.stats,
            mapping={
                "total_samples": samples,
                "total_tokens": tokens,
                "invalid_lines": invalid_lines,
            },
        )

    def stats(self) -> dict[str, int]:
        return {_s(k): int(v) for k, v in self.client.hgetall(self.keys.stats).items()}

    def get_index(self, ids: list[str]) -> dict[str, IndexEntry]:
        if not ids:
            return {}
        vals = self.client.hmget(self.keys.index, ids)
        out: dict[str, IndexEntry] = {}
        for sid, v in zip(ids, vals, strict=True):
            if v:
                with contextlib.suppress(ValueError):  # a damaged entry counts as absent
                    out[sid] = IndexEntry.decode(v)
        return out

    def iter_hash_keys(self, key: str) -> Iterator[str]:
        # HSCAN NOVALUES needs Redis 7.4; values are small here.
        for field, _ in self.client.hscan_iter(key, count=10000):
            yield _s(field)

    def iter_done(self) -> Iterator[tuple[str, bytes]]:
        """(sample id, raw manifest entry) of every done sample; entries are untrusted."""
        for field, value in self.client.hscan_iter(self.keys.done, count=1000):
            sid = _s(field)
            yield sid, manifest_json(sid, value)

    def count(self, key: str) -> int:
        return int(self.client.hlen(key))

    def snapshot(self) -> Snapshot:
        k = self.keys
        p = self._queue_reads(self.client.pipeline(transaction=False))
        p.smembers(k.workers)
        p.hget(k.config, "out")
        index, done, dead, main, retry, stats, wids, out = p.execute()
        st = {_s(a): int(b) for a, b in stats.items()}
        p = self.client.pipeline(transaction=False)
        for w in wids:
            p.exists(k.worker(_s(w)))
            p.llen(k.wip(_s(w)))
        res = p.execute()
        out_path = None
        with contextlib.suppress(ValueError, TypeError):
            out_path = jsonsafe.loads(out) if out else None
        return Snapshot(
            index=int(index),
            done=int(done),
            dead=int(dead),
            dead_lines=st.get("invalid_lines", 0),
            main_jobs=int(main),
            retry_jobs=int(retry),
            held_jobs=sum(res[1::2]),
            live_workers=sum(res[0::2]),
            stats=st,
            out=out_path if isinstance(out_path, str) else None,
        )

    def _queue_reads(self, p: Any) -> Any:
        """Queue the reads `snapshot` and `counts` share (their first six results): index,
        done and dead sizes, the two queues' lengths, the stats hash."""
        k = self.keys
        p.hlen(k.index)
        p.hlen(k.done)
        p.hlen(k.dead)
        p.llen(rq_queue_key(k.main_queue))
        p.llen(rq_queue_key(k.retry_queue))
        p.hgetall(k.stats)
        return p

    def counts(self) -> Counts:
        """The O(1) counters `hsq status` adds up, in one MULTI: one instant of the run."""
        k = self.keys
        p = self._queue_reads(self.client.pipeline(transaction=True))
        p.hgetall(k.dead_reasons)
        index, done, dead, main, retry, stats, reasons = p.execute()
        return Counts(
            index=int(index),
            done=int(done),
            dead=int(dead),
            main_jobs_listed=int(main),
            retry_jobs_listed=int(retry),
            stats={_s(a): int(b) for a, b in stats.items()},
            dead_reasons={_s(a): int(b) for a, b in reasons.items() if int(b) > 0},
        )

    def recount_queues(self) -> int:
        """Re-derive the queue counters and the dead letter's reason counts from the queues
        themselves, atomically (O(jobs): the migration and repair path). Jobs enqueued before
        ids carried their size get it recorded first. Returns the samples the queues hold."""
        k = self.keys
        sizes: dict[str, int] = {}
        for key in (rq_queue_key(k.main_queue), rq_queue_key(k.retry_queue)):
            legacy = [j for j in (_s(x) for x in self.client.lrange(key, 0, -1)) if not job_size(j)]
            for i in range(0, len(legacy), 500):
                for jid, job in zip(
                    legacy[i : i + 500], self._fetch_jobs(legacy[i : i + 500]), strict=True
                ):
                    parsed = None if job is None else _parse_job(job, (k.main_queue,))
                    sizes[jid] = len(parsed.samples) if parsed else 0
        if sizes:
            self.client.hset(k.job_sizes, mapping=sizes)  # type: ignore[arg-type]
        res = int(
            self._recount(
                keys=[
                    k.config,
                    rq_queue_key(k.main_queue),
                    rq_queue_key(k.retry_queue),
                    k.stats,
                    k.job_sizes,
                    k.dead,
                    k.dead_reasons,
                ],
                args=[COUNTERS_VERSION],
            )
        )
        if res == -1:
            raise ConfigError(f"run {self.run!r} does not exist")
        return res

    def presence(self, ids: list[str]) -> tuple[list[bool], list[bool], list[bool]]:
        """For each id: in the index, done, in the dead letter (three HMGETs, one trip)."""
        if not ids:
            return [], [], []
        p = self.client.pipeline(transaction=False)
        for key in (self.keys.index, self.keys.done, self.keys.dead):
            p.hmget(key, ids)
        index, done, dead = p.execute()
        return (
            [v is not None for v in index],
            [v is not None for v in done],
            [v is not None for v in dead],
        )

    def begin_enqueue(self) -> bool:
        """Flag an enqueue in progress; True if the last one never finished (a crash between
        its index writes and its jobs: the next enqueue must then look at every job)."""
        p = self.client.pipeline(transaction=True)
        p.hget(self.keys.stats, "enqueuing")
        p.hset(self.keys.stats, "enqueuing", 1)
        was, _ = p.execute()
        return was is not None

    def end_enqueue(self) -> None:
        """Everything of the dataset not done, dead or queued was enqueued: nothing is lost."""
        p = self.client.pipeline(transaction=True)
        p.hset(self.keys.stats, "lost", 0)
        p.hdel(self.keys.stats, "enqueuing")
        p.execute()

    def set_lost(self, samples: int) -> None:
        """Record how many samples are in no queue (a recount found them, or they were
        all enqueued again: 0)."""
        self.client.hset(self.keys.stats, "lost", max(0, samples))

    def forget_lost(self, samples: int) -> None:
        """`samples` lost ones were enqueued again (the count never goes below 0)."""
        if samples:
            self._forget_lost(keys=[self.keys.stats], args=[samples])

    def workers_info(self) -> dict[str, dict[str, str]]:
        """Every registered worker's heartbeat hash ({} once expired), in one round trip."""
        wids = self.worker_ids()
        p = self.client.pipeline(transaction=False)
        for wid in wids:
            p.hgetall(self.keys.worker(wid))
        return {
            wid: {_s(a): _s(b) for a, b in raw.items()}
            for wid, raw in zip(wids, p.execute(), strict=True)
        }

    # ------------------------------------------------------------------ done and dead
    def done_among(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        vals = self.client.hmget(self.keys.done, ids)
        return {sid for sid, v in zip(ids, vals, strict=True) if v is not None}

    def mark_done(self, sample_id: str, entry: ManifestEntry) -> bool:
        """True if this call made the sample done; False if it already was."""
        return self.mark_done_many([(sample_id, entry)])[0]

    def mark_done_many(self, entries: Sequence[tuple[str, ManifestEntry]]) -> list[bool]:
        """Mark samples done, each exactly once, in one script call per MAX_MARK_BATCH (the
        same fence, idempotency and totals as one mark_done each). Per sample: True if this
        call made it done. Call it only once every file is durably written."""
        out: list[bool] = []
        k = self.keys
        for i in range(0, len(entries), MAX_MARK_BATCH):
            args: list[Any] = []
            for sid, e in entries[i : i + MAX_MARK_BATCH]:
                args += [sid, encode_manifest(sid, e), e.num_tokens, e.bytes]
            res = self._fenced_raw(
                self._mark_done_many, [k.done, k.stats, k.dead, k.dead_reasons], args
            )
            out += [bool(x) for x in res]
        return out

    def done_entries(self, ids: list[str]) -> list[bytes | None]:
        """The raw (untrusted) manifest entry of each id, None where it is not done."""
        if not ids:
            return []
        vals = self.client.hmget(self.keys.done, ids)
        return [
            None if v is None else manifest_json(sid, v.encode() if isinstance(v, str) else v)
            for sid, v in zip(ids, vals, strict=True)
        ]

    def undo_done(self, sample_id: str, entry: ManifestEntry) -> bool:
        res = self._fenced(
            self._undo_done,
            [self.keys.done, self.keys.stats],
            [sample_id, entry.num_tokens, entry.bytes],
        )
        return bool(res)

    def iter_manifest(self) -> Iterator[tuple[str, ManifestEntry | None]]:
        """Every done sample with its manifest entry (HSCAN: no one huge reply); None for
        an entry that does not parse (Redis is untrusted)."""
        for field, raw in self.client.hscan_iter(self.keys.done, count=1000):
            try:
                entry: ManifestEntry | None = ManifestEntry.from_json(manifest_json(_s(field), raw))
            except (ValueError, TypeError):
                entry = None
            yield _s(field), entry

    def get_manifest(self, sample_id: str) -> ManifestEntry | None:
        raw = self.client.hget(self.keys.done, sample_id)
        if not raw:
            return None
        try:
            return ManifestEntry.from_json(manifest_json(sample_id, raw))
        except (ValueError, TypeError):  # Redis is untrusted: a damaged entry is no entry
            return None

    def to_dead(
        self, sample_id: str, reason: str, message: str, attempts: int, worker: str | None
    ) -> None:
        entry = {
            "reason": reason,
            "message": message[:2000],
            "attempts": attempts,
            "worker": worker,
            "time": time.time(),
        }
        # A sample already done is not dead-lettered: done and dead stay disjoint.
        self._fenced(
            self._to_dead,
            [self.keys.dead, self.keys.dead_reasons, self.keys.done],
            [sample_id, json.dumps(entry), reason],
        )

    def dead_reasons(self) -> dict[str, int]:
        """Dead-letter entries by reason, from the counts the scripts keep (O(reasons))."""
        raw = self.client.hgetall(self.keys.dead_reasons)
        return {_s(k): int(v) for k, v in raw.items() if int(v) > 0}

    def dead_entries(self) -> dict[str, dict[str, Any]]:
        """The dead letter; an unreadable entry (Redis is untrusted) reads as reason `?`."""
        out: dict[str, dict[str, Any]] = {}
        for k, v in self.client.hgetall(self.keys.dead).items():
            entry: Any = None
            if len(v) <= MAX_DEAD_ENTRY:
                with contextlib.suppress(ValueError):
                    entry = jsonsafe.loads(v)
            if not isinstance(entry, dict) or not isinstance(entry.get("reason"), str):
                entry = {"reason": "?", "message": "unreadable dead-letter entry"}
            out[_s(k)] = entry
        return out

    def clear_failures(self, ids: Iterable[str]) -> None:
        """Take samples out of the dead letter and the crash counts (they were requeued)."""
        items = list(ids)
        self.delete_fields(self.keys.dead, items)
        self.delete_fields(self.keys.crashes, items)

    def record_crash(self, sample_id: str) -> int:
        return self._fenced(self._hincr, [self.keys.crashes], [sample_id])

    # ------------------------------------------------------------------ queues
    def enqueue(
        self,
        chunks: Iterable[Sequence[AnyRef]],
        *,
        retry: bool = False,
        attempt: int = 0,
        reason: str | None = None,
        batch: int = 200,
        clear_failures: bool = False,
    ) -> int:
        """Enqueue chunk jobs (RQ, JSON serializer), fenced on the run's generation; returns
        the number of samples. `clear_failures`: the samples leave the dead letter and the
        crash counts in the same transaction (a requeue: never both queued and dead)."""
        q = self._queues[self.keys.retry_queue if retry else self.keys.main_queue]
        n = 0
        datas = []
        sizes = 0
        ids: list[str] = []
        which = "retry" if retry else "main"
        for chunk in chunks:
            if clear_failures:
                ids += [sid for sid, _ in chunk]
            job_id = self.keys.job_id(secrets.token_hex(8), len(chunk))
            datas.append(
                Queue.prepare_data(
                    JOB_FUNC,
                    kwargs=_job_kwargs(self.run, chunk, attempt, reason),
                    job_id=job_id,
                    result_ttl=0,
                    ttl=None,
                    description=f"hsq chunk of {len(chunk)} samples",
                )
            )
            n += len(chunk)
            sizes += len(chunk)
            if len(datas) >= batch:
                self._enqueue_fenced(q, datas, sizes, which, ids)
                datas, sizes, ids = [], 0, []
        if datas:
            self._enqueue_fenced(q, datas, sizes, which, ids)
        return n

    def _enqueue_fenced(
        self, q: Queue, datas: list[Any], samples: int, which: str, cleared: list[str]
    ) -> None:
        # RQ writes the job hash and the queue entry; WATCH makes that conditional on the
        # config (and so the generation) staying as we read it. Another config change
        # (a model pin) only makes us try again.
        gen = self._fence_args()
        if cleared:  # loads the script if Redis does not have it yet (a no-op call)
            self._dead_remove(keys=[self.keys.dead, self.keys.dead_reasons], args=[])
        for _ in range(100):
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(self.keys.config)  # type: ignore[no-untyped-call]
                    if pipe.hget(self.keys.config, "generation") != gen.encode():
                        raise RunChangedError(
                            f"run {self.run!r} was purged or re-created; nothing enqueued"
                        )
                    pipe.multi()
                    q.enqueue_many(datas, pipeline=pipe)
                    # The queue's counters move in the same transaction as its jobs.
                    pipe.hincrby(self.keys.stats, f"{which}_samples", samples)
                    pipe.hincrby(self.keys.stats, f"{which}_jobs", len(datas))
                    if cleared:
                        # EVALSHA queued in the MULTI (the script was loaded above).
                        k = self.keys
                        pipe.evalsha(self._dead_remove.sha, 2, k.dead, k.dead_reasons, *cleared)
                        pipe.hdel(k.crashes, *cleared)
                    pipe.execute()
                    return
                except redis.exceptions.WatchError:
                    continue
        raise StoreError("the run's config kept changing while enqueueing; try again")

    def claim(self, worker_id: str, timeout: float) -> ChunkJob | None:
        """Move one job into this worker's wip list: retries first, then the main queue
        (waiting up to `timeout` seconds, at least 1, for one; not at all if `timeout` <= 0).

        A job already in our wip list that this store did not hand out is returned first:
        that is what a lost BLMOVE reply leaves behind (redis-py retries the command, and
        the first move's job sits in wip unknown to us)."""
        wip = self.keys.wip(worker_id)
        stray = self._stray(wip)
        if stray is not None:
            return stray
        job_id = self._claim_now(wip)
        if job_id is None and timeout <= 0:  # no wait: the caller has other work going
            return None
        if job_id is None:
            # Wait for work without taking it: BLMOVE of the main queue onto itself returns
            # as soon as it holds a job (rotating one, so nothing is ever only in flight),
            # then the claim script takes a job and its count atomically.
            main = rq_queue_key(self.keys.main_queue)
            if self.client.blmove(main, main, max(1, round(timeout)), "LEFT", "RIGHT") is None:
                return None
            job_id = self._claim_now(wip)
        if job_id is None:
            return None
        return self._load_job(wip, job_id)

    def _claim_now(self, wip: str) -> str | None:
        k = self.keys
        res = self._claim(
            keys=[
                rq_queue_key(k.retry_queue),
                rq_queue_key(k.main_queue),
                wip,
                k.stats,
                k.config,
                k.job_sizes,
            ]
        )
        return None if not res else _s(res[0])

    def _stray(self, wip: str) -> ChunkJob | None:
        held = [_s(j) for j in self.client.lrange(wip, 0, -1)]
        with self._held_lock:
            strays = [j for j in held if j not in self._held]
        return self._load_job(wip, strays[0]) if strays else None

    def _load_job(self, wip: str, jid: str) -> ChunkJob:
        with self._held_lock:
            self._held.add(jid)
        job = Job.fetch_many([jid], connection=self.client, serializer=JSONSerializer)[0]
        parsed = (
            None if job is None else _parse_job(job, (self.keys.main_queue, self.keys.retry_queue))
        )
        if parsed is None:
            # A job hash lost or unreadable: drop the id and count its samples as lost;
            # `requeue --missing` finds them.
            p = self.client.pipeline(transaction=True)
            p.lrem(wip, 1, jid)
            p.hincrby(self.keys.stats, "lost", job_size(jid) or 1)
            p.execute()
            self._forget(jid)
            raise StoreError(
                f"job {jid} unreadable; its samples are found by `hsq requeue --missing`"
            )
        return parsed

    def _forget(self, job_id: str) -> None:
        with self._held_lock:
            self._held.discard(job_id)

    def finish(self, worker_id: str, job: ChunkJob) -> bool:
        """Drop a finished job. Only while we still hold it: a reaper may have handed it to
        another worker while we were cut off, and its hash must then stay."""
        with self._held_lock:
            try:
                res = self._fenced(
                    self._finish, [self.keys.wip(worker_id), rq_job_key(job.job_id)], [job.job_id]
                )
            finally:
                self._held.discard(job.job_id)
        return bool(res)

    def give_back(self, worker_id: str, job: ChunkJob) -> bool:
        """Put a job back at the front of its queue, untouched (not the sample's fault);
        only while we still hold it, so a reaped job is never queued twice."""
        with self._held_lock:
            try:
                which = "retry" if job.origin == self.keys.retry_queue else "main"
                res = self._fenced(
                    self._give_back,
                    [
                        self.keys.wip(worker_id),
                        rq_queue_key(job.origin),
                        self.keys.stats,
                        self.keys.job_sizes,
                    ],
                    [job.job_id, which],
                )
            finally:
                self._held.discard(job.job_id)
        return bool(res)

    def queue_lengths(self) -> dict[str, int]:
        p = self.client.pipeline(transaction=False)
        p.llen(rq_queue_key(self.keys.main_queue))
        p.llen(rq_queue_key(self.keys.retry_queue))
        main, retry = p.execute()
        return {"main": int(main), "retry": int(retry)}

    def outstanding_job_ids(self) -> dict[str, list[str]]:
        """Job ids per place: "main", "retry" and "wip:<worker>", read in one transaction
        (a job moving between places is seen in exactly one)."""
        places = {
            "main": rq_queue_key(self.keys.main_queue),
            "retry": rq_queue_key(self.keys.retry_queue),
        }
        # Wip lists by SCAN too: a worker reaped while alive holds jobs until its next
        # heartbeat registers it again (O(keys): only the recount and repair paths).
        # A per-run ACL user may not SCAN: then the registered workers are used alone.
        wids = set(self.worker_ids())
        prefix = self.keys.wip("")
        wids |= {key[len(prefix) :] for key in self._scan_names(prefix + "*")}
        for wid in sorted(wids):
            places[f"wip:{wid}"] = self.keys.wip(wid)
        p = self.client.pipeline(transaction=True)
        for key in places.values():
            p.lrange(key, 0, -1)
        lists = p.execute()
        return {name: [_s(j) for j in ids] for name, ids in zip(places, lists, strict=True)}

    def outstanding_samples(self) -> dict[str, str]:
        """sample id -> place ("main", "retry", "wip:<worker>") for every queued or held sample."""
        out: dict[str, str] = {}
        queues = (self.keys.main_queue, self.keys.retry_queue)
        for place, job_ids in self.outstanding_job_ids().items():
            for i in range(0, len(job_ids), 500):
                for job in self._fetch_jobs(job_ids[i : i + 500]):
                    parsed = None if job is None else _parse_job(job, queues)
                    for sid, _ in parsed.samples if parsed else []:
                        out[sid] = place
        return out

    def _fetch_jobs(self, job_ids: list[str]) -> list[Job | None]:
        """RQ's public bulk fetch; a damaged job hash (rq raises) reads as absent."""
        try:
            return Job.fetch_many(job_ids, connection=self.client, serializer=JSONSerializer)
        except redis.exceptions.RedisError:
            raise
        except Exception:  # one damaged job fails the batch: fetch one by one
            jobs: list[Job | None] = []
            for jid in job_ids:
                try:
                    jobs += Job.fetch_many([jid], connection=self.client, serializer=JSONSerializer)
                except redis.exceptions.RedisError:
                    raise
                except Exception:
                    jobs.append(None)
            return jobs

    # ------------------------------------------------------------------ workers
    def register(self, worker_id: str, info: dict[str, Any]) -> None:
        self.heartbeat(worker_id, info)

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> None:
        # SADD again: re-join if a reaper wrongly took us for dead. Fenced: a worker of a
        # purged run must not bring its keys back.
        flat = [x for kv in _flat(info).items() for x in kv]
        self._fenced(
            self._heartbeat,
            [self.keys.workers, self.keys.worker(worker_id)],
            [worker_id, HEARTBEAT_TTL_S, *flat],
        )

    def unregister(self, worker_id: str) -> None:
        p = self.client.pipeline()
        p.delete(self.keys.worker(worker_id))
        p.srem(self.keys.workers, worker_id)
        p.execute()

    def worker_ids(self) -> list[str]:
        return sorted(_s(w) for w in self.client.smembers(self.keys.workers))

    def worker_info(self, worker_id: str) -> dict[str, str]:
        raw = self.client.hgetall(self.keys.worker(worker_id))
        return {_s(k): _s(v) for k, v in raw.items()}

    def release_wip(self, worker_id: str) -> int:
        """Move every job a worker holds back to the front of the main queue."""
        n = 0
        k = self.keys
        keys = [k.wip(worker_id), rq_queue_key(k.main_queue), k.stats, k.config, k.job_sizes]
        with self._held_lock:
            while (jid := self._release_one(keys=keys)) is not None:
                self._held.discard(_s(jid))
                n += 1
        return n

    def reap(self) -> dict[str, int]:
        """Hand the jobs of workers whose heartbeat expired back to the queue front.

        One reaper at a time (a lock of REAP_LOCK_MS): every worker calls this every few
        seconds, and each pass reads every worker's heartbeat, so without the lock a
        thousand workers would send Redis a million EXISTS every pass interval."""
        if not self._reap_lock(keys=[self.keys.config, self.keys.reaper], args=[REAP_LOCK_MS]):
            return {}
        recovered: dict[str, int] = {}
        wids = self.worker_ids()
        p = self.client.pipeline(transaction=False)
        for wid in wids:
            p.exists(self.keys.worker(wid))
        for wid, alive in zip(wids, p.execute(), strict=True):
            if alive:
                continue
            # LMOVE is atomic per item: two reapers never move the same job twice.
            recovered[wid] = self.release_wip(wid)
            self.client.srem(self.keys.workers, wid)
        return recovered

    def nothing_outstanding(self) -> bool:
        """No queued job and no job held by any worker (live or dead)."""
        if any(self.queue_lengths().values()):
            return False
        return all(self.client.llen(self.keys.wip(w)) == 0 for w in self.worker_ids())

    # ------------------------------------------------------------------ run lifecycle
    @contextlib.contextmanager
    def enqueue_lock(self, holder: str) -> Iterator[None]:
        """Serialize `enqueue`/`recover` of one run: raises ConfigError if another holds it.
        The lock expires ENQUEUE_LOCK_TTL_S after its holder dies; a thread keeps it alive."""
        token = f"{holder}:{secrets.token_hex(4)}"
        with _redis_errors():
            if not self.client.set(self.keys.enqueue_lock, token, nx=True, ex=ENQUEUE_LOCK_TTL_S):
                other = self.client.get(self.keys.enqueue_lock)
                raise ConfigError(
                    f"another `hsq enqueue` or `hsq recover` of run {self.run!r} is running "
                    f"({_s(other or b'?')}); wait for it (the lock expires "
                    f"{ENQUEUE_LOCK_TTL_S} s after its holder dies)"
                )
        stop = threading.Event()

        def keep_alive() -> None:
            while not stop.wait(ENQUEUE_LOCK_TTL_S / 4):
                with contextlib.suppress(redis.exceptions.RedisError):
                    self._extend(keys=[self.keys.enqueue_lock], args=[token, ENQUEUE_LOCK_TTL_S])

        t = threading.Thread(target=keep_alive, name="enqueue-lock", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            with _redis_errors():
                self._unlock(keys=[self.keys.enqueue_lock], args=[token])

    def purge(self) -> int:
        """Delete every Redis key of a run (outputs on disk stay). Returns keys deleted.
        The config goes first: from then on every fenced write of a worker is refused."""
        k = self.keys
        n = int(self.client.delete(k.config))
        # wip lists by SCAN too: a worker that never registered (or was reaped) holds jobs.
        wips = set(self._scan_names(k.wip("*")))
        wips |= {k.wip(w) for w in self.worker_ids()}
        jobs = [j for ids in self.outstanding_job_ids().values() for j in ids]
        for wip in wips:
            jobs += [_s(j) for j in self.client.lrange(wip, 0, -1)]
        keys = [*k.all_static(), *wips]
        keys += self._scan_names(k.worker("*"))
        keys += [rq_job_key(j) for j in set(jobs)]
        for i in range(0, len(keys), 1000):
            n += int(self.client.delete(*keys[i : i + 1000]))
        self.client.srem(RUNS, self.run)
        return n

    def _scan_names(self, pattern: str) -> list[str]:
        """Key names matching `pattern` by SCAN; [] for a per-run ACL user, which may not
        SCAN (it would list every run's key names): the registered workers are used alone."""
        try:
            return [_s(key) for key in self.client.scan_iter(match=pattern, count=1000)]
        except redis.exceptions.NoPermissionError:
            return []


def _parse_job(job: Job, queues: tuple[str, ...]) -> ChunkJob | None:
    """A ChunkJob from RQ's public Job API; None if its arguments are not ours (untrusted)."""
    try:
        kw = job.kwargs
        samples = [(str(sid), IndexEntry.decode(str(e))) for sid, e in kw["samples"]]
        attempt = kw.get("attempt", 0)
        reason = kw.get("reason")
        if not isinstance(attempt, int) or not (reason is None or isinstance(reason, str)):
            return None
    except Exception:  # rq's deserialization or a damaged payload: several types
        return None
    origin = job.origin if job.origin in queues else queues[0]
    return ChunkJob(job.id, origin, samples, attempt, reason)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _flat(info: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}


def new_worker_id(name: str | None) -> str:
    base = name or socket.gethostname().split(".")[0]
    return f"{base}.{secrets.token_hex(3)}"


R_ = TypeVar("R_")


def chunked(items: Sequence[R_], size: int) -> Iterator[list[R_]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])
