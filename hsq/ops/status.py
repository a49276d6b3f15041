"""`hsq status` and `hsq runs`: a run's counts, rate, ETA and workers.

Status partitions the dataset: every sample is counted in exactly one of done, dead,
in_progress, retry, queued or missing, so the numbers add up to `total` even while workers
run (done and dead entries always belong to the dataset: `enqueue` prunes the others).
`missing` is what a lost queue entry or a wiped queue leaves behind; `requeue --missing`
puts it back. The headline figures (total, done, dead, tokens, bytes) come from
`run_figures`, the same function the exporter uses.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from hsq.runconfig import size_text
from hsq.runstore import RunStore


@dataclass(frozen=True)
class RunFigures:
    """A run's O(1) figures: what `hsq status` headlines and the exporter serves."""

    run: str
    total: int
    done: int
    dead: int
    remaining: int
    invalid_lines: int
    tokens_total: int
    tokens_done: int
    bytes_done: int
    queued_jobs: int
    retry_jobs: int
    held_jobs: int
    live_workers: int
    out: str | None


def run_figures(store: RunStore) -> RunFigures:
    snap = store.snapshot()
    # Invalid dataset lines are dead-letter entries (`line:N`) and part of `total`.
    total = snap.index + snap.dead_lines
    return RunFigures(
        run=store.run,
        total=total,
        done=snap.done,
        dead=snap.dead,
        remaining=max(total - snap.done - snap.dead, 0),
        invalid_lines=snap.dead_lines,
        tokens_total=snap.stats.total_tokens,
        tokens_done=snap.stats.tokens,
        bytes_done=snap.stats.bytes,
        queued_jobs=snap.main_jobs,
        retry_jobs=snap.retry_jobs,
        held_jobs=snap.held_jobs,
        live_workers=snap.live_workers,
        out=snap.out,
    )


@dataclass(frozen=True)
class WorkerStatus:
    id: str
    state: str | None
    name: str | None = None
    server: str | None = None
    last_sample: str | None = None
    done: int = 0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    host: str | None = None
    heartbeat_age_s: float | None = None
    dumps_discarded: int = 0
    """Dumps whose rid was not in flight (warm-ups, leftovers, late ones): removed, counted."""
    alive: bool = True
    """False once its heartbeat is overdue (a SIGKILLed worker's record outlives it by up to
    the TTL) or expired; its state then says which."""
    cause: str | None = None
    """Why it is not sending (a hsq.workers.policy.Pause value: server_down,
    output_unwritable, dataset_unavailable, ...), from its first pause until a sample is
    done after it."""
    cause_since: float | None = None
    """Epoch seconds the cause was first seen."""
    cause_text: str | None = None
    """The cause in words: "server unreachable since 14:02:11", "output disk full ..."."""


# A record whose heartbeat is older than this many intervals is a dead worker's (it beats
# every interval; the key itself expires after HEARTBEAT_TTL_S).
OVERDUE_BEATS = 3.0

_CAUSE_WORDS = {
    "server_down": "server unreachable",
    "server_starting": "server starting",
    "server_errors": "server answering errors",
    "dataset_unavailable": "dataset unreadable",
    "store_down": "Redis unreachable",
    "dump_dir_changed": "dump dir replaced",
    "hook_inactive": "server's dump hook not live",
    "worker_internal_error": "worker bug (stopping)",
    "spool_full": "spool full (waiting for the consumers to commit)",
    "spool_too_small": "spool budget below a sample (raise --spool-budget)",
}


def cause_text(cause: str, message: str, since: float | None) -> str:
    """A worker's pause cause in words, with the time it began (local clock)."""
    if cause == "output_unwritable":
        full = "disk full" in message or "No space left" in message
        words = "output disk full" if full else "output unwritable"
    else:
        words = _CAUSE_WORDS.get(cause, cause)
    if since is not None:
        words += " since " + time.strftime("%H:%M:%S", time.localtime(since))
    shown = message.splitlines()[0][:120] if message else ""
    quiet = cause in ("server_down", "server_starting")  # the words say it all
    return f"{words} ({shown})" if shown and not quiet else words


