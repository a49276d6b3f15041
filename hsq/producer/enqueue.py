"""`hsq enqueue`: validate a dataset, record the run, enqueue what is neither done nor queued.

Idempotent: done samples, samples already queued or held by a worker, and samples in the
dead letter are skipped, so a second run of the same command enqueues nothing and a run
after a partial extraction enqueues only the rest. Failures are requeued with `hsq requeue`.
After a fixed dataset, index entries, done marks and dead-letter entries of samples or lines
no longer in it are pruned, so status counts only the dataset as it is.

Two enqueues of one run are serialized by a lock in Redis: the second one fails (exit 2)
instead of scanning in parallel and queueing every sample twice.

The enqueue streams: the dataset is scanned in batches (hsq/producer/fastscan.py) and each
batch is decided, enqueued and indexed before the next is read, with pipelined reads (one
round trip of three HMGETs a batch); no list of every sample is held. Whether an id already
in the index is queued comes from the run's counters (docs/queue.md): when they are exact
and nothing is lost, an indexed id that is neither done nor dead is queued or held;
otherwise (counters missing or off, samples lost, the last enqueue interrupted) every job is
read, as before.

`hsq recover` (hsq/producer/recover.py) is the same pass after a Redis loss, over a list of
the dataset, with every output file already on disk checked first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path

from hsq import logs
from hsq.errors import ConfigError, DatasetError, EmptyDatasetError
from hsq.producer.chat import looks_like_chat
from hsq.producer.fastscan import scan_batches
from hsq.producer.report import (
    Bad,
    EnqueueReport,
    Rejected,
    add_rejected,
    count_bad,
    dead_letter_bad,
    lock_holder,
    log,
    prune,
    refuse_conflicts,
)
from hsq.producer.settings import DatasetInput
from hsq.producer.spoolcheck import Found, Settled, SpoolCheck, spool_check
from hsq.runconfig import DEFAULT_CHUNK_SIZE, ModelShape, RunConfig
from hsq.runstore import RunStore
from hsq.store import AnyRef, chunked

FOLLOW_RUN = ("store_dtype", "prenorm")
"""Settings a run keeps one of whose default is a value: left at that default, a second
enqueue takes what the run recorded (it need not repeat them; a different value given is
refused)."""


def enqueue_run(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool = False,
    progress: bool = True,
    rejected: Sequence[Rejected] = (),
    defaulted: Collection[str] = (),
    shape: ModelShape | None = None,
) -> EnqueueReport:
    """`rejected`: (key, error, id) of rows refused before the dataset was written (chat
    rows `hsq tokenize` could not use); they go to the dead letter as invalid lines do.
    `defaulted`: names of cfg's settings the user left at their defaults (FOLLOW_RUN).
    `shape`: what the servers will dump, when the command knows it before they start
    (`hsq run`): a streamed run's budget is checked against the largest sample with it."""
    cfg.validate()
    try:
        with store.lifecycle.enqueue_lock(lock_holder()):
            return _enqueue_streaming(
                store, cfg, strict=strict, progress=progress, rejected=rejected,
                defaulted=defaulted, shape=shape,
            )  # fmt: skip
    except DatasetError as exc:
        if looks_like_chat(Path(cfg.dataset)):
            raise DatasetError(
                f"{exc}; the lines look like chat rows: pass --tokenizer DIR (see `hsq tokenize`)",
                exc.reason,
            ) from exc
        raise


def enqueue_dataset(
    store: RunStore,
    dataset: Path,
    out: Path,
    data: DatasetInput,
    *,
    progress: bool,
    echo: Callable[[str], None],
    shape: ModelShape | None = None,
) -> EnqueueReport:
    """`hsq enqueue` (and `hsq run`'s enqueue) from what the command was given: with chat
    settings (--tokenizer), tokenize DATASET's chat rows first (its rejects dead-lettered;
    the tokenizer's report to `echo`), else take the rejects file `hsq tokenize` left next
    to it; then enqueue what is neither done nor queued."""
    from hsq.producer.tokenize import read_rejects, rejects_path, tokenize_file, tokens_path

    chat, tokens = data.chat, data.flags.tokens
    if chat is not None:
        chat.validate()
        target = tokens or tokens_path(dataset)
        tok_report, rejects = tokenize_file(dataset, target, chat, progress=progress)
        for line in tok_report.lines_out():
            echo(line)
        dataset = target
    else:
        rejects = read_rejects(rejects_path(dataset))
    cfg = RunConfig(
        run=store.run, dataset=str(dataset.resolve()), out=str(out.resolve()), **data.settings
    )
    return enqueue_run(
        store,
        cfg,
        strict=data.flags.strict,
        progress=progress,
        rejected=[r.dead_letter() for r in rejects],
        defaulted=data.defaulted,
        shape=shape,
    )


