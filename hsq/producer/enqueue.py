"""`hsq enqueue`: validate a dataset, record the run, enqueue what is neither done nor queued.

Idempotent: done samples, samples already queued or held by a worker, and samples in the
dead letter are skipped, so a second run of the same command enqueues nothing and a run
after a partial extraction enqueues only the rest. Failures are requeued with `hsq requeue`.
After a fixed dataset, index entries, done marks and dead-letter entries of samples or lines
no longer in it are pruned, so status counts only the dataset as it is.

Two enqueues of one run are serialized by a lock in Redis: the second one fails (exit 2)
instead of scanning in parallel and queueing every sample twice.

`recover_run` (`hsq recover`) is the same pass after a Redis loss: before enqueueing, every
output file already under <out>/<run>/ is checked against its dataset line and re-marked done.
The run's model and layers are never taken from one file (issue 23 item 3): they are the
run's recorded pins, or given (`--model-id`/`--layers`), or what the run's servers announce
in their readiness markers, or else what most valid files hold; files of another model or
layers are reported as stale and their samples enqueued again, never marked done.

A plain enqueue streams (`_enqueue_streaming`): the dataset is scanned in batches
(hsq/producer/fastscan.py) and each batch is decided, enqueued and indexed before the next is
read, with pipelined reads (one round trip of three HMGETs a batch); no list of every
sample is held. Whether an id already in the index is queued comes from the run's counters
(docs/queue.md): when they are exact and nothing is lost, an indexed id that is neither done
nor dead is queued or held; otherwise (counters missing or off, samples lost, the last
enqueue interrupted) every job is read, as before.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from hsq import logs
from hsq.dataset import IndexEntry, read_sample, scan_dataset
from hsq.errors import ConfigError, DatasetError
from hsq.outputs import ManifestEntry
from hsq.producer.fastscan import scan_batches
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import AnyRef, chunked

log = structlog.get_logger("hsq.producer")


@dataclass
class EnqueueReport:
    lines: int = 0
    valid: int = 0
    invalid: Counter[str] = field(default_factory=Counter)
    done: int = 0
    outstanding: int = 0
    dead: int = 0
    enqueued: int = 0
    chunks: int = 0
    pruned: int = 0
    recovered: int = 0
    rejected_files: dict[str, str] = field(default_factory=dict)
    stale: int = 0
    """Rejected files of another model or layers than the run's (also in rejected_files)."""
    identity: str = ""
    """How recover decided the run's model and layers, in words."""
    problems: list[str] = field(default_factory=list)

    def lines_out(self) -> list[str]:
        bad = sum(self.invalid.values())
        by_reason = ", ".join(f"{r}: {n}" for r, n in self.invalid.most_common())
        return [
            f"dataset lines   {self.lines}",
            f"valid samples   {self.valid}",
            f"invalid lines   {bad}" + (f" ({by_reason})" if bad else ""),
            f"already done    {self.done}",
            f"already queued  {self.outstanding}",
            f"in dead letter  {self.dead}",
            f"pruned          {self.pruned} entries no longer in the dataset",
            f"enqueued        {self.enqueued} samples in {self.chunks} jobs",
        ]

    def recover_lines(self) -> list[str]:
        lines = [
            f"recovered       {self.recovered} valid output files re-marked done",
            f"rejected files  {len(self.rejected_files)} (their samples are enqueued again)",
            f"stale files     {self.stale} of another model or layers (enqueued again)",
        ]
        return lines + ([f"identity        {self.identity}"] if self.identity else [])


def enqueue_run(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool = False,
    progress: bool = True,
    recover: bool = False,
    rejected: Sequence[tuple[str, DatasetError, str | None]] = (),
    hint: IdentityHint | None = None,
) -> EnqueueReport:
    """`rejected`: (key, error, id) of rows refused before the dataset was written (chat
    rows `hsq tokenize` could not use); they go to the dead letter as invalid lines do.
    `hint`: with `recover`, the model and layers given or announced by the run's servers."""
    cfg.validate()
    holder = f"{socket.gethostname()}:{os.getpid()}"
    with store.enqueue_lock(holder):
        if not recover:
            return _enqueue_streaming(
                store, cfg, strict=strict, progress=progress, rejected=rejected
            )
        return _enqueue_locked(
            store,
            cfg,
            strict=strict,
            progress=progress,
            recover=recover,
            rejected=rejected,
            hint=hint,
        )


