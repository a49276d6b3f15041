"""What every export format shares: the run checks, a verified read of each output, the
destination's rules (no writing through a symlink) and the ledger that makes a re-export
exact.

"Already valid" means "equal to this run's current valid output": the ledger
(`DEST/.hsq-export.jsonl`) records, per exported file, the source output's checksum (the
manifest's) and the file's identity as written (inode, size, mtime). A file is skipped only
when both still match; anything else under the export's names (a stale export of an earlier
run, a NaN file someone put there, a symlink to a foreign file) is rewritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from hsq.errors import ConfigError, DatasetError, OutputError
from hsq.fsio import write_durably
from hsq.outputs.check import check_output, file_checksum
from hsq.outputs.format import OutputSample, open_output, output_relpath
from hsq.outputs.manifest import ManifestEntry

if TYPE_CHECKING:
    from hsq.runstore import RunStore

log = structlog.get_logger("hsq.ops.export")

LEDGER = ".hsq-export.jsonl"
MAX_LEDGER_LINE = 4096
"""Longer lines are not ours: the ledger lives in DEST and is read as untrusted."""


@dataclass
class ExportReport:
    samples: int = 0
    written: int = 0
    skipped: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)
    """Files under the export's names in DEST that this export did not produce (left
    there unless pruned: a trainer would read them)."""
    pruned: int = 0
    notes: list[str] = field(default_factory=list)

    def lines_out(self) -> list[str]:
        mb = self.bytes / 2**20
        rate = mb / self.seconds if self.seconds else 0.0
        lines = [
            f"samples   {self.samples}",
            f"written   {self.written} files, {self.bytes} bytes ({mb:.1f} MiB, {rate:.0f} MiB/s)",
            f"skipped   {self.skipped} (already this run's current output)",
            f"failed    {len(self.failed)}",
        ]
        if self.stale or self.pruned:
            lines.append(f"stale     {len(self.stale)} left, {self.pruned} removed (--prune)")
        lines.append(f"time      {self.seconds:.1f} s")
        return lines + [f"note      {n}" for n in self.notes]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.stale


CONSUMED_PAGE = 1000


def without_consumed(
    store: RunStore, report: ExportReport | None = None
) -> Iterator[tuple[str, ManifestEntry | None]]:
    """The run's manifest less a streamed run's consumed samples (every consumer group
    committed them and their files were removed by design: trained, not lost), counted in
    the report's notes; a page of ids is looked up at a time."""
    streamed = store.require_config().streamed
    page: list[tuple[str, ManifestEntry | None]] = []
    gone = 0

    def flush() -> Iterator[tuple[str, ManifestEntry | None]]:
        nonlocal gone
        flags = store.spool.consumed_of([sid for sid, _ in page]) if streamed else []
        for item, consumed in zip(page, flags or [False] * len(page), strict=True):
            if consumed:
                gone += 1
            else:
                yield item
        page.clear()

    for item in store.iter_manifest():
        page.append(item)
        if len(page) >= CONSUMED_PAGE:
            yield from flush()
    yield from flush()
    if gone:
        log.info("export_consumed_skipped", run=store.run, samples=gone)
        if report is not None:
            report.notes.append(
                f"{gone} samples consumed by the stream (trained, files removed): not exported"
            )


def check_complete(store: RunStore, partial: bool) -> None:
    """Refuse a run with samples neither done nor dead, unless `partial`."""
    total = store.count(store.keys.index)
    done = store.count(store.keys.done)
    dead = sum(1 for k in store.iter_hash_keys(store.keys.dead) if not k.startswith("line:"))
    remaining = total - done - dead
    if remaining > 0 and not partial:
        raise ConfigError(
            f"run {store.run!r} is not complete: {remaining} of {total} samples neither done "
            "nor dead; wait for it (`hsq status`), or pass --partial to export what is done"
        )


def check_layers(store: RunStore, expect: list[int] | None) -> list[int] | None:
    layers = store.require_config().layer_ids
    if expect is not None and layers is not None and layers != expect:
        raise ConfigError(
            f"run {store.run!r} captured layers {layers}, not --expect-layers {expect} "
            "(hsq records HF hidden_states indices; see docs/training.md)"
        )
    return layers


