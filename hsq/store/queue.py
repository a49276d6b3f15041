"""The queues: enqueue (RQ's format), claim, finish, give back, and reaping dead workers.

hsq's worker dequeues on its own with the reliable-queue pattern (LMOVE into a per-worker
wip list) because RQ's own worker brings back a SIGKILLed job only after timeout + 60 s + up
to 600 s and spends about 52 Redis commands per job. Which of a worker's wip jobs it knows
about is the worker's own bookkeeping (hsq/workers/claims.py), not the store's.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from hsq.errors import RunChangedError, StoreError
from hsq.keys import RQ_QUEUES, rq_job_key, rq_queue_key
from hsq.store import scripts
from hsq.store.connection import (
    NoPermissionError,
    WatchError,
    scan_names,
    text,
    translate_public,
)
from hsq.store.counters import stat_field
from hsq.store.fence import Aggregate, Fence
from hsq.store.jobs import JOB_FUNC, AnyRef, ChunkJob, fetch_jobs, job_kwargs, job_size, parse_job
from hsq.store.workers import WorkerRegistry

REAP_LOCK_MS = 1000


@translate_public
class JobQueue(Aggregate):
    def __init__(self, fence: Fence, workers: WorkerRegistry) -> None:
        super().__init__(fence)
        self.workers = workers
        reg = self.client.register_script
        self._claim = reg(scripts.CLAIM)
        self._finish = reg(scripts.FINISH)
        self._give_back = reg(scripts.GIVE_BACK)
        self._release_one = reg(scripts.RELEASE_ONE)
        self._outstanding = reg(scripts.OUTSTANDING)
        self._reap_lock = reg(scripts.REAP_LOCK)
        self._dead_remove = reg(scripts.DEAD_REMOVE)
        self._queues = {
            name: Queue(name, connection=self.client, serializer=JSONSerializer)
            for name in (self.keys.main_queue, self.keys.retry_queue)
        }
        for q in self._queues.values():
            # RQ adds its queue to its registry on every enqueue, in our transaction: into
            # the run's own set, so a run's user needs no write to the shared `rq:queues`.
            q.redis_queues_keys = self.keys.rq_registry
        self._in_rq_registry = False

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
                    kwargs=job_kwargs(self.run, chunk, attempt, reason),
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
        if n:
            self._register_for_rq()
        return n

    def _register_for_rq(self) -> None:
        """Put the run's queues in RQ's shared registry (`rq info` lists it) where this
        user may write it; a run's own ACL user may not (keys.py), and is not told twice."""
        if self._in_rq_registry:
            return
        self._in_rq_registry = True
        queues = [rq_queue_key(name) for name in self._queues]
        with contextlib.suppress(NoPermissionError):
            self.client.sadd(RQ_QUEUES, *queues)

    def _enqueue_fenced(
        self, q: Queue, datas: list[Any], samples: int, which: str, cleared: list[str]
    ) -> None:
        # RQ writes the job hash and the queue entry; WATCH makes that conditional on the
        # config (and so the generation) staying as we read it. Another config change
        # (a model pin) only makes us try again.
        gen = self.fence.token()
        k = self.keys
        if cleared:  # loads the script if Redis does not have it yet (a no-op call)
            self._dead_remove(keys=[k.dead, k.dead_reasons], args=[])
        for _ in range(100):
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(k.config)  # type: ignore[no-untyped-call]
                    if pipe.hget(k.config, "generation") != gen.encode():
                        raise RunChangedError(
                            f"run {self.run!r} was purged or re-created; nothing enqueued"
                        )
                    pipe.multi()
                    q.enqueue_many(datas, pipeline=pipe)
                    # The queue's counters move in the same transaction as its jobs.
                    pipe.hincrby(k.stats, stat_field(f"{which}_samples"), samples)
                    pipe.hincrby(k.stats, stat_field(f"{which}_jobs"), len(datas))
                    if cleared:
                        # EVALSHA queued in the MULTI (the script was loaded above).
                        pipe.evalsha(self._dead_remove.sha, 2, k.dead, k.dead_reasons, *cleared)
                        pipe.hdel(k.crashes, *cleared)
                    pipe.execute()
                    return
                except WatchError:
                    continue
        raise StoreError("the run's config kept changing while enqueueing; try again")

    def claim(self, worker_id: str, timeout: float) -> ChunkJob | None:
        """Move one job into this worker's wip list: retries first, then the main queue
        (waiting up to `timeout` seconds, at least 1, for one; not at all if `timeout` <= 0)."""
        wip = self.keys.wip(worker_id)
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
        return self.load_held(worker_id, job_id)

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
        return None if not res else text(res[0])

    def held_job_ids(self, worker_id: str) -> list[str]:
        """The job ids in a worker's wip list, oldest first."""
        return [text(j) for j in self.client.lrange(self.keys.wip(worker_id), 0, -1)]

    def load_held(self, worker_id: str, job_id: str) -> ChunkJob:
        """A job of the worker's wip list, read back. A job hash lost or unreadable: its id
        is dropped and its samples count as lost (`requeue --missing` finds them)."""
        wip = self.keys.wip(worker_id)
        job = Job.fetch_many([job_id], connection=self.client, serializer=JSONSerializer)[0]
        queues = (self.keys.main_queue, self.keys.retry_queue)
        parsed = None if job is None else parse_job(job, queues)
        if parsed is None:
            p = self.client.pipeline(transaction=True)
            p.lrem(wip, 1, job_id)
            p.hincrby(self.keys.stats, stat_field("lost"), job_size(job_id) or 1)
            p.execute()
            raise StoreError(
                f"job {job_id} unreadable; its samples are found by `hsq requeue --missing`"
            )
        return parsed

    def finish(self, worker_id: str, job: ChunkJob) -> bool:
        """Drop a finished job. Only while we still hold it: a reaper may have handed it to
        another worker while we were cut off, and its hash must then stay."""
        keys = [self.keys.wip(worker_id), rq_job_key(job.job_id)]
        return bool(self.fence.count(self._finish, keys, [job.job_id]))

    def give_back(self, worker_id: str, job: ChunkJob) -> bool:
        """Put a job back at the front of its queue, untouched (not the sample's fault);
        only while we still hold it, so a reaped job is never queued twice."""
        which = "retry" if job.origin == self.keys.retry_queue else "main"
        keys = [
            self.keys.wip(worker_id),
            rq_queue_key(job.origin),
            self.keys.stats,
            self.keys.job_sizes,
        ]
        return bool(self.fence.count(self._give_back, keys, [job.job_id, which]))

    on_released: Callable[[list[str]], object] | None = None
    """Told the samples of the jobs release_wip moved back (the store's spool releases
    their byte reservations: a dead worker's in-flight samples must not hold a streamed
    run's spool, where the worker that claims their jobs next may wait for room first)."""

    def release_wip(self, worker_id: str) -> int:
        """Move every job a worker holds back to the front of the main queue."""
        moved: list[str] = []
        k = self.keys
        keys = [k.wip(worker_id), rq_queue_key(k.main_queue), k.stats, k.config, k.job_sizes]
        while (job_id := self._release_one(keys=keys)) is not None:
            moved.append(text(job_id))
        if moved and self.on_released is not None:
            queues = (k.main_queue, k.retry_queue)
            samples = [
                sid
                for job in fetch_jobs(self.client, moved)
                if job is not None and (parsed := parse_job(job, queues)) is not None
                for sid, _ in parsed.samples
            ]
            self.on_released(samples)
        return len(moved)

    def reap(self) -> dict[str, int]:
        """Hand the jobs of workers whose heartbeat expired back to the queue front.

        One reaper at a time (a lock of REAP_LOCK_MS): every worker calls this every few
        seconds, and each pass reads every worker's heartbeat, so without the lock a
        thousand workers would send Redis a million EXISTS every pass interval."""
        if not self._reap_lock(keys=[self.keys.config, self.keys.reaper], args=[REAP_LOCK_MS]):
            return {}
        recovered: dict[str, int] = {}
        wids = self.workers.worker_ids()
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

    def queue_lengths(self) -> dict[str, int]:
        p = self.client.pipeline(transaction=False)
        p.llen(rq_queue_key(self.keys.main_queue))
        p.llen(rq_queue_key(self.keys.retry_queue))
        main, retry = p.execute()
        return {"main": int(main), "retry": int(retry)}

    def nothing_outstanding(self) -> bool:
        """No queued job and no job held by any worker (live or dead), read in one step."""
        k = self.keys
        queues = [rq_queue_key(k.main_queue), rq_queue_key(k.retry_queue), k.workers]
        return int(self._outstanding(keys=queues, args=[k.wip("")])) == 0

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
        wids = set(self.workers.worker_ids())
        prefix = self.keys.wip("")
        wids |= {key[len(prefix) :] for key in scan_names(self.client, prefix + "*")}
        for wid in sorted(wids):
            places[f"wip:{wid}"] = self.keys.wip(wid)
        p = self.client.pipeline(transaction=True)
        for key in places.values():
            p.lrange(key, 0, -1)
        lists = p.execute()
        return {name: [text(j) for j in ids] for name, ids in zip(places, lists, strict=True)}

    def outstanding_samples(self) -> dict[str, str]:
        """sample id -> place ("main", "retry", "wip:<worker>") for every queued or held sample."""
        out: dict[str, str] = {}
        queues = (self.keys.main_queue, self.keys.retry_queue)
        for place, job_ids in self.outstanding_job_ids().items():
            for i in range(0, len(job_ids), 500):
                for job in fetch_jobs(self.client, job_ids[i : i + 500]):
                    parsed = None if job is None else parse_job(job, queues)
                    for sid, _ in parsed.samples if parsed else []:
                        out[sid] = place
        return out