def recover_run(
    store: RunStore, cfg: RunConfig, *, progress: bool = True, hint: IdentityHint | None = None
) -> EnqueueReport:
    """Rebuild a run's Redis state from its output directory (after a Redis loss). The run's
    model and layers: its recorded pins, else the hint (given, then announced by its
    servers), else the files' majority."""
    return enqueue_run(store, cfg, progress=progress, recover=True, hint=hint)


def _enqueue_locked(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool,
    progress: bool,
    recover: bool,
    rejected: Sequence[tuple[str, DatasetError, str | None]] = (),
    hint: IdentityHint | None = None,
) -> EnqueueReport:
    existing = store.load_config()
    if existing is not None:
        conflicts = existing.conflicts(cfg)
        if conflicts:
            raise ConfigError(
                f"run {cfg.run!r} exists with other settings: " + "; ".join(conflicts)
            )
    report = EnqueueReport()
    valid, bad = _scan(Path(cfg.dataset), cfg.max_tokens, report, progress)
    _add_rejected(report, bad, rejected)
    report.valid = len(valid)
    if strict and bad:
        raise DatasetError(
            f"--strict: {len(bad)} invalid line(s), nothing enqueued; first: "
            + "; ".join(report.problems[:5]),
            "strict",
        )
    if not valid:
        raise DatasetError("the dataset holds no valid sample", "empty_dataset")

    plan: RecoveryPlan | None = None
    if recover:  # read-only until the identity is decided: a refusal changes nothing
        plan = _plan_recovery(store, existing or cfg, valid, report, progress, hint)
        if existing is None and plan.identity is not None:
            cfg = replace(cfg, model_id=plan.identity[0], layer_ids=plan.identity[1])
    if existing is None:
        existing, _ = store.create_config(cfg)
    store.begin_enqueue()
    store.put_index(valid)
    store.set_totals(
        samples=len(valid), tokens=sum(e.num_tokens for _, e in valid), invalid_lines=len(bad)
    )
    for key, err, sid in bad:
        store.to_dead(key, err.reason, f"{err} (id {sid!r})" if sid else str(err), 0, None)
    report.pruned = _prune(store, {sid for sid, _ in valid}, {key for key, _, _ in bad})
    if plan is not None:
        _apply_recovery(store, plan, report)

    _enqueue_rest(store, valid, report, cfg.chunk_size)
    store.end_enqueue()
    _log_report(cfg, report)
    return report


def _enqueue_rest(
    store: RunStore, valid: list[tuple[str, IndexEntry]], report: EnqueueReport, chunk_size: int
) -> None:
    """Enqueue every valid sample that is neither done, queued or held, nor dead."""
    dead_ids = set(store.iter_hash_keys(store.keys.dead))
    outstanding = store.outstanding_samples()
    todo: list[tuple[str, IndexEntry]] = []
    for i in range(0, len(valid), 5000):
        batch = valid[i : i + 5000]
        done = store.done_among([sid for sid, _ in batch])
        for sid, entry in batch:
            if sid in done:
                report.done += 1
            elif sid in outstanding:
                report.outstanding += 1
            elif sid in dead_ids:
                report.dead += 1
            else:
                todo.append((sid, entry))
    chunks = list(chunked(todo, chunk_size))
    report.enqueued = store.enqueue(chunks)
    report.chunks = len(chunks)


def _log_report(cfg: RunConfig, report: EnqueueReport) -> None:
    log.info(
        "enqueued",
        run=cfg.run,
        enqueued=report.enqueued,
        chunks=report.chunks,
        done=report.done,
        outstanding=report.outstanding,
        invalid=sum(report.invalid.values()),
        pruned=report.pruned,
        recovered=report.recovered,
    )


