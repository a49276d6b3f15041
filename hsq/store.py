"""All of hsq's Redis traffic for one run. Keys come from hsq.keys, jobs are RQ jobs.

RQ provides the queue format (JSON-serialized jobs in `rq:queue:*` lists, visible to `rq info`)
and enqueueing. hsq's worker dequeues on its own with the reliable-queue pattern (LMOVE into a
per-worker wip list) because RQ's own worker brings back a SIGKILLed job only after
timeout + 60 s + up to 600 s and spends about 52 Redis commands per job. A job is a chunk of
sample ids, so queue overhead is paid once per chunk; each sample costs one script call when
it is done.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from hsq.dataset import IndexEntry
from hsq.errors import ConfigError, StoreError
from hsq.keys import RUNS, RunKeys, rq_job_key, rq_queue_key
from hsq.outputs import ManifestEntry
from hsq.runconfig import RunConfig

JOB_FUNC = "workers.jobs.extract_chunk"
HEARTBEAT_TTL_S = 10
SampleRef = tuple[str, IndexEntry]

# Un-marks a sample (verify --requeue) and takes it out of the totals, exactly once.
_UNDO_DONE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'tokens', -tonumber(ARGV[2]))
  redis.call('HINCRBY', KEYS[2], 'bytes', -tonumber(ARGV[3]))
  return 1
end
return 0
"""

# Ownership-checked job moves: act only if the job is still in this worker's wip list.
_FINISH = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
"""
_GIVE_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# Marks a sample done exactly once and keeps the run's totals in step with the done hash.
_MARK_DONE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[2], 'bytes', ARGV[4])
  return 1
end
return 0
"""


def connect(url: str) -> redis.Redis:
    """A client from a URL (auth and db come from it); retries transient connection errors."""
    try:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=5,
            socket_timeout=30,
            health_check_interval=15,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 5),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
        client.ping()
    except redis.exceptions.AuthenticationError as exc:
        raise StoreError(f"Redis refused the credentials in the URL: {exc}") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise StoreError(f"cannot reach Redis at {_redact(url)}: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {_redact(url)}: {exc}") from exc
    return client


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


@dataclass(frozen=True)
class ChunkJob:
    """A claimed job: which queue it came from and what it holds."""

    job_id: str
    origin: str
    samples: list[SampleRef]
    attempt: int
    reason: str | None


def _job_kwargs(run: str, samples: Iterable[SampleRef], attempt: int, reason: str | None) -> dict:  # type: ignore[type-arg]
    return {
        "run": run,
        "samples": [[sid, e.encode()] for sid, e in samples],
        "attempt": attempt,
        "reason": reason,
    }