STREAM_BATCH = 5000
JOBS_TARGET = 8192
"""Left at its default, the chunk size is chosen so a large dataset makes about this many
jobs or more (auto_chunk_size): enough to spread over a thousand workers, few enough that
RQ's per-job cost (~0.3 ms of the enqueue's CPU a job, whatever its size) stays small."""
MAX_AUTO_CHUNK = 1024


def auto_chunk_size(lines: float) -> int:
    """The chunk size for a dataset of about `lines` lines when --chunk-size is left at its
    default: the default up to JOBS_TARGET jobs' worth, then the largest power of two that
    still gives JOBS_TARGET jobs, at most MAX_AUTO_CHUNK (10M lines: 1024)."""
    size = DEFAULT_CHUNK_SIZE
    while size * 2 <= MAX_AUTO_CHUNK and lines / (size * 2) >= JOBS_TARGET:
        size *= 2
    return size


def _enqueue_streaming(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool,
    progress: bool,
    rejected: Sequence[Rejected],
    defaulted: Collection[str],
    shape: ModelShape | None,
) -> EnqueueReport:
    """The enqueue, one batch at a time (module docstring)."""
    existing = store.load_config()
    if existing is not None:
        kept = {name: getattr(existing, name) for name in FOLLOW_RUN if name in defaulted}
        cfg = replace(cfg, **kept)
    refuse_conflicts(existing, cfg)
    path = Path(cfg.dataset)
    report = EnqueueReport()
    check = spool_check(cfg, existing, shape)
    sizing = check if check is not None and check.needs_scan() else None
    found: Found | None = None
    if strict or sizing is not None:  # refuse before writing anything: a first pass
        settled = _settled(store) if existing is not None else None
        bad_first, found = _first_pass(path, cfg, sizing, settled)
        if strict:
            add_rejected(EnqueueReport(), bad_first, rejected)
        if strict and bad_first:
            probe = EnqueueReport()
            count_bad(probe, bad_first)
            raise DatasetError(
                f"--strict: {len(bad_first)} invalid line(s), nothing enqueued; first: "
                + "; ".join(probe.problems[:5]),
                "strict",
            )
    if check is not None:
        report.spool = check.verdict(found)
    if existing is not None:
        _change_budget(store, existing, cfg)
    seen: dict[str, int] = {}
    bad: Bad = []
    tokens = 0
    read = 0  # bytes of the file scanned so far
    started = False
    exact: dict[str, str] | None = None  # id -> place of every queued sample, if needed
    pending: list[AnyRef] = []
    with logs.progress(path.stat().st_size, "B", "enqueueing", enabled=progress) as bar:
        # A new run's index entries are written as they are: packed by the scan's processes.
        key = store.keys.index if existing is None else None
        for b in scan_batches(path, cfg.max_tokens, batch=STREAM_BATCH, seen=seen, index_key=key):
            bar.update(b.bytes)
            read += b.bytes
            report.lines += b.lines
            bad += b.bad
            count_bad(report, b.bad)
            if not b.valid:
                continue
            if not started:
                if "chunk_size" in defaulted:  # from the lines the file holds (estimated)
                    est = path.stat().st_size * report.lines / max(read, 1)
                    cfg = replace(cfg, chunk_size=auto_chunk_size(est))
                exact = _start(store, cfg, existing)
                started = True
            tokens += b.tokens
            todo, changed = _decide(store, b.valid, exact, report, existing is not None)
            pending += todo
            full = len(pending) - len(pending) % cfg.chunk_size
            _enqueue_chunks(store, cfg, pending[:full], report)
            del pending[:full]  # the rest waits for the next batch: chunks stay full
            # An interrupted enqueue leaves indexed samples in no queue: `begin_enqueue`'s
            # flag makes the next one look at every job.
            if b.packed_index is not None and existing is None:
                store.config_index.put_index_packed(b.packed_index)
            else:
                store.config_index.put_index(changed)
    _enqueue_chunks(store, cfg, pending, report)
    add_rejected(report, bad, rejected)
    report.valid = len(seen)  # only valid lines' ids are recorded
    if not started:
        raise EmptyDatasetError()
    store.set_totals(samples=report.valid, tokens=tokens, invalid_lines=len(bad))
    dead_letter_bad(store, bad)
    report.pruned = prune(store, seen.keys(), {key for key, _, _ in bad}, report.valid)
    store.lifecycle.end_enqueue()
    return report