STREAM_BATCH = 5000


def _enqueue_streaming(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool,
    progress: bool,
    rejected: Sequence[tuple[str, DatasetError, str | None]] = (),
) -> EnqueueReport:
    """`enqueue` without a recover pass, one batch at a time (module docstring)."""
    existing = store.load_config()
    if existing is not None:
        conflicts = existing.conflicts(cfg)
        if conflicts:
            raise ConfigError(
                f"run {cfg.run!r} exists with other settings: " + "; ".join(conflicts)
            )
    path = Path(cfg.dataset)
    report = EnqueueReport()
    if strict:  # refuse before writing anything: a first pass that only validates
        bad_first: Bad = []
        for b in scan_batches(path, cfg.max_tokens, batch=STREAM_BATCH, seen={}):
            bad_first += b.bad
        _add_rejected(EnqueueReport(), bad_first, rejected)
        if bad_first:
            probe = EnqueueReport()
            _count_bad(probe, bad_first)
            raise DatasetError(
                f"--strict: {len(bad_first)} invalid line(s), nothing enqueued; first: "
                + "; ".join(probe.problems[:5]),
                "strict",
            )
    seen: dict[str, int] = {}
    bad: Bad = []
    tokens = 0
    started = False
    exact: dict[str, str] | None = None  # id -> place of every queued sample, if needed
    pending: list[AnyRef] = []
    with logs.progress(path.stat().st_size, "B", "enqueueing", enabled=progress) as bar:
        for b in scan_batches(path, cfg.max_tokens, batch=STREAM_BATCH, seen=seen):
            bar.update(b.bytes)
            report.lines += b.lines
            bad += b.bad
            _count_bad(report, b.bad)
            if not b.valid:
                continue
            if not started:
                exact = _start(store, cfg, existing)
                started = True
            tokens += b.tokens
            pending += _decide(store, b.valid, exact, report, existing is not None)
            full = len(pending) - len(pending) % cfg.chunk_size
            _enqueue_chunks(store, cfg, pending[:full], report)
            del pending[:full]  # the rest waits for the next batch: chunks stay full
            # An interrupted enqueue leaves indexed samples in no queue: `begin_enqueue`'s
            # flag makes the next one look at every job.
            store.put_index(b.valid)
    _enqueue_chunks(store, cfg, pending, report)
    _add_rejected(report, bad, rejected)
    report.valid = len(seen)  # only valid lines' ids are recorded
    if not started:
        raise DatasetError("the dataset holds no valid sample", "empty_dataset")
    store.set_totals(samples=report.valid, tokens=tokens, invalid_lines=len(bad))
    for key, err, sid in bad:
        store.to_dead(key, err.reason, f"{err} (id {sid!r})" if sid else str(err), 0, None)
    report.pruned = _prune(store, seen.keys(), {key for key, _, _ in bad}, report.valid)
    store.end_enqueue()
    _log_report(cfg, report)
    return report


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
    interrupted = store.begin_enqueue()
    if existing is None:
        return None
    c = store.counts()
    if "counters" not in c.stats:
        store.recount_queues()  # a run made before counters: they start here
        return store.outstanding_samples()
    if interrupted or not c.consistent or c.stats.get("lost", 0) > 0:
        return store.outstanding_samples()
    return None


def _decide(
    store: RunStore,
    valid: list[tuple[str, str]],
    exact: dict[str, str] | None,
    report: EnqueueReport,
    existed: bool,
) -> list[AnyRef]:
    """The samples of a batch to enqueue: neither done, nor queued or held, nor dead."""
    if not existed:
        return list(valid)
    ids = [sid for sid, _ in valid]
    indexed, done, dead = store.presence(ids)
    todo: list[AnyRef] = []
    for ref, was_indexed, is_done, is_dead in zip(valid, indexed, done, dead, strict=True):
        queued = ref[0] in exact if exact is not None else was_indexed and not is_dead
        if is_done:
            report.done += 1
        elif queued:
            report.outstanding += 1
        elif is_dead:
            report.dead += 1
        else:
            todo.append(ref)
    return todo