def checked_entry(sample_id: str, entry: ManifestEntry | None) -> ManifestEntry:
    """A manifest entry from Redis whose path is the one hsq derives from the id (never a
    path taken on trust: it decides where files are read and written)."""
    if entry is None:
        raise OutputError("damaged manifest entry")
    try:
        want = output_relpath(sample_id)
    except DatasetError as exc:
        raise OutputError(f"unsafe sample id: {exc}") from exc
    if entry.path != want:
        raise OutputError(f"manifest path {entry.path!r} is not {want!r}")
    return entry


def read_verified(
    root: Path, sample_id: str, entry: ManifestEntry, store_dtype: str | None
) -> OutputSample:
    """The output of `sample_id`, if it passes what `hsq verify --deep` checks: a regular
    file under the run's directory, header and shapes as the manifest says, the checksum the
    worker recorded, finite states, input_ids matching the recorded fingerprint. OutputError
    naming the problem otherwise (export never copies a corrupt output)."""
    import torch

    from hsq.dump.format import fingerprint

    path = root / entry.path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise OutputError("missing output file") from None
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{path} is not a regular file")
    if not path.resolve().is_relative_to(root.resolve()):
        raise OutputError(f"{path} resolves outside {root}")
    problems = check_output(path, sample_id, entry, store_dtype=store_dtype)
    if problems:
        raise OutputError("corrupt output: " + "; ".join(problems))
    if file_checksum(path) != entry.checksum:
        raise OutputError("corrupt output: checksum mismatch (`hsq verify --deep --requeue`)")
    out = open_output(path)
    if out.sample_id != sample_id:
        raise OutputError(f"{path} holds {out.sample_id!r}, not {sample_id!r}")
    for name, t in (
        ("aux_hidden_states", out.aux_hidden_states),
        ("last_hidden_state", out.last_hidden_state),
    ):
        if not bool(torch.isfinite(t).all()):
            raise OutputError(f"corrupt output: {name} holds NaN or Inf")
    if out.metadata.get("input_fingerprint") != fingerprint(out.input_ids):
        raise OutputError("corrupt output: input_ids do not match the recorded fingerprint")
    return out


@dataclass(frozen=True)
class RunFiles:
    """The run's outputs an export reads, the run checked first (`run_files`)."""

    root: Path
    """OUT/RUN/ as mounted here."""
    store_dtype: str
    layers: list[int] | None
    """The layers the run recorded."""
    expect_layers: list[int] | None
    """--expect-layers: every output must hold these."""

    def read(self, sample_id: str, entry: ManifestEntry) -> OutputSample:
        """`read_verified`, and the output's layers are the expected ones."""
        out = read_verified(self.root, sample_id, entry, self.store_dtype)
        if self.expect_layers is not None and out.layer_ids != self.expect_layers:
            raise OutputError(f"layers {out.layer_ids}, not {self.expect_layers}")
        return out


@dataclass(frozen=True)
class ExportRequest:
    """What `hsq export` asks of a file format (`export_specforge`, `export_speculators`)."""

    root: Path
    """The run's outputs, OUT/RUN/ as mounted here."""
    dest: Path
    jobs: int = 4
    """Files written at once."""
    partial: bool = False
    """Export a run that is not complete yet."""
    expect_layers: list[int] | None = None
    prune: bool = False
    """Remove files under the format's names in DEST that this export did not produce."""
    on_progress: Callable[[int], None] | None = None


def run_files(store: RunStore, req: ExportRequest) -> RunFiles:
    """The run's outputs, once the run is complete (or the request `partial`) and
    recorded the expected layers (check_complete, check_layers)."""
    check_complete(store, req.partial)
    layers = check_layers(store, req.expect_layers)
    return RunFiles(req.root, store.require_config().store_dtype, layers, req.expect_layers)


def ensure_dir(dest: Path, rel: str | Path) -> Path:
    """DEST/rel as a real directory, created where missing. OutputError where a part is a
    symlink or not a directory: an export never writes through a link out of DEST."""
    cur = dest
    for part in Path(rel).parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(cur)
            st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            raise OutputError(f"{cur} is a symlink; hsq export never writes through one")
        if not stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{cur} is not a directory")
    return cur


def prepare_dest(dest: Path) -> Path:
    """DEST, created; its own path is the user's choice (a link there is followed once)."""
    dest.mkdir(parents=True, exist_ok=True)
    return dest.resolve()


