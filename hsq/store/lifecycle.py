"""A run's lifecycle: the enqueue lock, an enqueue in progress, lost samples, purge."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator

import redis

from hsq.errors import ConfigError
from hsq.keys import rq_job_key
from hsq.store import scripts
from hsq.store.connection import redis_errors, scan_names, text, translate_public
from hsq.store.counters import stat_field, stat_fields
from hsq.store.fence import Aggregate, Fence
from hsq.store.queue import JobQueue
from hsq.store.workers import WorkerRegistry

ENQUEUE_LOCK_TTL_S = 60


@translate_public
class Lifecycle(Aggregate):
    def __init__(self, fence: Fence, queue: JobQueue, workers: WorkerRegistry) -> None:
        super().__init__(fence)
        self.queue = queue
        self.workers = workers
        reg = self.client.register_script
        self._forget_lost = reg(scripts.FORGET_LOST)
        self._unlock = reg(scripts.UNLOCK)
        self._extend = reg(scripts.EXTEND)

    @contextlib.contextmanager
    def enqueue_lock(self, holder: str) -> Iterator[None]:
        """Serialize `enqueue`/`recover` of one run: raises ConfigError if another holds it.
        The lock expires ENQUEUE_LOCK_TTL_S after its holder dies; a thread keeps it alive."""
        token = f"{holder}:{secrets.token_hex(4)}"
        key = self.keys.enqueue_lock
        with redis_errors():
            if not self.client.set(key, token, nx=True, ex=ENQUEUE_LOCK_TTL_S):
                other = self.client.get(key)
                raise ConfigError(
                    f"another `hsq enqueue` or `hsq recover` of run {self.run!r} is running "
                    f"({text(other or b'?')}); wait for it (the lock expires "
                    f"{ENQUEUE_LOCK_TTL_S} s after its holder dies)"
                )
        stop = threading.Event()

        def keep_alive() -> None:
            while not stop.wait(ENQUEUE_LOCK_TTL_S / 4):
                with contextlib.suppress(redis.exceptions.RedisError):
                    self._extend(keys=[key], args=[token, ENQUEUE_LOCK_TTL_S])

        t = threading.Thread(target=keep_alive, name="enqueue-lock", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            with redis_errors():
                self._unlock(keys=[key], args=[token])

    def begin_enqueue(self) -> bool:
        """Flag an enqueue in progress; True if the last one never finished (a crash between
        its index writes and its jobs: the next enqueue must then look at every job)."""
        p = self.client.pipeline(transaction=True)
        p.hget(self.keys.stats, stat_field("enqueuing"))
        p.hset(self.keys.stats, mapping=stat_fields(enqueuing=1))
        was, _ = p.execute()
        return was is not None

    def end_enqueue(self) -> None:
        """Everything of the dataset not done, dead or queued was enqueued: nothing is lost."""
        p = self.client.pipeline(transaction=True)
        p.hset(self.keys.stats, mapping=stat_fields(lost=0))
        p.hdel(self.keys.stats, stat_field("enqueuing"))
        p.execute()

    def set_lost(self, samples: int) -> None:
        """Record how many samples are in no queue (a recount found them, or they were
        all enqueued again: 0)."""
        self.client.hset(self.keys.stats, mapping=stat_fields(lost=max(0, samples)))

    def forget_lost(self, samples: int) -> None:
        """`samples` lost ones were enqueued again (the count never goes below 0)."""
        if samples:
            self._forget_lost(keys=[self.keys.stats], args=[samples])

    def purge(self) -> int:
        """Delete every Redis key of a run (outputs on disk stay). Returns keys deleted.
        The config goes first: from then on every fenced write of a worker is refused."""
        k = self.keys
        n = int(self.client.delete(k.config))
        # wip lists by SCAN too: a worker that never registered (or was reaped) holds jobs.
        wips = set(scan_names(self.client, k.wip("*")))
        wips |= {k.wip(w) for w in self.workers.worker_ids()}
        jobs = [j for ids in self.queue.outstanding_job_ids().values() for j in ids]
        for wip in wips:
            jobs += [text(j) for j in self.client.lrange(wip, 0, -1)]
        keys = [*k.all_static(), *wips]
        keys += scan_names(self.client, k.worker("*"))
        keys += [rq_job_key(j) for j in set(jobs)]
        for i in range(0, len(keys), 1000):
            n += int(self.client.delete(*keys[i : i + 1000]))
        return n