def _count_bad(report: EnqueueReport, bad: Bad) -> None:
    for key, err, _ in bad:
        report.invalid[err.reason] += 1
        if len(report.problems) < 20:
            report.problems.append(f"{key.replace('line:', 'line ', 1)}: {err}")


def _prune(
    store: RunStore, valid_ids: Container[str], bad_lines: set[str], valid_count: int | None = None
) -> int:
    """Drop what no longer belongs to the dataset: index entries and done marks of removed
    ids (their files stay, `verify` lists them as orphans) and dead-letter entries of
    removed ids or of lines that are no longer invalid. `valid_count`: the index was just
    written with every valid id, so if it holds that many it holds nothing else (no scan)."""
    k = store.keys
    if valid_count is not None and store.count(k.index) == valid_count:
        gone_index: list[str] = []
    else:
        gone_index = [sid for sid in store.iter_hash_keys(k.index) if sid not in valid_ids]
    n = store.delete_fields(k.index, gone_index)
    for sid in gone_index:
        entry = store.get_manifest(sid)
        if entry is not None and store.undo_done(sid, entry):
            n += 1
    gone_dead = [
        key
        for key in store.iter_hash_keys(k.dead)
        if (key not in bad_lines if key.startswith("line:") else key not in valid_ids)
    ]
    return n + store.delete_fields(k.dead, gone_dead)


Identity = tuple[str, list[int]]
"""A run's model id and effective layer ids."""


@dataclass(frozen=True)
class IdentityHint:
    """What recover is told about the run's identity besides the files."""

    model_id: str | None = None
    """Given (--model-id)."""
    layer_ids: list[int] | None = None
    """Given (--layers)."""
    announced: Identity | None = None
    """What the run's servers announce in their readiness markers (--server-dump-dir)."""


@dataclass
class RecoveryPlan:
    identity: Identity | None
    """None: no valid file and nothing given; the first fully valid dump pins it."""
    adopt: list[tuple[str, ManifestEntry]]


def _plan_recovery(
    store: RunStore,
    cfg: RunConfig,
    valid: list[tuple[str, IndexEntry]],
    report: EnqueueReport,
    progress: bool,
    hint: IdentityHint | None,
) -> RecoveryPlan:
    """Check every file under OUT/RUN/ (read-only), decide the run's identity, and list the
    files to mark done: valid ones of that identity. The others are in report.rejected_files."""
    from hsq.adopt import adopt_output, file_identity

    out_root = Path(cfg.out) / cfg.run
    dataset = Path(cfg.dataset)
    ids = [sid for sid, _ in valid]
    already: set[str] = set()
    for i in range(0, len(ids), 5000):
        already |= store.done_among(ids[i : i + 5000])
    found: list[tuple[str, ManifestEntry, Identity]] = []
    with logs.progress(len(valid), "file", "checking", enabled=progress) as bar:
        for sid, entry in valid:
            bar.update()
            if sid in already:
                continue
            try:
                sample = read_sample(dataset, sid, entry)
            except DatasetError as exc:  # the dataset changed under us: enqueue, don't trust
                report.rejected_files[sid] = str(exc)
                continue
            manifest, why = adopt_output(out_root, sample, cfg.run, cfg.store_dtype)
            if manifest is None:
                if why != "missing":
                    report.rejected_files[sid] = why
                continue
            ident = file_identity(out_root / manifest.path)
            if ident is None:
                report.rejected_files[sid] = "model_id or layer_ids missing from the header"
                continue
            found.append((sid, manifest, ident))
    counts = Counter(_key(i) for _, _, i in found)
    identity, how = decide_identity(cfg, hint or IdentityHint(), counts)
    report.identity = how
    adopt = []
    for sid, manifest, ident in found:
        if ident == identity:
            adopt.append((sid, manifest))
        else:
            report.stale += 1
            report.rejected_files[sid] = f"stale: model {ident[0]} layers {ident[1]}, " + (
                f"the run's is model {identity[0]} layers {identity[1]}"
                if identity is not None
                else "not what was given"
            )
    for sid, why in list(report.rejected_files.items())[:20]:
        log.warning("recover_rejected_file", sample=sid, why=why)
    return RecoveryPlan(identity, adopt)


