"""The pass every file-per-sample format makes over a run (specforge, speculators): the
destination prepared and its temps cleared, one file per sample written by a pool with a
bounded window, the ledger kept, and what the export did not produce swept at the end.

A format supplies the function that writes one sample's file (or finds it current) and the
names its files have; the accounting (written, skipped, failed, bytes), the ledger and the
stale sweep are here, once.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hsq.errors import OutputError
from hsq.ops.export.common import (
    ExportReport,
    Ledger,
    clear_temps,
    ensure_dir,
    log,
    prepare_dest,
    save_file,
)

T = TypeVar("T")


class DiskFullError(OutputError):
    """The destination is full: the export stops (exit 1) instead of failing each sample."""


def disk_full(exc: BaseException | None) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception's chain (hsq.fsio wraps the OSError)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@dataclass(frozen=True)
class Exported:
    """One sample's file in DEST, as the ledger records it."""

    sample: str
    rel: str
    """Its path relative to DEST."""
    source: str
    """The source output's checksum (the run's manifest entry)."""
    nbytes: int | None
    """Bytes written; None: the file there already is this run's current output."""


@contextlib.contextmanager
def export_pass(
    report: ExportReport,
    dest: Path,
    kind: str,
    *,
    temps: str,
    names: Callable[[str], bool],
    prune: bool,
) -> Iterator[tuple[Path, Ledger]]:
    """(DEST resolved, its ledger of format `kind`) for the body of an export. Temps a
    killed export left (dot-named, holding `temps`) are removed first. At the end, files
    whose name passes `names` and that this export did not produce are removed with
    `prune`, else listed as stale; the ledger is compacted to this export's files, or, if
    the body failed, keeps every line."""
    dest = prepare_dest(dest)
    clear_temps(dest, temps)
    ledger = Ledger(dest, kind)
    try:
        yield dest, ledger
        sweep_stale(report, dest, walk_files(dest, names), ledger, prune)
    except BaseException:
        ledger.close(compact=False)
        raise
    ledger.close(compact=True)


def write_all(
    report: ExportReport,
    ledger: Ledger,
    items: Iterable[T],
    write: Callable[[T], Exported],
    sample_of: Callable[[T], str],
    *,
    jobs: int,
    on_progress: Callable[[int], None] | None,
) -> list[tuple[T, Exported]]:
    """`write` each item on `jobs` threads, at most 4 * jobs in flight, in order. A sample
    whose write raises OutputError or OSError is failed with its reason (the others go on);
    the rest are counted and recorded in the ledger. Returns the items that succeeded."""

    def guarded(item: T) -> tuple[T, Exported | None, str]:
        try:
            return item, write(item), ""
        except (OutputError, OSError) as exc:
            if disk_full(exc):  # every later file would fail too: stop, keep what is written
                raise DiskFullError(
                    f"disk full writing {sample_of(item)}'s file: free space, then run the "
                    "same command again (it resumes: the files written so far are kept)"
                ) from exc
            return item, None, str(exc)

    ok: list[tuple[T, Exported]] = []
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for item, got, error in window_map(pool, guarded, items, 4 * jobs):
            report.samples += 1
            if got is None:
                report.failed[sample_of(item)] = error
                log.warning("export_failed", sample_id=sample_of(item), error=error)
            else:
                if got.nbytes is None:
                    ledger.keep(got.rel)
                    report.skipped += 1
                else:
                    ledger.record(got.rel, got.sample, got.source)
                    report.written += 1
                    report.bytes += got.nbytes
                ok.append((item, got))
            if on_progress is not None:
                on_progress(1)
    return ok


def save_in(dest: Path, rel: str, fill: Callable[[int], object]) -> int:
    """DEST/rel written durably by `fill` (its directories made, none a symlink); its size."""
    ensure_dir(dest, Path(rel).parent)
    return save_file(dest / rel, fill)


def sweep_stale(
    report: ExportReport, dest: Path, names: Iterable[str], ledger: Ledger, prune: bool
) -> None:
    """Files under the export's names (`names`: paths relative to DEST) that this export
    did not produce: removed with `prune`, else listed in the report (and the export fails:
    a trainer reading DEST would train on them)."""
    for rel in sorted(set(names) - ledger.seen):
        if prune:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest / rel)
            report.pruned += 1
        else:
            report.stale.append(rel)


def walk_files(dest: Path, keep: Callable[[str], bool]) -> Iterator[str]:
    """Relative paths of files (and symlinks) under DEST whose name passes `keep`; symlinked
    directories are not entered."""
    for dirpath, dirs, files in os.walk(dest):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
        links = [d for d in os.listdir(dirpath) if os.path.islink(os.path.join(dirpath, d))]
        for name in {*files, *links}:
            if keep(name):
                yield os.path.relpath(os.path.join(dirpath, name), dest)


def window_map(
    pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any], window: int
) -> Iterator[Any]:
    """pool.map over `items` with at most `window` in flight (the HSCAN iterator of a 100k
    run never piles up)."""
    pending: list[Any] = []
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.pop(0).result()
    for fut in pending:
        yield fut.result()
