"""An in-memory store for unit tests of pure logic (as dramatiq ships StubBroker): it
satisfies WorkerStore (hsq/store/roles.py) with the real store's semantics where a worker
can tell: fencing on the run's generation, retries claimed first, finish and give-back
only of a held job, done and dead disjoint, marks idempotent. Integration tests use the
real store on a real redis-server.

A MemoryRun is what Redis would hold for one run; each MemoryStore on it is one client
with its own fence, so a test can purge or re-create the run through one store (the
operator's) while a worker writes through another, as in production:

    run = MemoryRun[ManifestEntry]()
    operator, worker = MemoryStore(run), MemoryStore(run)
    operator.create_config(cfg)
    operator.enqueue([refs])

The stats hash is the same typed record as the real store's (RunStats): the totals and
lost samples as written, the done samples' tokens and bytes as marked (`totals` gives an
entry's, as the real store's codec does), the queue counters counted from the queues.

Not modelled: heartbeats expiring (reap finds no dead worker), the dataset index, a streamed
run's consumers (the stream is a list of ids).
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from hsq.dataset.jsonl import IndexEntry
from hsq.errors import RunChangedError
from hsq.keys import RunKeys
from hsq.runconfig import RunConfig
from hsq.store import scripts
from hsq.store.config import required
from hsq.store.counters import RunStats
from hsq.store.jobs import AnyRef, ChunkJob, SampleRef
from hsq.store.ledger import dead_entry
from hsq.store.spool import SampleOverBudget

E = TypeVar("E")
PINS = ("model_id", "layer_ids", "dump_dtype", "hidden_size")


@dataclass
class MemoryRun(Generic[E]):
    name: str = "r"
    cfg: RunConfig | None = None
    main: deque[ChunkJob] = field(default_factory=deque)
    retry: deque[ChunkJob] = field(default_factory=deque)
    wip: dict[str, list[ChunkJob]] = field(default_factory=dict)
    done: dict[str, E] = field(default_factory=dict)
    dead: dict[str, dict[str, Any]] = field(default_factory=dict)
    crashes: Counter[str] = field(default_factory=Counter)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: RunStats = field(default_factory=RunStats)
    """The fields written (totals, lost) or moved by marks (tokens, bytes); the queue
    counters are counted when read."""
    spool: dict[str, int] = field(default_factory=dict)
    """A streamed run's reservations (the real store's spool hash)."""
    published: list[str] = field(default_factory=list)
    """A streamed run's stream: a sample id per done mark."""
    changed: threading.Condition = field(default_factory=threading.Condition)
    """Held while reading or writing any of the above; notified when a job is queued or the
    run is purged."""

    def clear(self) -> None:
        """What a purge leaves: nothing."""
        self.cfg = None
        for part in (self.main, self.retry, self.wip, self.done, self.dead, self.crashes):
            part.clear()
        self.spool.clear()
        self.published.clear()
        self.workers.clear()
        self.stats = RunStats()


