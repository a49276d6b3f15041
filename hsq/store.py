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
chunk of sample ids, so queue overhead is paid once per chunk; each sample costs one script
call when it is done.

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
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
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
from hsq.errors import ConfigError, RunChangedError, StoreError, StoreUnavailableError
from hsq.keys import RUNS, RunKeys, rq_job_key, rq_queue_key
from hsq.outputs import ManifestEntry
from hsq.redisurl import check_url, scrub
from hsq.redisurl import redact as redact  # re-exported: callers and tests use hsq.store.redact
from hsq.runconfig import RunConfig

JOB_FUNC = "hsq.workers.jobs.extract_chunk"
HEARTBEAT_TTL_S = 10
ENQUEUE_LOCK_TTL_S = 60
MAX_DEAD_ENTRY = 64 * 1024
SampleRef = tuple[str, IndexEntry]
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
_GIVE_BACK = _fenced_once(
    "redis.call('LREM', KEYS[2], 1, ARGV[2])", "  redis.call('LPUSH', KEYS[3], ARGV[2])"
)
# Marks a sample done exactly once and keeps the run's totals in step with the done hash.
_MARK_DONE = _fenced_once(
    "redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3])",
    "  redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[4])\n"
    "  redis.call('HINCRBY', KEYS[3], 'bytes', ARGV[5])",
)

_HSET = _FENCE + "redis.call('HSET', KEYS[2], ARGV[2], ARGV[3]) return 1"
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

# Creates a run's config if there is none (one enqueue wins); 0 if it exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SADD', KEYS[2], ARGV[1])
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


