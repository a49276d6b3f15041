"""The Redis key schema: every key hsq reads or writes is named here and nowhere else.

Per run R (a name matching RUN_NAME_RE):

    hsq:runs                      SET   names of all runs
    hsq:run:R:config              HASH  the run's config (dataset, out, layers, model, ...)
                                        and its `generation`: a random token made when the
                                        run is created; every write of a worker is fenced on it
    hsq:run:R:enqueue-lock        STRING holder of the running `hsq enqueue`/`recover` (expires)
    hsq:run:R:reaper              STRING the worker reaping dead workers' jobs now (expires, 1 s)
    hsq:run:R:index               HASH  sample id -> "offset:length:crc32:num_tokens" (dataset)
    hsq:run:R:done                HASH  sample id -> manifest entry; THE truth of "done". Stored
                                        as `m1|tokens|bytes|crc|worker|time|attempt|dtype`
                                        (the path is the id's; hsq.store.manifest_json gives
                                        the JSON back), or JSON as older hsq wrote it
    hsq:run:R:dead                HASH  sample id (or "line:<n>") -> dead-letter entry (JSON)
    hsq:run:R:stats               HASH  tokens / bytes done, totals, and the counters status
                                        reads: main_samples, main_jobs, retry_samples,
                                        retry_jobs (what the queues hold), lost (samples in
                                        no queue, as of the last recount), counters (version)
    hsq:run:R:dead-reasons        HASH  reason -> dead-letter entries with that reason
    hsq:run:R:job-sizes           HASH  job id -> samples, for jobs enqueued before job ids
                                        carried their size (written by a recount)
    hsq:run:R:crashes             HASH  sample id -> requests that died with the server
    hsq:run:R:workers             SET   registered worker ids
    hsq:run:R:worker:W            HASH  worker W's heartbeat and state (expires: liveness)
    hsq:run:R:wip:W               LIST  job ids worker W holds (reliable-queue pattern)
    rq:queue:hsq-R                LIST  RQ queue of chunk jobs (main)
    rq:queue:hsq-R-retry          LIST  RQ queue of single-sample retry jobs
    rq:job:<id>                   HASH  RQ job (JSON serializer): the chunk's samples;
                                        <id> is hsq-R-<hex>-n<samples in the job>

Everything a queue may lose is recoverable: the dataset index minus `done`, `dead`, the
queues and the wip lists is exactly what `requeue --missing` puts back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RUNS = "hsq:runs"
RQ_QUEUE_PREFIX = "rq:queue:"
RQ_JOB_PREFIX = "rq:job:"


def rq_queue_key(queue_name: str) -> str:
    return RQ_QUEUE_PREFIX + queue_name


def rq_job_key(job_id: str) -> str:
    return RQ_JOB_PREFIX + job_id


@dataclass(frozen=True)
class RunKeys:
    run: str

    def __post_init__(self) -> None:
        if not RUN_NAME_RE.fullmatch(self.run):
            raise ValueError(
                f"run name {self.run!r} must match {RUN_NAME_RE.pattern} (letters, digits, _ -)"
            )

    @property
    def _prefix(self) -> str:
        return f"hsq:run:{self.run}:"

    @property
    def config(self) -> str:
        return self._prefix + "config"

    @property
    def index(self) -> str:
        return self._prefix + "index"

    @property
    def done(self) -> str:
        return self._prefix + "done"

    @property
    def dead(self) -> str:
        return self._prefix + "dead"

    @property
    def stats(self) -> str:
        return self._prefix + "stats"

    @property
    def dead_reasons(self) -> str:
        return self._prefix + "dead-reasons"

    @property
    def job_sizes(self) -> str:
        return self._prefix + "job-sizes"

    @property
    def crashes(self) -> str:
        return self._prefix + "crashes"

    @property
    def workers(self) -> str:
        return self._prefix + "workers"

    @property
    def enqueue_lock(self) -> str:
        return self._prefix + "enqueue-lock"

    @property
    def reaper(self) -> str:
        return self._prefix + "reaper"

    def worker(self, worker_id: str) -> str:
        return self._prefix + "worker:" + worker_id

    def wip(self, worker_id: str) -> str:
        return self._prefix + "wip:" + worker_id

    @property
    def main_queue(self) -> str:
        """RQ queue name (RQ prefixes it with rq:queue:)."""
        return f"hsq-{self.run}"

    @property
    def retry_queue(self) -> str:
        return f"hsq-{self.run}-retry"

    def all_static(self) -> list[str]:
        """Keys `purge` deletes besides wip/worker keys and job hashes."""
        return [
            self.config,
            self.index,
            self.done,
            self.dead,
            self.stats,
            self.dead_reasons,
            self.job_sizes,
            self.crashes,
            self.workers,
            self.enqueue_lock,
            self.reaper,
            rq_queue_key(self.main_queue),
            rq_queue_key(self.retry_queue),
        ]