class MemoryStore(Generic[E]):
    def __init__(
        self,
        run: MemoryRun[E] | None = None,
        totals: Callable[[E], tuple[int, int]] = lambda _e: (0, 0),
    ) -> None:
        """`totals`: the (tokens, bytes) a done entry adds to the run's (DoneCodec.totals)."""
        self.totals = totals
        self.state: MemoryRun[E] = run if run is not None else MemoryRun()
        self.run = self.state.name
        self.keys = RunKeys(self.run)
        self._generation: str | None = None  # what this client read, as the real fence
        self._lock = self.state.changed

    # ------------------------------------------------------------------ for assertions
    @property
    def cfg(self) -> RunConfig | None:
        return self.state.cfg

    @property
    def done(self) -> Mapping[str, E]:
        return self.state.done

    @property
    def dead(self) -> Mapping[str, dict[str, Any]]:
        return self.state.dead

    @property
    def held(self) -> dict[str, ChunkJob]:
        """Every job in a worker's wip list, by id."""
        with self._lock:
            return {j.job_id: j for jobs in self.state.wip.values() for j in jobs}

    # ------------------------------------------------------------------ the fence
    def _fence(self) -> None:
        """Called holding the lock: refuse a write to a run purged or re-created since
        this client read its config (reading it first if it never did)."""
        if self._generation is None:
            self.require_config()
        cfg = self.state.cfg
        if cfg is None or cfg.generation != self._generation:
            raise RunChangedError(f"run {self.run!r} was purged or re-created")

    # ------------------------------------------------------------------ config
    def load_config(self) -> RunConfig | None:
        with self._lock:
            cfg = self.state.cfg
            if cfg is not None:
                self._generation = cfg.generation
            return cfg

    def require_config(self) -> RunConfig:
        return required(self.load_config(), self.run)

    def create_config(self, cfg: RunConfig) -> tuple[RunConfig, bool]:
        with self._lock:
            created = self.state.cfg is None
            if created:
                self.state.cfg = replace(cfg, generation=secrets.token_hex(8))
        return self.require_config(), created

    def pin_dump_identity(
        self, model_id: str, layer_ids: list[int], dump_dtype: str, hidden_size: int
    ) -> dict[str, Any]:
        values = dict(zip(PINS, (model_id, layer_ids, dump_dtype, hidden_size), strict=True))
        with self._lock:
            self._fence()
            cfg = self.state.cfg
            assert cfg is not None
            fresh: dict[str, Any] = {k: v for k, v in values.items() if getattr(cfg, k) is None}
            self.state.cfg = cfg = replace(cfg, **fresh)
            return {k: getattr(cfg, k) for k in PINS}

    def purge(self) -> None:
        """Delete the run (every later write of a client that read it is refused)."""
        with self._lock:
            self.state.clear()
            self._lock.notify_all()

    # ------------------------------------------------------------------ queues
    def enqueue(
        self,
        chunks: Iterable[Sequence[AnyRef]],
        *,
        clear_failures: bool = False,
        retry: bool = False,
        attempt: int = 0,
        reason: str | None = None,
    ) -> int:
        """Chunk jobs, fenced; entries given encoded are decoded, as a job read back is."""
        n = 0
        with self._lock:
            self._fence()
            origin = self.keys.retry_queue if retry else self.keys.main_queue
            for chunk in chunks:
                refs: list[SampleRef] = [
                    (sid, IndexEntry.decode(e) if isinstance(e, str) else e) for sid, e in chunk
                ]
                job_id = self.keys.job_id(secrets.token_hex(8), len(refs))
                (self.state.retry if retry else self.state.main).append(
                    ChunkJob(job_id, origin, refs, attempt, reason)
                )
                if clear_failures:
                    for sid, _ in refs:
                        self.state.dead.pop(sid, None)
                        self.state.crashes.pop(sid, None)
                n += len(refs)
            self._lock.notify_all()
        return n

    def claim(self, worker_id: str, timeout: float) -> ChunkJob | None:
        """Retries first, then the main queue; with both empty, waits up to `timeout` for a
        change of the run (a job queued, or a purge: then None, so a caller's loop looks at
        the run again)."""
        with self._lock:
            if not (self.state.retry or self.state.main) and timeout > 0:
                self._lock.wait(timeout)
            if not (self.state.retry or self.state.main):
                return None
            job = (self.state.retry or self.state.main).popleft()
            self.state.wip.setdefault(worker_id, []).append(job)
            return job

    def held_job_ids(self, worker_id: str) -> list[str]:
        with self._lock:
            return [j.job_id for j in self.state.wip.get(worker_id, [])]

    def load_held(self, worker_id: str, job_id: str) -> ChunkJob:
        with self._lock:
            return next(j for j in self.state.wip.get(worker_id, []) if j.job_id == job_id)

    def _take(self, worker_id: str, job: ChunkJob) -> bool:
        wip = self.state.wip.get(worker_id, [])
        if job not in wip:
            return False
        wip.remove(job)
        return True

    def finish(self, worker_id: str, job: ChunkJob) -> bool:
        with self._lock:
            self._fence()
            return self._take(worker_id, job)

    def give_back(self, worker_id: str, job: ChunkJob) -> bool:
        with self._lock:
            self._fence()
            if not self._take(worker_id, job):
                return False
            retry = job.origin == self.keys.retry_queue
            (self.state.retry if retry else self.state.main).appendleft(job)
            self._lock.notify_all()
            return True

    def release_wip(self, worker_id: str) -> int:
        with self._lock:
            jobs = self.state.wip.pop(worker_id, [])
            self.state.main.extendleft(reversed(jobs))
            self._lock.notify_all()
            return len(jobs)

    def reap(self) -> dict[str, int]:
        return {}  # heartbeats never expire here

    def nothing_outstanding(self) -> bool:
        with self._lock:
            s = self.state
            return not (s.main or s.retry or any(s.wip.values()))

    # ------------------------------------------------------------------ workers
    def register(self, worker_id: str, info: dict[str, Any]) -> None:
        self.heartbeat(worker_id, info)

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> None:
        with self._lock:
            self._fence()
            self.state.workers[worker_id] = dict(info)

    def unregister(self, worker_id: str) -> None:
        with self._lock:
            self.state.workers.pop(worker_id, None)

    # ------------------------------------------------------------------ done and dead
    def done_among(self, ids: list[str]) -> set[str]:
        with self._lock:
            return {i for i in ids if i in self.state.done}

    def mark_done_many(self, entries: Sequence[tuple[str, E]]) -> list[bool]:
        with self._lock:
            self._fence()
            out = []
            for sid, entry in entries:
                newly = sid not in self.state.done
                if newly:
                    self.state.done[sid] = entry
                    self.state.dead.pop(sid, None)  # done and dead stay disjoint
                    self._move_totals(entry, 1)
                    if self.state.cfg is not None and self.state.cfg.streamed:
                        self.state.published.append(sid)  # published iff done
                out.append(newly)
            return out

    def _move_totals(self, entry: E, sign: int) -> None:
        tokens, nbytes = self.totals(entry)
        st = self.state.stats
        self.state.stats = replace(
            st, tokens=st.tokens + sign * tokens, bytes=st.bytes + sign * nbytes
        )

    def mark_held_done(
        self, worker_id: str, entries: Sequence[tuple[str, str, E]]
    ) -> list[bool | None]:
        with self._lock:
            held = {j.job_id for j in self.state.wip.get(worker_id, [])}
            out: list[bool | None] = [None] * len(entries)
            ours = [i for i, (_s, job, _e) in enumerate(entries) if not job or job in held]
            marks = self.mark_done_many([(entries[i][0], entries[i][2]) for i in ours])
            for i, newly in zip(ours, marks, strict=True):
                out[i] = newly
            return out

    def get_manifest(self, sample_id: str) -> E | None:
        with self._lock:
            return self.state.done.get(sample_id)

    def undo_done(self, sample_id: str, entry: E) -> bool:
        with self._lock:
            self._fence()
            if self.state.done.pop(sample_id, None) is None:
                return False
            self._move_totals(entry, -1)
            return True

    def to_dead(
        self, sample_id: str, reason: str, message: str, attempts: int, worker: str | None
    ) -> None:
        with self._lock:
            self._fence()
            if sample_id not in self.state.done:
                self.state.dead[sample_id] = dead_entry(reason, message, attempts, worker)
                self.state.spool.pop(sample_id, None)  # a dead sample has no file

    def spool_settled(self) -> bool:
        with self._lock:
            return not self.state.spool

    def reserve_spool(self, sample_id: str, nbytes: int | None) -> bool:
        """As the real store's: against the config's budget, once per sample; a sample
        always fits an empty spool. (The fake does not set a done sample's reservation
        to its file's size: it knows no entry's bytes.)"""
        with self._lock:
            self._fence()
            cfg = self.state.cfg
            budget = cfg.spool_budget if cfg is not None else None
            if not budget or sample_id in self.state.spool:
                return True
            if nbytes is not None and nbytes > budget:
                raise SampleOverBudget(budget, nbytes)
            n = budget if nbytes is None else nbytes
            total = sum(self.state.spool.values())
            if total > 0 and total + n > budget:
                return False
            self.state.spool[sample_id] = n
            return True

    def release_spool(self, sample_id: str) -> int:
        with self._lock:
            self._fence()
            if sample_id in self.state.done:
                return 0
            return self.state.spool.pop(sample_id, 0)

    def record_crash(self, sample_id: str) -> int:
        with self._lock:
            self._fence()
            self.state.crashes[sample_id] += 1
            return self.state.crashes[sample_id]

    # ------------------------------------------------------------------ counters
    def set_totals(self, *, samples: int, tokens: int, invalid_lines: int) -> None:
        with self._lock:
            self.state.stats = replace(
                self.state.stats,
                total_samples=samples,
                total_tokens=tokens,
                invalid_lines=invalid_lines,
            )

    def set_lost(self, samples: int) -> None:
        with self._lock:
            self.state.stats = replace(self.state.stats, lost=max(0, samples))

    def forget_lost(self, samples: int) -> None:
        with self._lock:
            st = self.state.stats
            self.state.stats = replace(st, lost=max(0, st.lost - samples))

    def stats(self) -> RunStats:
        """As the real store's: the queue counters are what the queues hold, exact."""
        with self._lock:
            s = self.state
            return replace(
                s.stats,
                main_samples=sum(len(j.samples) for j in s.main),
                main_jobs=len(s.main),
                retry_samples=sum(len(j.samples) for j in s.retry),
                retry_jobs=len(s.retry),
                counters=scripts.COUNTERS_VERSION,
            )