def _key(ident: Identity) -> tuple[str, tuple[int, ...]]:
    return ident[0], tuple(ident[1])


def decide_identity(
    cfg: RunConfig, hint: IdentityHint, counts: Counter[tuple[str, tuple[int, ...]]]
) -> tuple[Identity | None, str]:
    """The run's model and layers and how they were decided: recorded in the run, else
    given, else announced by its servers, else the files' majority (a tie is refused);
    each part separately, so a model given alone picks among the files of that model."""
    model, layers, source = cfg.model_id, cfg.layer_ids, "recorded in the run"
    if model is None or layers is None:
        source = "given"
        model = model if model is not None else hint.model_id
        layers = layers if layers is not None else hint.layer_ids
    if (model is None or layers is None) and hint.announced is not None:
        source = "announced by the run's servers"
        model = model if model is not None else hint.announced[0]
        layers = layers if layers is not None else hint.announced[1]
    total = sum(counts.values())
    if model is not None and layers is not None:
        n = counts.get((model, tuple(layers)), 0)
        return (model, list(layers)), f"{model} layers {layers} ({source}; {n} of {total} files)"
    fits = Counter(
        {
            k: n
            for k, n in counts.items()
            if (model is None or k[0] == model) and (layers is None or list(k[1]) == layers)
        }
    )
    ranked = fits.most_common()
    if not ranked:  # nothing to adopt: the run's first fully valid dump pins it, as usual
        return None, f"not decided: no valid file of what was given among {total} files"
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        tied = "; ".join(f"{n} files of model {m} layers {list(ls)}" for (m, ls), n in ranked)
        raise ConfigError(
            f"the run's files disagree with no majority ({tied}): pass --model-id and "
            "--layers, or --server-dump-dir of one of its servers; nothing was changed"
        )
    (m, ls), n = ranked[0]
    return (m, list(ls)), f"{m} layers {list(ls)} (majority: {n} of {total} files)"


def _apply_recovery(store: RunStore, plan: RecoveryPlan, report: EnqueueReport) -> None:
    if plan.identity is None:
        return
    model, layers = plan.identity
    recorded = store.pin_model(model, layers)  # HSETNX: a pin recorded meanwhile wins
    if recorded != (model, layers):
        raise ConfigError(f"the run pinned {recorded} meanwhile; nothing was marked done")
    for sid, manifest in plan.adopt:
        if store.mark_done(sid, manifest):
            report.recovered += 1


Bad = list[tuple[str, DatasetError, str | None]]


def _add_rejected(
    report: EnqueueReport, bad: Bad, rejected: Sequence[tuple[str, DatasetError, str | None]]
) -> None:
    for key, err, sid in rejected:
        bad.append((key, err, sid))
        report.invalid[err.reason] += 1
        if len(report.problems) < 20:
            report.problems.append(f"{key.removeprefix('line:')}: {err}")


def _scan(
    path: Path, max_tokens: int | None, report: EnqueueReport, progress: bool
) -> tuple[list[tuple[str, IndexEntry]], Bad]:
    valid: list[tuple[str, IndexEntry]] = []
    bad: Bad = []
    with logs.progress(path.stat().st_size, "B", "validating", enabled=progress) as bar:
        for item in scan_dataset(path, max_tokens):
            report.lines += 1
            if item.entry is not None and item.sample_id is not None:
                valid.append((item.sample_id, item.entry))
                bar.update(item.entry.length + 1)
            elif item.error is not None:
                bad.append((f"line:{item.line_no}", item.error, item.sample_id))
                report.invalid[item.error.reason] += 1
                if len(report.problems) < 20:
                    report.problems.append(f"line {item.line_no}: {item.error}")
    return valid, bad