@dataclass(frozen=True)
class GroupStatus:
    """One consumer group of a streamed run."""

    name: str
    delivered: int
    """Entries the group has read."""
    committed: int
    """Delivered and committed (its trainers' checkpoints cover them)."""
    pending: int
    """Delivered, not committed yet."""
    lag: int | None
    """Published and not delivered to the group yet (None: Redis cannot say)."""
    oldest_pending_s: float


@dataclass(frozen=True)
class StreamStatus:
    """A streamed run's spool and consumer groups (`hsq status`, `hsq run`'s live view)."""

    spool_bytes: int
    """Reserved by finished, not yet consumed outputs (and by samples being extracted)."""
    budget: int
    published: int
    """Done samples published to the groups (a sample re-done is published again)."""
    consumed: int
    """Samples whose file was removed after every group committed it."""
    keep_after_commit: bool
    groups: list[GroupStatus]


def stream_status(store: RunStore) -> StreamStatus | None:
    """None for a run without a stream (one Redis read)."""
    spool = store.spool
    budget, keep = spool.recorded()
    if not budget:
        return None
    groups = [
        GroupStatus(g.name, g.delivered, g.committed, g.pending, g.lag, g.oldest_pending_s)
        for g in spool.groups()
    ]
    return StreamStatus(
        spool_bytes=spool.spool_bytes(),
        budget=budget,
        published=spool.published(),
        consumed=spool.consumed(),
        keep_after_commit=keep,
        groups=groups,
    )


def stream_text(s: StreamStatus) -> list[str]:
    """The stream's lines of `hsq status`: the spool, then each group."""
    removed = (
        "files kept after commit"
        if s.keep_after_commit
        else f"consumed {s.consumed} (files removed once every group committed)"
    )
    lines = [
        f"  stream: spool {size_text(s.spool_bytes)}/{size_text(s.budget)}  published "
        f"{s.published}  {removed}"
    ]
    for g in s.groups:
        oldest = f", oldest {g.oldest_pending_s:.0f}s" if g.pending else ""
        lines.append(
            f"    group {g.name}: delivered {g.delivered}  committed {g.committed}  "
            f"pending {g.pending}{oldest}"
        )
    return lines


