"""Counters (docs/queue.md "Counters"): the stats hash holds the samples and jobs in the main
and retry queues and the samples known lost; every script or MULTI that moves a job moves its
count with it (a job id ends in `-n<samples>`), so `hsq status` reads a handful of O(1)
values instead of every job. `recount_queues` re-derives them.

The hash is read and written through one typed record, RunStats: its fields are the hash's
fields, so no caller outside hsq/store names one by a string (the scripts, in Lua, use the
same names; tests/test_run_stats.py checks the hash holds no other).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hsq import jsonsafe
from hsq.errors import ConfigError
from hsq.keys import rq_queue_key
from hsq.store import scripts
from hsq.store.connection import text, translate_public
from hsq.store.fence import Fence
from hsq.store.jobs import fetch_jobs, job_size, parse_job


@dataclass(frozen=True)
class RunStats:
    """A run's stats hash, typed: each field is the hash field of its name (0 if absent)."""

    total_samples: int = 0
    """Valid samples of the dataset, as the last enqueue counted them."""
    total_tokens: int = 0
    """Their tokens."""
    invalid_lines: int = 0
    """Dataset lines that are no sample (dead-letter entries `line:N`)."""
    tokens: int = 0
    """Tokens of the done samples (moved by every done mark and un-mark, in the script)."""
    bytes: int = 0
    """Bytes of the done samples' output files."""
    main_samples: int = 0
    """Samples in the main queue's jobs."""
    main_jobs: int = 0
    retry_samples: int = 0
    """Samples in the retry queue's jobs."""
    retry_jobs: int = 0
    lost: int = 0
    """Samples a recount found in no queue, less those enqueued again since."""
    counters: int = 0
    """scripts.COUNTERS_VERSION once the scripts keep the queue counters; 0 in a run made
    before they existed (the first enqueue or status of a newer hsq recounts it)."""
    enqueuing: int = 0
    """1 while an enqueue runs; left by one that crashed (the next looks at every job)."""

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> RunStats:
        """The record of HGETALL's reply; fields it does not know are ignored."""
        values = {text(k): int(v) for k, v in raw.items()}
        return cls(**{k: v for k, v in values.items() if k in STAT_FIELDS})


STAT_FIELDS = frozenset(f.name for f in dataclasses.fields(RunStats))


def stat_fields(**values: int) -> Mapping[Any, int]:
    """A write of some of the hash's fields (HSET's mapping), their names checked against
    RunStats: a typo is an error here, not a field nobody reads."""
    if unknown := set(values) - STAT_FIELDS:
        raise KeyError(f"not a stats field: {sorted(unknown)}")
    return values


def stat_field(name: str) -> str:
    """One field's name, checked (for HINCRBY, HGET and HDEL)."""
    stat_fields(**{name: 0})
    return name


@dataclass(frozen=True)
class Counters:
    """A run's O(1) counters: `counts()` reads them in one transaction (so they agree with
    each other; status), `snapshot()` adds the workers' presence and the output dir
    (the exporter)."""

    index: int
    done: int
    dead: int
    main_jobs: int
    """Jobs the main queue lists (its length)."""
    retry_jobs: int
    stats: RunStats
    dead_reasons: dict[str, int]
    held_jobs: int = 0
    """Jobs in the registered workers' wip lists (snapshot() only)."""
    live_workers: int = 0
    """Registered workers whose heartbeat has not expired (snapshot() only)."""
    out: str | None = None
    """The run's output root (snapshot() only)."""

    @property
    def dead_lines(self) -> int:
        """Invalid dataset lines (dead-letter entries `line:N`)."""
        return self.stats.invalid_lines

    @property
    def consistent(self) -> bool:
        """The queue counters can be trusted: they exist, and the job counts they keep
        match the queues' lengths (a queue damaged from outside, e.g. a DEL, breaks this)."""
        st = self.stats
        return (
            st.counters == scripts.COUNTERS_VERSION
            and st.main_jobs == self.main_jobs
            and st.retry_jobs == self.retry_jobs
        )


@translate_public
class Stats:
    def __init__(self, fence: Fence) -> None:
        self.client = fence.client
        self.run = fence.run
        self.keys = fence.keys
        self._recount = self.client.register_script(scripts.RECOUNT)

    def set_totals(self, *, samples: int, tokens: int, invalid_lines: int) -> None:
        totals = stat_fields(
            total_samples=samples, total_tokens=tokens, invalid_lines=invalid_lines
        )
        self.client.hset(self.keys.stats, mapping=totals)

    def stats(self) -> RunStats:
        return RunStats.from_hash(self.client.hgetall(self.keys.stats))

    def counts(self) -> Counters:
        """The O(1) counters `hsq status` adds up, in one MULTI: one instant of the run."""
        index, done, dead, main, retry, stats, reasons = self._reads(True).execute()
        return _counters(index, done, dead, main, retry, stats, reasons)

    def snapshot(self) -> Counters:
        """The counters and who works on the run, in two round trips (the exporter)."""
        k = self.keys
        p = self._reads(False)
        p.smembers(k.workers)
        p.hget(k.config, "out")
        index, done, dead, main, retry, stats, reasons, wids, out = p.execute()
        p = self.client.pipeline(transaction=False)
        for w in wids:
            p.exists(k.worker(text(w)))
            p.llen(k.wip(text(w)))
        res = p.execute()
        out_path = None
        with contextlib.suppress(ValueError, TypeError):
            out_path = jsonsafe.loads(out) if out else None
        return replace(
            _counters(index, done, dead, main, retry, stats, reasons),
            held_jobs=sum(res[1::2]),
            live_workers=sum(res[0::2]),
            out=out_path if isinstance(out_path, str) else None,
        )

    def _reads(self, transaction: bool) -> Any:
        """A pipeline with the reads `counts` and `snapshot` share: index, done and dead
        sizes, the two queues' lengths, the stats hash, the dead letter's reasons."""
        k = self.keys
        p = self.client.pipeline(transaction=transaction)
        p.hlen(k.index)
        p.hlen(k.done)
        p.hlen(k.dead)
        p.llen(rq_queue_key(k.main_queue))
        p.llen(rq_queue_key(k.retry_queue))
        p.hgetall(k.stats)
        p.hgetall(k.dead_reasons)
        return p

    def recount_queues(self) -> int:
        """Re-derive the queue counters and the dead letter's reason counts from the queues
        themselves, atomically (O(jobs): the migration and repair path). Jobs enqueued before
        ids carried their size get it recorded first. Returns the samples the queues hold."""
        k = self.keys
        sizes: dict[str, int] = {}
        for key in (rq_queue_key(k.main_queue), rq_queue_key(k.retry_queue)):
            legacy = [
                j for j in (text(x) for x in self.client.lrange(key, 0, -1)) if not job_size(j)
            ]
            for i in range(0, len(legacy), 500):
                part = legacy[i : i + 500]
                for jid, job in zip(part, fetch_jobs(self.client, part), strict=True):
                    parsed = None if job is None else parse_job(job, (k.main_queue,))
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
                args=[scripts.COUNTERS_VERSION],
            )
        )
        if res == -1:
            raise ConfigError(f"run {self.run!r} does not exist")
        return res


def _counters(
    index: Any, done: Any, dead: Any, main: Any, retry: Any, stats: Any, reasons: Any
) -> Counters:
    return Counters(
        index=int(index),
        done=int(done),
        dead=int(dead),
        main_jobs=int(main),
        retry_jobs=int(retry),
        stats=RunStats.from_hash(stats),
        dead_reasons={text(a): int(b) for a, b in reasons.items() if int(b) > 0},
    )
