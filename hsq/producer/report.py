"""What an enqueue and a recover share: the report, the bad-line bookkeeping, the pruning of
entries no longer in the dataset, the run-settings check and the lock holder's name."""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import structlog

from hsq.errors import ConfigError, DatasetError
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore

log = structlog.get_logger("hsq.producer")

Rejected = tuple[str, DatasetError, str | None]
"""(dead-letter key, error, sample id if known) of a dataset line or chat row refused."""
Bad = list[Rejected]


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
    spool: str = ""
    """A streamed run's line on its budget against the largest sample (hsq.producer.
    spoolcheck), or on when that is checked; empty for a run without a stream."""

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
            *([self.spool] if self.spool else []),
        ]

    def recover_lines(self) -> list[str]:
        lines = [
            f"recovered       {self.recovered} valid output files re-marked done",
            f"rejected files  {len(self.rejected_files)} (their samples are enqueued again)",
            f"stale files     {self.stale} of another model or layers (enqueued again)",
        ]
        return lines + ([f"identity        {self.identity}"] if self.identity else [])


def lock_holder() -> str:
    """Who holds the run's enqueue lock, as a second enqueue is told."""
    return f"{socket.gethostname()}:{os.getpid()}"


def refuse_conflicts(existing: RunConfig | None, cfg: RunConfig) -> None:
    """A run that exists keeps its dataset, output root, pins and storage format."""
    if existing is not None and (conflicts := existing.conflicts(cfg)):
        raise ConfigError(f"run {cfg.run!r} exists with other settings: " + "; ".join(conflicts))


def count_bad(report: EnqueueReport, bad: Bad) -> None:
    for key, err, _ in bad:
        report.invalid[err.reason] += 1
        if len(report.problems) < 20:
            report.problems.append(f"{key.replace('line:', 'line ', 1)}: {err}")


def add_rejected(report: EnqueueReport, bad: Bad, rejected: Sequence[Rejected]) -> None:
    """Rows refused before the dataset was written (by `hsq tokenize`) count as bad lines."""
    for key, err, sid in rejected:
        bad.append((key, err, sid))
        report.invalid[err.reason] += 1
        if len(report.problems) < 20:
            report.problems.append(f"{key.removeprefix('line:')}: {err}")


def dead_letter_bad(store: RunStore, bad: Bad) -> None:
    for key, err, sid in bad:
        store.to_dead(key, err.reason, f"{err} (id {sid!r})" if sid else str(err), 0, None)


def prune(
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


def log_report(run: str, report: EnqueueReport) -> None:
    """The `enqueued` log line, for the commands whose output is their log (`hsq enqueue`,
    `hsq recover`); `hsq run` and `hsq demo` say it in their own view instead."""
    log.info(
        "enqueued",
        run=run,
        enqueued=report.enqueued,
        chunks=report.chunks,
        done=report.done,
        outstanding=report.outstanding,
        invalid=sum(report.invalid.values()),
        pruned=report.pruned,
        recovered=report.recovered,
    )
