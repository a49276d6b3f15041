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
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from hsq import jsonsafe, logs
from hsq.dataset import IndexEntry, read_sample, scan_dataset
from hsq.errors import ConfigError, DatasetError
from hsq.runconfig import RunConfig
from hsq.store import RunStore, chunked

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
        return [
            f"recovered       {self.recovered} valid output files re-marked done",
            f"rejected files  {len(self.rejected_files)} (their samples are enqueued again)",
        ]


def enqueue_run(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool = False,
    progress: bool = True,
    recover: bool = False,
    rejected: Sequence[tuple[str, DatasetError, str | None]] = (),
) -> EnqueueReport:
    """`rejected`: (key, error, id) of rows refused before the dataset was written (chat
    rows `hsq tokenize` could not use); they go to the dead letter as invalid lines do."""
    cfg.validate()
    holder = f"{socket.gethostname()}:{os.getpid()}"
    with store.enqueue_lock(holder):
        return _enqueue_locked(
            store, cfg, strict=strict, progress=progress, recover=recover, rejected=rejected
        )


def recover_run(store: RunStore, cfg: RunConfig, *, progress: bool = True) -> EnqueueReport:
    """Rebuild a run's Redis state from its output directory (after a Redis loss)."""
    return enqueue_run(store, cfg, progress=progress, recover=True)


def _enqueue_locked(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool,
    progress: bool,
    recover: bool,
    rejected: Sequence[tuple[str, DatasetError, str | None]] = (),
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

    if existing is None:
        existing, _ = store.create_config(cfg)
    store.put_index(valid)
    store.set_totals(
        samples=len(valid), tokens=sum(e.num_tokens for _, e in valid), invalid_lines=len(bad)
    )
    for key, err, sid in bad:
        store.to_dead(key, err.reason, f"{err} (id {sid!r})" if sid else str(err), 0, None)
    report.pruned = _prune(store, {sid for sid, _ in valid}, {key for key, _, _ in bad})
    if recover:
        _recover_outputs(store, existing, valid, report, progress)

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
    chunks = list(chunked(todo, cfg.chunk_size))
    report.enqueued = store.enqueue(chunks)
    report.chunks = len(chunks)
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
    return report


def _prune(store: RunStore, valid_ids: set[str], bad_lines: set[str]) -> int:
    """Drop what no longer belongs to the dataset: index entries and done marks of removed
    ids (their files stay, `verify` lists them as orphans) and dead-letter entries of
    removed ids or of lines that are no longer invalid."""
    k = store.keys
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


def _recover_outputs(
    store: RunStore,
    cfg: RunConfig,
    valid: list[tuple[str, IndexEntry]],
    report: EnqueueReport,
    progress: bool,
) -> None:
    from hsq.adopt import adopt_output

    out_root = Path(cfg.out) / cfg.run
    dataset = Path(cfg.dataset)
    ids = [sid for sid, _ in valid]
    already = set()
    for i in range(0, len(ids), 5000):
        already |= store.done_among(ids[i : i + 5000])
    pinned: tuple[str, list[int]] | None = None
    with logs.progress(len(valid), "file", "recovering", enabled=progress) as bar:
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
            if pinned is None:
                pinned = _pin_from_file(store, out_root / manifest.path)
            if pinned != _identity(out_root / manifest.path):
                report.rejected_files[sid] = f"model or layers differ from the run's {pinned}"
                continue
            if store.mark_done(sid, manifest):
                report.recovered += 1
    for sid, why in list(report.rejected_files.items())[:20]:
        log.warning("recover_rejected_file", sample=sid, why=why)


def _identity(path: Path) -> tuple[str, list[int]] | None:
    from hsq.outputs import read_header

    meta = read_header(path).metadata
    try:
        layers = jsonsafe.loads(meta.get("layer_ids", "null"))
    except ValueError:
        return None
    model = meta.get("model_id")
    if not isinstance(model, str) or not isinstance(layers, list):
        return None
    return model, layers


def _pin_from_file(store: RunStore, path: Path) -> tuple[str, list[int]] | None:
    """The run's model and layers: the config's, or pinned from the first valid file."""
    ident = _identity(path)
    if ident is None:
        return None
    return store.pin_model(*ident)


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