def save_file(path: Path, fill: Callable[[int], object]) -> int:
    """Write `path` durably (temp, fsync, rename: a killed export leaves only dot-named
    temps) and return its size. A symlink at `path` is replaced, never followed."""
    write_durably(path, fill)
    return os.lstat(path).st_size


def clear_temps(dest: Path, marker: str) -> None:
    """Temp files a killed export left (dot-named `.tmp`, never read by a trainer)."""
    if not dest.is_dir():
        return
    for dirpath, dirs, files in os.walk(dest):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
        for name in files:
            if name.startswith(".") and name.endswith(".tmp") and marker in name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))


@dataclass(frozen=True)
class Written:
    """One exported file as the ledger records it."""

    sample: str
    source: str
    """The source output's checksum (the run's manifest entry)."""
    ino: int
    size: int
    mtime_ns: int


class Ledger:
    """What this destination holds, per exported file (relative path): which sample, from
    which source checksum, and the file's identity when written.

    Appended after each file is durably in place (a killed export loses at most the lines
    of files it then rewrites); rewritten compactly at the end of an export."""

    def __init__(self, dest: Path, kind: str) -> None:
        self.dest = dest
        self.kind = kind
        self.path = dest / LEDGER
        self.entries: dict[str, Written] = {}
        self.seen: set[str] = set()
        self._load()
        self._append = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if self.path.stat().st_size == 0:
            self._write_line({"hsq_export": self.kind})

    def _load(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{self.path} is not a regular file; remove it")
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = iter(f)
            head = _parse(next(lines, ""))
            if head is None or head.get("hsq_export") != self.kind:
                # Another format or version wrote it: nothing it lists counts as current.
                f.close()
                os.unlink(self.path)
                return
            for line in lines:
                obj = _parse(line)
                if obj is None:
                    continue  # a torn last line, or not ours
                try:
                    rel = obj["file"]
                    w = Written(
                        str(obj["sample"]),
                        str(obj["source"]),
                        int(obj["ino"]),
                        int(obj["size"]),
                        int(obj["mtime_ns"]),
                    )
                except (KeyError, TypeError, ValueError):
                    continue
                if isinstance(rel, str):
                    self.entries[rel] = w

    def _write_line(self, obj: dict[str, Any]) -> None:
        self._append.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._append.flush()

    def is_current(self, rel: str, sample: str, source: str) -> bool:
        """The file at `rel` is the one this ledger wrote for `sample` from `source`."""
        w = self.entries.get(rel)
        if w is None or w.sample != sample or w.source != source:
            return False
        try:
            st = os.lstat(self.dest / rel)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_size, st.st_mtime_ns) == (
            w.ino,
            w.size,
            w.mtime_ns,
        )

    def keep(self, rel: str) -> None:
        self.seen.add(rel)

    def record(self, rel: str, sample: str, source: str) -> None:
        st = os.lstat(self.dest / rel)
        w = Written(sample, source, st.st_ino, st.st_size, st.st_mtime_ns)
        self.entries[rel] = w
        self.seen.add(rel)
        self._write_line({"file": rel, **w.__dict__})

    def close(self, compact: bool = True) -> None:
        """Rewrite the ledger with the files of this export only, durably (`compact`), or
        just stop appending (an export that did not finish keeps every line)."""
        self._append.close()
        if not compact:
            return
        lines = [json.dumps({"hsq_export": self.kind})]
        for rel in sorted(self.seen):
            w = self.entries.get(rel)
            if w is not None:
                lines.append(json.dumps({"file": rel, **w.__dict__}, separators=(",", ":")))
        data = ("\n".join(lines) + "\n").encode()
        write_durably(self.path, lambda fd: os.write(fd, data))


def _parse(line: str) -> dict[str, Any] | None:
    if len(line) > MAX_LEDGER_LINE:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def timed(report: ExportReport, t0: float) -> ExportReport:
    report.seconds = time.perf_counter() - t0
    return report


def log_exported(report: ExportReport, run: str, fmt: str, t0: float, **extra: Any) -> None:
    """The export's time in the report, and its one `exported` log line."""
    timed(report, t0)
    counts = {"written": report.written, "skipped": report.skipped, "failed": len(report.failed)}
    log.info("exported", run=run, format=fmt, **counts, **extra, seconds=round(report.seconds, 2))