@dataclass(frozen=True)
class RunStatus:
    run: str
    total: int
    done: int
    queued: int
    in_progress: int
    retry: int
    dead: int
    missing: int
    invalid_lines: int
    tokens_done: int
    tokens_total: int
    bytes_done: int
    samples_per_s: float
    tokens_per_s: float
    eta_s: float | None
    dead_by_reason: dict[str, int]
    workers: list[WorkerStatus]
    stream: StreamStatus | None = None
    """A streamed run's spool and groups (None: a run without a stream)."""

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON of `hsq status --json` (docs/operations.md)."""
        return asdict(self)


def partition(store: RunStore) -> tuple[set[str], dict[str, str], set[str], set[str], set[str]]:
    """(index ids, outstanding id -> place, done ids, dead sample ids, dead line keys)."""
    index = set(store.iter_hash_keys(store.keys.index))
    outstanding = store.outstanding_samples()
    done = set(store.iter_hash_keys(store.keys.done))
    dead_keys = set(store.iter_hash_keys(store.keys.dead))
    dead_lines = {k for k in dead_keys if k.startswith("line:")}
    return index, outstanding, done, dead_keys - dead_lines, dead_lines


def _worker_status(wid: str, info: dict[str, str], now: float) -> WorkerStatus:
    if not info:
        return WorkerStatus(id=wid, state="dead (heartbeat expired)", alive=False)

    def num(key: str, default: float = 0.0) -> float:
        try:
            return float(info.get(key, default))
        except ValueError:
            return default

    age = round(now - num("ts", now), 1) if "ts" in info else None
    interval = max(num("heartbeat_interval_s", 2.0), 0.1)
    overdue = age is not None and age > max(OVERDUE_BEATS * interval, 5.0)
    state = f"dead (no heartbeat for {age:.0f}s)" if overdue else info.get("state")
    cause = info.get("cause") or None
    since = num("cause_since") if info.get("cause_since") else None
    return WorkerStatus(
        id=wid,
        state=state,
        name=info.get("name"),
        server=info.get("server"),
        last_sample=info.get("last_sample") or None,
        done=int(num("done")),
        samples_per_s=0.0 if overdue else num("samples_per_s"),
        tokens_per_s=0.0 if overdue else num("tokens_per_s"),
        host=info.get("host"),
        heartbeat_age_s=age,
        dumps_discarded=int(num("dumps_discarded")),
        alive=not overdue,
        cause=cause,
        cause_since=since,
        cause_text=cause_text(cause, info.get("cause_message", ""), since) if cause else None,
    )


def eta(tokens_left: int, tokens_per_s: float, workers: list[WorkerStatus]) -> float | None:
    """Seconds to go: 0 once nothing is left; None while no live worker is sending (every
    one paused by a cause, or none at all): a rate from before a pause promises nothing."""
    if tokens_left <= 0:
        return 0.0
    sending = [w for w in workers if w.alive and w.cause is None]
    if not sending or tokens_per_s <= 0:
        return None
    return round(tokens_left / tokens_per_s, 1)


@dataclass(frozen=True)
class DeadSample:
    """One dead-letter entry, as `hsq status --failed` lists it."""

    id: str
    reason: str
    message: str
    attempts: int | None = None
    worker: str | None = None
    time: float | None = None


def dead_samples(store: RunStore) -> list[DeadSample]:
    """Every dead-letter entry (samples and invalid dataset lines, `line:<n>`), sorted by
    id. O(dead): read only when asked for (`--failed`)."""
    out = []
    for key, entry in store.dead_entries().items():  # typed there; fields checked here
        attempts, worker, at = entry.get("attempts"), entry.get("worker"), entry.get("time")
        out.append(
            DeadSample(
                id=key,
                reason=str(entry.get("reason", "?")),
                message=str(entry.get("message", "")),
                attempts=attempts if isinstance(attempts, int) else None,
                worker=worker if isinstance(worker, str) else None,
                time=float(at) if isinstance(at, int | float) else None,
            )
        )
    return sorted(out, key=lambda d: d.id)


def dead_text(dead: list[DeadSample], width: int = 160) -> list[str]:
    """One line per dead sample: id, reason, the first line of its message."""
    if not dead:
        return ["  dead letter: empty"]
    lines = [f"  dead samples ({len(dead)}): id, reason, message"]
    for d in dead:
        first = d.message.splitlines()[0] if d.message else ""
        if len(first) > width:
            first = first[: width - 3] + "..."
        lines.append(f"    {d.id}  {d.reason}  {first}")
    return lines


def recount(store: RunStore) -> int:
    """Re-derive a run's counters (`hsq status --recount`; status does it by itself when
    they are missing, as in a run made by an older hsq, or disagree with the queues): the
    queue and dead-letter counts atomically, then the samples in no queue from a full
    partition (O(samples), the one slow path). Returns the samples found missing."""
    store.recount_queues()
    index, outstanding, done, dead, _ = partition(store)
    missing = len(index - done - dead - set(outstanding))
    store.lifecycle.set_lost(missing)
    return missing


def run_status(
    store: RunStore, now: float | None = None, *, recount_first: bool = False
) -> RunStatus:
    """A run's status from O(1) counters (one MULTI) plus one read per worker.

    done and dead are the hashes' lengths (disjoint: the scripts keep them so); queued and
    retry are the samples the queues hold (counted by the scripts that move jobs); missing
    the samples a recount found in no queue, less those enqueued again since; in_progress
    the rest. Each part is capped by what is left, so the parts always add up to `total`;
    while a chunk in progress also has a sample in the retry queue, that sample counts once."""
    now = time.time() if now is None else now
    c = store.counts()
    if recount_first or not c.consistent:
        recount(store)
        c = store.counts()
    st = c.stats
    invalid = st.invalid_lines
    total = c.index + invalid
    remaining = max(total - c.done - c.dead, 0)
    missing = min(max(st.lost, 0), remaining)
    retry = min(max(st.retry_samples, 0), remaining - missing)
    queued = min(max(st.main_samples, 0), remaining - missing - retry)
    workers = [_worker_status(wid, info, now) for wid, info in store.workers.workers_info().items()]
    stream = stream_status(store)
    samples_s = sum(w.samples_per_s for w in workers)
    tokens_s = sum(w.tokens_per_s for w in workers)
    tokens_total, tokens_done = st.total_tokens, st.tokens
    # Tokens of dead samples are never done: what is left is the unsettled samples' share.
    tokens_left = max(tokens_total - tokens_done, 0) if remaining else 0
    return RunStatus(
        run=store.run,
        total=total,
        done=c.done,
        queued=queued,
        in_progress=remaining - missing - retry - queued,
        retry=retry,
        dead=c.dead,
        missing=missing,
        invalid_lines=invalid,
        tokens_done=tokens_done,
        tokens_total=tokens_total,
        bytes_done=st.bytes,
        samples_per_s=round(samples_s, 3),
        tokens_per_s=round(tokens_s, 1),
        eta_s=eta(tokens_left, tokens_s, workers),
        dead_by_reason=c.dead_reasons,
        workers=workers,
        stream=stream,
    )


def status_text(st: RunStatus, *, listed: bool = False) -> list[str]:
    """`hsq status`'s lines; `listed`: the dead samples follow (--failed), so no line
    points to the command that lists them."""
    total = st.total or 1
    pct = 100.0 * st.done / total
    lines = [
        f"run {st.run}: {st.done}/{st.total} done ({pct:.1f}%), "
        f"{st.tokens_done:,}/{st.tokens_total:,} tokens, "
        f"{st.bytes_done / 1e9:.2f} GB",
        f"  queued {st.queued}  in progress {st.in_progress}  retry {st.retry}  "
        f"dead {st.dead}  missing {st.missing}",
        rate_line(st),
    ]
    if st.dead_by_reason:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(st.dead_by_reason.items()))
        lines.append(f"  dead letter by reason: {reasons}")
        if not listed:
            lines.append(f"  (the ids: hsq status --run {st.run} --failed)")
    if st.missing:
        lines.append("  missing samples are in no queue: `hsq requeue --missing` puts them back")
    if st.stream is not None:
        lines += stream_text(st.stream)
    lines += [worker_line(w) for w in st.workers]
    if not any(w.alive for w in st.workers) and st.done + st.dead < st.total:
        lines.append("  no live workers")
    return lines


def rate_line(st: RunStatus) -> str:
    if st.done + st.dead >= st.total:
        return f"  complete: {st.done} done, {st.dead} dead"
    eta = "-" if st.eta_s is None else _dur(st.eta_s)
    causes = sorted({w.cause_text for w in st.workers if w.alive and w.cause_text})
    why = f" (paused: {'; '.join(causes)})" if st.eta_s is None and causes else ""
    return (
        f"  rate {st.samples_per_s:.2f} samples/s, {st.tokens_per_s:,.0f} tokens/s, ETA {eta}{why}"
    )


def worker_line(w: WorkerStatus) -> str:
    if w.name is None and not w.alive and w.heartbeat_age_s is None:
        # Its record expired with it: what it did is in the run's counts, not here.
        return f"  worker {w.id} [{w.state}] (its record expired; its samples count above)"
    state = w.state if not (w.alive and w.cause_text) else f"{w.state}: {w.cause_text}"
    return (
        f"  worker {w.name or w.id} [{state}] server {w.server} "
        f"last {w.last_sample or '-'} done {w.done} {w.tokens_per_s:,.0f} tokens/s"
        + (f" dumps discarded {w.dumps_discarded}" if w.dumps_discarded else "")
    )


def _dur(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
