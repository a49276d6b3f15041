"""The Redis key schema: every key hsq reads or writes is named here and nowhere else.

Per run R (a name matching RUN_NAME_RE):

    hsq:run:R:config              HASH  the run's config (dataset, out, layers, model, ...)
                                        and its `generation`: a random token made when the
                                        run is created; every write of a worker is fenced on
                                        it. Its existence is the run's: the list of runs is
                                        these keys, found by SCAN (RUN_CONFIG_GLOB)
    hsq:run:R:enqueue-lock        STRING holder of the running `hsq enqueue`/`recover` (expires)
    hsq:run:R:reaper              STRING the worker reaping dead workers' jobs now (expires, 1 s)
    hsq:run:R:index               HASH  sample id -> "offset:length:crc32:num_tokens" (dataset)
    hsq:run:R:done                HASH  sample id -> manifest entry; THE truth of "done". Stored
                                        as `m1|tokens|bytes|crc|worker|time|attempt|dtype`
                                        (the path is the id's; hsq.outputs.manifest gives
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
    hsq:run:R:worker:W            HASH  worker W's heartbeat and state (expires HEARTBEAT_TTL_S
                                        after the last heartbeat: liveness)
    hsq:run:R:wip:W               LIST  job ids worker W holds (reliable-queue pattern)
    hsq:run:R:ready               STREAM a streamed run's (spool_budget set) done samples, one
                                        entry (id, tokens, bytes) per done mark, added by the
                                        mark's script; its consumer groups are the run's
                                        `consumers` (created with the config, from id 0)
    hsq:run:R:spool               HASH  sample id -> bytes reserved for its output (reserved
                                        before dispatch, set to the file's size when done,
                                        released when the file is removed or the sample
                                        dead); the sum is the stats hash's `spool_bytes`
    hsq:run:R:acks                HASH  stream entry id -> groups that committed it (removed
                                        when every group has)
    hsq:run:R:spool-gc            SET   sample ids every group committed, whose file is to be
                                        removed and reservation released (idempotent)
    hsq:run:R:consumed            SET   sample ids whose file was removed after every group
                                        committed it (done, trained, no file by design)
    hsq:run:R:consumer-stats      HASH  "<group>/<rank>" -> a trainer's data wait (JSON:
                                        wait_s, elapsed_s, wait_share, items, time), written
                                        with each commit (the live view, the metrics)
    rq:queue:hsq-R                LIST  RQ queue of chunk jobs (main)
    rq:queue:hsq-R-retry          LIST  RQ queue of single-sample retry jobs
    rq:job:hsq-R-<16 hex>-n<count> HASH RQ job (JSON serializer): the chunk's samples; the
                                        id carries the job's sample count (counters)
    hsq:run:R:rq-queues           SET   where RQ's enqueue adds the run's queue keys (RQ
                                        writes its registry on every enqueue; ours is per run)
    rq:queues                     SET   RQ's registry of queue keys, which `rq info` reads:
                                        hsq adds the run's two queues where its user may write
                                        it (an admin or the shared user), never a run's user

No key is shared between runs' users: a run's user can neither remove nor
forge another run's entry in a listing, since the listing is each run's own config key.
`hsq:runs`, the set of run names hsq 0.2.0 kept, is no longer read or written.

Everything a queue may lose is recoverable: the dataset index minus `done`, `dead`, the
queues and the wip lists is exactly what `requeue --missing` puts back.

Per-run isolation: every key of run R matches one of `RunKeys(R).acl_key_patterns()` and no
key of another legal run does. Run names hold no `:`, so `hsq:run:R:*` is R's alone; a run
name may not end in `-retry`, which would make its main queue another run's retry queue; and
the job patterns have no `*`: one exact-length pattern per width of the sample count
(`rq:job:hsq-R-` + 16 hex + `-n` + 1..9 digits). A key matching one is `hsq-R-T-nN` with T
and N of fixed form, and since N is the id's whole trailing run of digits and T the 16
characters before `-n`, the name left in front is R itself (with `-n*`, run `qa`
matched the jobs of run `qa-0123456789abcdef-nightly`). `RunKeys.acl_user` turns
them into a Redis ACL user that can do run R's work and cannot read, write or list another
run's keys (docs/operations.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RUN_PREFIX = "hsq:run:"
CONFIG_SUFFIX = ":config"
RUN_CONFIG_GLOB = RUN_PREFIX + "*" + CONFIG_SUFFIX
"""SCAN pattern of every run's config key; a match that is not `hsq:run:<legal name>:config`
(a run's user may make `hsq:run:R:x:config`) is not a run (run_of_config_key)."""
RQ_QUEUE_PREFIX = "rq:queue:"
RQ_JOB_PREFIX = "rq:job:"
RQ_QUEUES = "rq:queues"
"""RQ adds every queue it enqueues into to this set (rq.Queue.redis_queues_keys)."""
RETRY_SUFFIX = "-retry"
HEARTBEAT_TTL_S = 10
"""A worker whose heartbeat hash expired is taken for dead and its jobs handed back; a worker
beats well within it (hsq.workers.settings checks its interval)."""
JOB_TOKEN_HEX = 16
"""Hex digits of a job id's random part: fixed, so a run's job-key pattern is exact."""
JOB_COUNT_DIGITS = 9
"""A job id's sample count is 1..999999999: at most this many digits."""
ACL_COMMANDS = (
    "+ping +auth +hello +info +hgetall +hget +hset +hsetnx +hmget +hscan +hlen +hdel "
    "+hincrby +sadd +srem +smembers +expire +del +exists +lmove +blmove +lrange +llen +lrem "
    "+lpush +rpush +lpos +evalsha +script|load +set +get +watch +unwatch +multi +exec +discard "
    "+xadd +xreadgroup +xack +xpending +xrange +xgroup|create +xinfo|groups +xlen +scard "
    "+client|setname"
)
"""What hsq sends, and nothing else: no SCAN or KEYS (they list every key name, whatever
the user's key patterns), no FLUSH*, CONFIG, EVAL of new scripts, or pub/sub."""


def run_of_config_key(key: str) -> str:
    """The run whose config key this is; ValueError, in words, if it is not one."""
    name = key.removeprefix(RUN_PREFIX).removesuffix(CONFIG_SUFFIX)
    if not (key.startswith(RUN_PREFIX) and key.endswith(CONFIG_SUFFIX)):
        raise ValueError(f"{key[:120]!r} is not a run's config key")
    try:
        RunKeys(name)
    except ValueError as exc:
        raise ValueError(f"{key[:120]!r} is not a run's config key: {exc}") from None
    return name


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
        if self.run.endswith(RETRY_SUFFIX):
            raise ValueError(
                f"run name {self.run!r} may not end in {RETRY_SUFFIX!r}: its queue would be "
                f"run {self.run.removesuffix(RETRY_SUFFIX)!r}'s retry queue"
            )

    @property
    def _prefix(self) -> str:
        return f"{RUN_PREFIX}{self.run}:"

    @property
    def config(self) -> str:
        return RUN_PREFIX + self.run + CONFIG_SUFFIX

    @property
    def rq_registry(self) -> str:
        """The set RQ's enqueue adds this run's queue keys to (instead of `rq:queues`)."""
        return self._prefix + "rq-queues"

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

    @property
    def ready(self) -> str:
        return self._prefix + "ready"

    @property
    def spool(self) -> str:
        return self._prefix + "spool"

    @property
    def acks(self) -> str:
        return self._prefix + "acks"

    @property
    def spool_gc(self) -> str:
        return self._prefix + "spool-gc"

    @property
    def consumed(self) -> str:
        return self._prefix + "consumed"

    @property
    def consumer_stats(self) -> str:
        return self._prefix + "consumer-stats"

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
        return f"hsq-{self.run}{RETRY_SUFFIX}"

    def job_id(self, token: str, samples: int) -> str:
        """An RQ job id of this run: `hsq-R-`, JOB_TOKEN_HEX hex digits and `-n<samples>`
        (the count the store's scripts keep counters with)."""
        if len(token) != JOB_TOKEN_HEX or any(c not in "0123456789abcdef" for c in token):
            raise ValueError(f"a job token is {JOB_TOKEN_HEX} lowercase hex digits")
        if not 0 < samples < 10**JOB_COUNT_DIGITS:
            raise ValueError(f"a job holds 1..999999999 samples, not {samples}")
        return f"hsq-{self.run}-{token}-n{samples}"

    def acl_key_patterns(self) -> list[str]:
        """Redis ACL key patterns matching every key of this run and no other run's."""
        # No `*` in a job pattern (module docstring): a trailing one let a longer run name
        # that carries a token and `-n` (`qa-<16 hex>-nightly`) match run `qa`'s pattern.
        job = rq_job_key(f"hsq-{self.run}-" + "[0-9a-f]" * JOB_TOKEN_HEX + "-n")
        jobs = [job + "[0-9]" * width for width in range(1, JOB_COUNT_DIGITS + 1)]
        queues = [rq_queue_key(self.main_queue), rq_queue_key(self.retry_queue)]
        return [self._prefix + "*", *queues, *jobs]

    def acl_user(self, user: str | None = None, password: str = "<PASSWORD>") -> str:
        """A Redis ACL user (an ACL file or redis.conf line) that can do this run's work
        (enqueue, workers, status/requeue/verify/recover/audit/purge of this run) and cannot
        read, write or list another run's keys, nor touch a shared key (no `rq:queues`:
        RQ's enqueue writes the run's own registry, `rq_registry`)."""
        name = user or f"hsq-{self.run}"
        keys = " ".join("~" + k for k in self.acl_key_patterns())
        perms = f"resetkeys resetchannels -@all {ACL_COMMANDS}"
        return f"user {name} on >{password} {perms} {keys}"

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
            self.rq_registry,
            self.ready,
            self.spool,
            self.acks,
            self.spool_gc,
            self.consumed,
            self.consumer_stats,
            rq_queue_key(self.main_queue),
            rq_queue_key(self.retry_queue),
        ]