def _job_kwargs(
    run: str, samples: Iterable[SampleRef], attempt: int, reason: str | None
) -> dict[str, Any]:
    return {
        "run": run,
        "samples": [[sid, e.encode()] for sid, e in samples],
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
        self._mark_done = reg(_MARK_DONE)
        self._undo_done = reg(_UNDO_DONE)
        self._finish = reg(_FINISH)
        self._give_back = reg(_GIVE_BACK)
        self._hset = reg(_HSET)
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
        created = bool(self._create(keys=[self.keys.config, RUNS], args=[self.run, *flat]))
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
        res = int(script(keys=[self.keys.config, *keys], args=[self._fence_args(), *args]))
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

    def put_index(self, entries: Iterable[tuple[str, IndexEntry]], batch: int = 5000) -> int:
        n = 0
        buf: dict[str, str] = {}
        for sid, e in entries:
            buf[sid] = e.encode()
            if len(buf) >= batch:
                self.client.hset(self.keys.index, mapping=buf)  # type: ignore[arg-type]
                n += len(buf)
                buf = {}
        if buf:
            self.client.hset(self.keys.index, mapping=buf)  # type: ignore[arg-type]
            n += len(buf)
        return n

    def delete_fields(self, key: str, fields: Iterable[str], batch: int = 5000) -> int:
        """HDEL in batches (pruning the index and the dead letter)."""
        items = list(fields)
        n = 0
        for i in range(0, len(items), batch):
            n += int(self.client.hdel(key, *items[i : i + batch]))
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
            yield _s(field), value

    def count(self, key: str) -> int:
        return int(self.client.hlen(key))

    def snapshot(self) -> Snapshot:
        k = self.keys
        p = self.client.pipeline(transaction=False)
        p.hlen(k.index)
        p.hlen(k.done)
        p.hlen(k.dead)
        p.llen(rq_queue_key(k.main_queue))
        p.llen(rq_queue_key(k.retry_queue))
        p.hgetall(k.stats)
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

    # ------------------------------------------------------------------ done and dead
    def done_among(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        vals = self.client.hmget(self.keys.done, ids)
        return {sid for sid, v in zip(ids, vals, strict=True) if v is not None}

    def mark_done(self, sample_id: str, entry: ManifestEntry) -> bool:
        """True if this call made the sample done; False if it already was."""
        res = self._fenced(
            self._mark_done,
            [self.keys.done, self.keys.stats],
            [sample_id, entry.to_json(), entry.num_tokens, entry.bytes],
        )
        return bool(res)

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
                entry: ManifestEntry | None = ManifestEntry.from_json(raw)
            except (ValueError, TypeError):
                entry = None
            yield _s(field), entry

    def get_manifest(self, sample_id: str) -> ManifestEntry | None:
        raw = self.client.hget(self.keys.done, sample_id)
        if not raw:
            return None
        try:
            return ManifestEntry.from_json(raw)
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
        self._fenced(self._hset, [self.keys.dead], [sample_id, json.dumps(entry)])

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
        p = self.client.pipeline(transaction=False)
        for sid in ids:
            p.hdel(self.keys.dead, sid)
            p.hdel(self.keys.crashes, sid)
        p.execute()

    def record_crash(self, sample_id: str) -> int:
        return self._fenced(self._hincr, [self.keys.crashes], [sample_id])

    # ------------------------------------------------------------------ queues
    def enqueue(
        self,
        chunks: Iterable[list[SampleRef]],
        *,
        retry: bool = False,
        attempt: int = 0,
        reason: str | None = None,
        batch: int = 200,
    ) -> int:
        """Enqueue chunk jobs (RQ, JSON serializer), fenced on the run's generation; returns
        the number of samples."""
        q = self._queues[self.keys.retry_queue if retry else self.keys.main_queue]
        n = 0
        datas = []
        for chunk in chunks:
            job_id = self.keys.job_id(secrets.token_hex(8))
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
            if len(datas) >= batch:
                self._enqueue_fenced(q, datas)
                datas = []
        if datas:
            self._enqueue_fenced(q, datas)
        return n

    def _enqueue_fenced(self, q: Queue, datas: list[Any]) -> None:
        # RQ writes the job hash and the queue entry; WATCH makes that conditional on the
        # config (and so the generation) staying as we read it. Another config change
        # (a model pin) only makes us try again.
        gen = self._fence_args()
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
                    pipe.execute()
                    return
                except redis.exceptions.WatchError:
                    continue
        raise StoreError("the run's config kept changing while enqueueing; try again")

    def claim(self, worker_id: str, timeout: float) -> ChunkJob | None:
        """Move one job into this worker's wip list: retries first, then the main queue.

        A job already in our wip list that this store did not hand out is returned first:
        that is what a lost BLMOVE reply leaves behind (redis-py retries the command, and
        the first move's job sits in wip unknown to us)."""
        wip = self.keys.wip(worker_id)
        stray = self._stray(wip)
        if stray is not None:
            return stray
        job_id = self.client.lmove(rq_queue_key(self.keys.retry_queue), wip, "LEFT", "RIGHT")
        if job_id is None:
            # BLMOVE: the job is never only in flight; a crash leaves it in our wip list.
            job_id = self.client.blmove(
                rq_queue_key(self.keys.main_queue), wip, max(1, round(timeout)), "LEFT", "RIGHT"
            )
        if job_id is None:
            return None
        return self._load_job(wip, _s(job_id))

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
            # A job hash lost or unreadable: drop the id; `requeue --missing` finds its samples.
            self.client.lrem(wip, 1, jid)
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
                res = self._fenced(
                    self._give_back,
                    [self.keys.wip(worker_id), rq_queue_key(job.origin)],
                    [job.job_id],
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
        """Job ids per place: "main", "retry" and "wip:<worker>"."""
        places = {
            "main": rq_queue_key(self.keys.main_queue),
            "retry": rq_queue_key(self.keys.retry_queue),
        }
        for wid in self.worker_ids():
            places[f"wip:{wid}"] = self.keys.wip(wid)
        return {
            name: [_s(j) for j in self.client.lrange(key, 0, -1)] for name, key in places.items()
        }

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
        main = rq_queue_key(self.keys.main_queue)
        with self._held_lock:
            while (
                jid := self.client.lmove(self.keys.wip(worker_id), main, "RIGHT", "LEFT")
            ) is not None:
                self._held.discard(_s(jid))
                n += 1
        return n

    def reap(self) -> dict[str, int]:
        """Hand the jobs of workers whose heartbeat expired back to the queue front."""
        recovered: dict[str, int] = {}
        for wid in self.worker_ids():
            if self.client.exists(self.keys.worker(wid)):
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


def chunked(items: list[SampleRef], size: int) -> Iterator[list[SampleRef]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