class RunStore:
    def __init__(self, client: redis.Redis, run: str) -> None:
        self.r = client
        self.run = run
        try:
            self.k = RunKeys(run)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._mark_done = client.register_script(_MARK_DONE)
        self._undo_done = client.register_script(_UNDO_DONE)
        self._finish = client.register_script(_FINISH)
        self._give_back = client.register_script(_GIVE_BACK)
        self._queues = {
            name: Queue(name, connection=client, serializer=JSONSerializer)
            for name in (self.k.main_queue, self.k.retry_queue)
        }

    # ------------------------------------------------------------------ config and index
    def load_config(self) -> RunConfig | None:
        raw = self.r.hgetall(self.k.config)
        return RunConfig.from_redis(raw) if raw else None  # type: ignore[arg-type]

    def require_config(self) -> RunConfig:
        cfg = self.load_config()
        if cfg is None:
            raise ConfigError(f"run {self.run!r} does not exist (run `hsq enqueue` first)")
        return cfg

    def save_config(self, cfg: RunConfig) -> None:
        p = self.r.pipeline()
        p.hset(self.k.config, mapping=cfg.to_redis())  # type: ignore[arg-type]
        p.sadd(RUNS, self.run)
        p.execute()

    def pin_model(self, model_id: str, layer_ids: list[int]) -> tuple[str, list[int]]:
        """Record the model and layers of the first valid dump (atomic HSETNX); return the
        recorded ones, so a worker behind a different model sees the mismatch."""
        p = self.r.pipeline()
        p.hsetnx(self.k.config, "model_id", json.dumps(model_id))
        p.hsetnx(self.k.config, "layer_ids", json.dumps(layer_ids))
        p.execute()
        cfg = self.require_config()
        assert cfg.model_id is not None and cfg.layer_ids is not None
        return cfg.model_id, cfg.layer_ids

    def put_index(self, entries: Iterable[tuple[str, IndexEntry]], batch: int = 5000) -> int:
        n = 0
        buf: dict[str, str] = {}
        for sid, e in entries:
            buf[sid] = e.encode()
            if len(buf) >= batch:
                self.r.hset(self.k.index, mapping=buf)  # type: ignore[arg-type]
                n += len(buf)
                buf = {}
        if buf:
            self.r.hset(self.k.index, mapping=buf)  # type: ignore[arg-type]
            n += len(buf)
        return n

    def set_totals(self, *, samples: int, tokens: int, invalid_lines: int) -> None:
        self.r.hset(
            self.k.stats,
            mapping={
                "total_samples": samples,
                "total_tokens": tokens,
                "invalid_lines": invalid_lines,
            },
        )

    def stats(self) -> dict[str, int]:
        return {_s(k): int(v) for k, v in self.r.hgetall(self.k.stats).items()}

    def get_index(self, ids: list[str]) -> dict[str, IndexEntry]:
        if not ids:
            return {}
        vals = self.r.hmget(self.k.index, ids)
        return {sid: IndexEntry.decode(v) for sid, v in zip(ids, vals, strict=True) if v}

    def iter_hash_keys(self, key: str) -> Iterator[str]:
        # HSCAN NOVALUES needs Redis 7.4; values are small here.
        for field, _ in self.r.hscan_iter(key, count=10000):
            yield _s(field)

    def count(self, key: str) -> int:
        return int(self.r.hlen(key))

    # ------------------------------------------------------------------ done and dead
    def done_among(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        vals = self.r.hmget(self.k.done, ids)
        return {sid for sid, v in zip(ids, vals, strict=True) if v is not None}

    def mark_done(self, sample_id: str, entry: ManifestEntry) -> bool:
        """True if this call made the sample done; False if it already was."""
        res = self._mark_done(
            keys=[self.k.done, self.k.stats],
            args=[sample_id, entry.to_json(), entry.num_tokens, entry.bytes],
        )
        return bool(res)

    def undo_done(self, sample_id: str, entry: ManifestEntry) -> bool:
        res = self._undo_done(
            keys=[self.k.done, self.k.stats], args=[sample_id, entry.num_tokens, entry.bytes]
        )
        return bool(res)

    def iter_manifest(self) -> Iterator[tuple[str, ManifestEntry | None]]:
        """Every done sample with its manifest entry (HSCAN: no one huge reply); None for
        an entry that does not parse (Redis is untrusted)."""
        for field, raw in self.r.hscan_iter(self.k.done, count=1000):
            try:
                entry: ManifestEntry | None = ManifestEntry.from_json(raw)
            except (ValueError, TypeError):
                entry = None
            yield _s(field), entry

    def get_manifest(self, sample_id: str) -> ManifestEntry | None:
        raw = self.r.hget(self.k.done, sample_id)
        return ManifestEntry.from_json(raw) if raw else None

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
        self.r.hset(self.k.dead, sample_id, json.dumps(entry))

    def dead_entries(self) -> dict[str, dict[str, Any]]:
        return {_s(k): json.loads(v) for k, v in self.r.hgetall(self.k.dead).items()}

    def record_crash(self, sample_id: str) -> int:
        return int(self.r.hincrby(self.k.crashes, sample_id, 1))

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
        """Enqueue chunk jobs (RQ, JSON serializer); returns the number of samples."""
        q = self._queues[self.k.retry_queue if retry else self.k.main_queue]
        n = 0
        datas = []
        for chunk in chunks:
            job_id = f"hsq-{self.run}-{secrets.token_hex(8)}"
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
                q.enqueue_many(datas)
                datas = []
        if datas:
            q.enqueue_many(datas)
        return n

    def claim(self, worker_id: str, timeout: float) -> ChunkJob | None:
        """Move one job into this worker's wip list: retries first, then the main queue."""
        wip = self.k.wip(worker_id)
        job_id = self.r.lmove(rq_queue_key(self.k.retry_queue), wip, "LEFT", "RIGHT")
        origin = self.k.retry_queue
        if job_id is None:
            origin = self.k.main_queue
            # BLMOVE: the job is never only in flight; a crash leaves it in our wip list.
            job_id = self.r.blmove(
                rq_queue_key(origin), wip, max(1, round(timeout)), "LEFT", "RIGHT"
            )
        if job_id is None:
            return None
        jid = _s(job_id)
        try:
            job = Job.fetch(jid, connection=self.r, serializer=JSONSerializer)
        except Exception as exc:  # rq raises NoSuchJobError or a deserialization error
            # A job hash lost or unreadable: drop the id; `requeue --missing` finds its samples.
            self.r.lrem(wip, 1, jid)
            raise StoreError(
                f"job {jid} unreadable ({exc}); its samples are found by `hsq requeue --missing`"
            ) from exc
        kw = job.kwargs
        samples = [(str(sid), IndexEntry.decode(e)) for sid, e in kw["samples"]]
        return ChunkJob(jid, origin, samples, int(kw.get("attempt", 0)), kw.get("reason"))

    def finish(self, worker_id: str, job: ChunkJob) -> bool:
        """Drop a finished job. Only while we still hold it: a reaper may have handed it to
        another worker while we were cut off, and its hash must then stay."""
        res = self._finish(keys=[self.k.wip(worker_id), rq_job_key(job.job_id)], args=[job.job_id])
        return bool(res)

    def give_back(self, worker_id: str, job: ChunkJob) -> bool:
        """Put a job back at the front of its queue, untouched (not the sample's fault);
        only while we still hold it, so a reaped job is never queued twice."""
        res = self._give_back(
            keys=[self.k.wip(worker_id), rq_queue_key(job.origin)], args=[job.job_id]
        )
        return bool(res)

    def queue_lengths(self) -> dict[str, int]:
        p = self.r.pipeline(transaction=False)
        p.llen(rq_queue_key(self.k.main_queue))
        p.llen(rq_queue_key(self.k.retry_queue))
        main, retry = p.execute()
        return {"main": int(main), "retry": int(retry)}

    def outstanding_job_ids(self) -> dict[str, list[str]]:
        """Job ids per place: "main", "retry" and "wip:<worker>"."""
        places = {
            "main": rq_queue_key(self.k.main_queue),
            "retry": rq_queue_key(self.k.retry_queue),
        }
        for wid in self.worker_ids():
            places[f"wip:{wid}"] = self.k.wip(wid)
        return {
            name: [j.decode() for j in self.r.lrange(key, 0, -1)]  # type: ignore[union-attr]
            for name, key in places.items()
        }

    def outstanding_samples(self) -> dict[str, str]:
        """sample id -> place ("main", "retry", "wip:<worker>") for every queued or held sample."""
        out: dict[str, str] = {}
        for place, job_ids in self.outstanding_job_ids().items():
            for i in range(0, len(job_ids), 500):
                batch = job_ids[i : i + 500]
                p = self.r.pipeline(transaction=False)
                for jid in batch:
                    p.hget(rq_job_key(jid), "data")
                for data in p.execute():
                    for sid in _job_sample_ids(data):
                        out[sid] = place
        return out

    # ------------------------------------------------------------------ workers
    def register(self, worker_id: str, info: dict[str, Any]) -> None:
        p = self.r.pipeline()
        p.sadd(self.k.workers, worker_id)
        p.hset(self.k.worker(worker_id), mapping=_flat(info))
        p.expire(self.k.worker(worker_id), HEARTBEAT_TTL_S)
        p.execute()

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> None:
        p = self.r.pipeline(transaction=False)
        p.sadd(self.k.workers, worker_id)  # re-join if a reaper wrongly took us for dead
        p.hset(self.k.worker(worker_id), mapping=_flat(info))
        p.expire(self.k.worker(worker_id), HEARTBEAT_TTL_S)
        p.execute()

    def unregister(self, worker_id: str) -> None:
        p = self.r.pipeline()
        p.delete(self.k.worker(worker_id))
        p.srem(self.k.workers, worker_id)
        p.execute()

    def worker_ids(self) -> list[str]:
        return sorted(w.decode() for w in self.r.smembers(self.k.workers))  # type: ignore[union-attr]

    def worker_info(self, worker_id: str) -> dict[str, str]:
        raw = self.r.hgetall(self.k.worker(worker_id))
        return {k.decode(): v.decode() for k, v in raw.items()}  # type: ignore[union-attr]

    def release_wip(self, worker_id: str) -> int:
        """Move every job a worker holds back to the front of the main queue."""
        n = 0
        main = rq_queue_key(self.k.main_queue)
        while self.r.lmove(self.k.wip(worker_id), main, "RIGHT", "LEFT") is not None:
            n += 1
        return n

    def reap(self) -> dict[str, int]:
        """Hand the jobs of workers whose heartbeat expired back to the queue front."""
        recovered: dict[str, int] = {}
        for wid in self.worker_ids():
            if self.r.exists(self.k.worker(wid)):
                continue
            # LMOVE is atomic per item: two reapers never move the same job twice.
            recovered[wid] = self.release_wip(wid)
            self.r.srem(self.k.workers, wid)
        return recovered

    def nothing_outstanding(self) -> bool:
        """No queued job and no job held by any worker (live or dead)."""
        if any(self.queue_lengths().values()):
            return False
        return all(self.r.llen(self.k.wip(w)) == 0 for w in self.worker_ids())


def _job_sample_ids(data: bytes | None) -> list[str]:
    """Sample ids from an RQ job's `data` field (zlib-compressed JSON [func, inst, args,
    kwargs] with the JSON serializer), read without building a Job: status and requeue scan
    every queued job."""
    if not data:
        return []  # the job hash vanished: it holds nothing (`requeue --missing` covers it)
    try:
        # RQ stores it uncompressed when compression did not help.
        with contextlib.suppress(zlib.error):
            data = zlib.decompress(data)
        kwargs = json.loads(data)[3]
        return [str(sid) for sid, _ in kwargs.get("samples", [])]
    except (ValueError, TypeError, IndexError, KeyError, AttributeError):
        return []  # a damaged job holds nothing we can trust


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _flat(info: dict[str, Any]) -> dict[Any, Any]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}


def new_worker_id(name: str | None) -> str:
    base = name or socket.gethostname().split(".")[0]
    return f"{base}.{secrets.token_hex(3)}"


def chunked(items: list[SampleRef], size: int) -> Iterator[list[SampleRef]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