def _first_pass(
    path: Path, cfg: RunConfig, sizing: SpoolCheck | None, settled: Settled | None
) -> tuple[Bad, Found | None]:
    """A scan that writes nothing: the invalid lines (--strict refuses them all) and, with
    `sizing`, the samples a streamed run's budget must hold (hsq/producer/spoolcheck.py)."""
    bad: Bad = []
    found = Found() if sizing is not None else None
    limit = sizing.fits_tokens() if sizing is not None else 0
    for b in scan_batches(path, cfg.max_tokens, batch=STREAM_BATCH, seen={}):
        bad += b.bad
        if sizing is not None and found is not None:
            sizing.take(b.valid, found, settled, limit)
    return bad, found


def _settled(store: RunStore) -> Settled:
    """An existing run's look at which samples are done or dead (not extracted again)."""

    def settled(ids: list[str]) -> list[bool]:
        _, done, dead = store.config_index.presence(ids)
        return [a or b for a, b in zip(done, dead, strict=True)]

    return settled


def _change_budget(store: RunStore, existing: RunConfig, cfg: RunConfig) -> None:
    """A re-enqueue's --spool-budget replaces a streamed run's budget (raised so a sample
    larger than the old one fits: its workers' pause cause names the number needed). An
    offline run cannot become streamed, nor a streamed one offline."""
    if not cfg.spool_budget or cfg.spool_budget == existing.spool_budget:
        return
    if not existing.streamed:
        raise ConfigError(
            f"run {cfg.run!r} was enqueued without --spool-budget: it cannot be streamed now "
            "(a new run, or `hsq purge` first)"
        )
    store.spool.set_budget(cfg.spool_budget)
    log.info("spool_budget_changed", run=cfg.run, old=existing.spool_budget, new=cfg.spool_budget)


def _enqueue_chunks(
    store: RunStore, cfg: RunConfig, todo: list[AnyRef], report: EnqueueReport
) -> None:
    if todo:
        chunks = list(chunked(todo, cfg.chunk_size))
        report.enqueued += store.enqueue(chunks)
        report.chunks += len(chunks)


def _start(store: RunStore, cfg: RunConfig, existing: RunConfig | None) -> dict[str, str] | None:
    """Create the run if needed and flag the enqueue; the place of every queued sample when
    the counters cannot say which indexed samples are queued (None when they can)."""
    if existing is None:
        store.create_config(cfg)
    interrupted = store.lifecycle.begin_enqueue()
    if existing is None:
        return None
    c = store.counts()
    if not c.stats.counters:
        store.recount_queues()  # a run made before counters: they start here
        return store.outstanding_samples()
    if interrupted or not c.consistent or c.stats.lost > 0:
        return store.outstanding_samples()
    return None


def _decide(
    store: RunStore,
    valid: list[tuple[str, str]],
    exact: dict[str, str] | None,
    report: EnqueueReport,
    existed: bool,
) -> tuple[list[AnyRef], list[tuple[str, str]]]:
    """The samples of a batch to enqueue (neither done, nor queued or held, nor dead), and
    the index entries to write: those not in the index as they are (a re-enqueue of an
    unchanged dataset writes none)."""
    if not existed:
        return list(valid), valid
    ids = [sid for sid, _ in valid]
    index, done, dead = store.config_index.presence(ids)
    todo: list[AnyRef] = []
    changed = [ref for ref, v in zip(valid, index, strict=True) if v != ref[1]]
    for ref, entry, is_done, is_dead in zip(valid, index, done, dead, strict=True):
        queued = ref[0] in exact if exact is not None else entry is not None and not is_dead
        if is_done:
            report.done += 1
        elif queued:
            report.outstanding += 1
        elif is_dead:
            report.dead += 1
        else:
            todo.append(ref)
    return todo, changed
