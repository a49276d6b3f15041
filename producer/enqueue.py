"""`hsq enqueue`: validate a dataset, record the run, enqueue what is neither done nor queued.

Idempotent: done samples, samples already queued or held by a worker, and samples in the
dead letter are skipped, so a second run of the same command enqueues nothing and a run
after a partial extraction enqueues only the rest. Failures are requeued with `hsq requeue`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from tqdm import tqdm

from hsq.dataset import IndexEntry, scan_dataset
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
            f"enqueued        {self.enqueued} samples in {self.chunks} jobs",
        ]


def enqueue_run(
    store: RunStore,
    cfg: RunConfig,
    *,
    strict: bool = False,
    progress: bool = True,
    rejected: Sequence[tuple[str, DatasetError, str | None]] = (),
) -> EnqueueReport:
    """`rejected`: (key, error, id) of rows refused before the dataset was written (chat
    rows `hsq tokenize` could not use); they go to the dead letter as invalid lines do."""
    cfg.validate()
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
        store.save_config(cfg)
    store.put_index(valid)
    store.set_totals(
        samples=len(valid), tokens=sum(e.num_tokens for _, e in valid), invalid_lines=len(bad)
    )
    for key, err, sid in bad:
        store.to_dead(key, err.reason, f"{err} (id {sid!r})" if sid else str(err), 0, None)

    dead_ids = set(store.iter_hash_keys(store.k.dead))
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
    )
    return report


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
    with tqdm(
        total=path.stat().st_size,
        unit="B",
        unit_scale=True,
        desc="validating",
        disable=not progress,
        mininterval=0.5,
    ) as bar:
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
