"""`hsq export`: a run's outputs in the layout a trainer reads.

`specforge`: one `<shard>/<id>.ckpt` per done sample, `torch.save` (zipfile format, so
SpecForge's `torch.load(mmap=True)` works) of
    input_ids int64 [T], loss_mask int64 [T],
    hidden_state [1, T, H] (post-norm), aux_hidden_state [1, T, k*H] (run's layer order),
each a contiguous tensor with its own storage. Files are written to a dot-named temp and
renamed (hsq.outputs.write_durably), so a killed export leaves nothing SpecForge's
`list_feature_files` (names ending in .ckpt) would pick up; a file already there and valid
is skipped, so a second run writes nothing.

`manifest`: `manifest.jsonl` in the run's output directory, the list hsq.data reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from hsq.data import MANIFEST
from hsq.errors import ConfigError, DatasetError, OutputError
from hsq.outputs import ManifestEntry, open_output, output_relpath, write_durably

if TYPE_CHECKING:
    from hsq.store import RunStore

log = structlog.get_logger("hsq.app.export")

CKPT = ".ckpt"
SPECFORGE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


@dataclass
class ExportReport:
    samples: int = 0
    written: int = 0
    skipped: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)

    def lines_out(self) -> list[str]:
        mb = self.bytes / 2**20
        rate = mb / self.seconds if self.seconds else 0.0
        return [
            f"samples   {self.samples}",
            f"written   {self.written} files, {self.bytes} bytes ({mb:.1f} MiB, {rate:.0f} MiB/s)",
            f"skipped   {self.skipped} (already valid)",
            f"failed    {len(self.failed)}",
            f"time      {self.seconds:.1f} s",
        ]


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


def ckpt_path(dest: Path, sample_id: str) -> Path:
    """`<shard>/<id>.ckpt`, the same shard as the output (id already checked)."""
    return dest / Path(output_relpath(sample_id)).parent / f"{sample_id}{CKPT}"


def specforge_tensors(path: Path, sample_id: str, expect: list[int] | None) -> dict[str, Any]:
    out = open_output(path)
    if out.sample_id != sample_id:
        raise OutputError(f"{path} holds {out.sample_id!r}, not {sample_id!r}")
    if expect is not None and out.layer_ids != expect:
        raise OutputError(f"{path} has layers {out.layer_ids}, not {expect}")
    # clone: contiguous tensors with their own storage, so torch.save writes only them.
    return {
        "input_ids": out.input_ids.clone(),
        "loss_mask": out.loss_mask.clone(),
        "hidden_state": out.last_hidden_state.unsqueeze(0).clone(),
        "aux_hidden_state": out.aux_hidden_states.unsqueeze(0).clone(),
    }


def is_valid_ckpt(path: Path, num_tokens: int) -> bool:
    """An existing export file that loads (mmap, weights only) with the right keys and T."""
    import torch

    if not path.exists():
        return False
    try:
        raw = torch.load(path, mmap=True, weights_only=True)
        return (
            isinstance(raw, dict)
            and all(k in raw for k in SPECFORGE_KEYS)
            and list(raw["input_ids"].shape) == [num_tokens]
            and list(raw["loss_mask"].shape) == [num_tokens]
            and raw["hidden_state"].shape[:2] == (1, num_tokens)
            and raw["aux_hidden_state"].shape[:2] == (1, num_tokens)
        )
    except Exception:  # a torn or foreign file: rewrite it
        return False


def _save(path: Path, tensors: dict[str, Any]) -> int:
    import torch

    def fill(fd: int) -> None:
        with open(fd, "wb", closefd=False) as f:
            torch.save(tensors, f)

    write_durably(path, fill)
    return path.stat().st_size


def export_one(
    root: Path, dest: Path, sample_id: str, raw: ManifestEntry | None, expect: list[int] | None
) -> int | None:
    """Bytes written, or None when a valid file was already there."""
    entry = checked_entry(sample_id, raw)
    target = ckpt_path(dest, sample_id)
    if is_valid_ckpt(target, entry.num_tokens):
        return None
    return _save(target, specforge_tensors(root / entry.path, sample_id, expect))


def _clear_temps(dest: Path) -> None:
    """Temp files of an export that was killed (never picked up by SpecForge: not .ckpt)."""
    if not dest.is_dir():
        return
    for dirpath, _dirs, files in os.walk(dest):
        for name in files:
            if name.startswith(".") and name.endswith(".tmp") and CKPT in name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))


def export_specforge(
    store: RunStore,
    root: Path,
    dest: Path,
    *,
    jobs: int = 4,
    partial: bool = False,
    expect_layers: list[int] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> ExportReport:
    check_complete(store, partial)
    check_layers(store, expect_layers)
    t0 = time.perf_counter()
    report = ExportReport()
    _clear_temps(dest)
    dest.mkdir(parents=True, exist_ok=True)

    def one(item: tuple[str, ManifestEntry | None]) -> tuple[str, int | None, str | None]:
        sid, entry = item
        try:
            return sid, export_one(root, dest, sid, entry, expect_layers), None
        except OutputError as exc:
            return sid, None, str(exc)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        # map is lazy over the HSCAN iterator in windows, so 100k entries never pile up.
        for sid, nbytes, error in _window_map(pool, one, store.iter_manifest(), 4 * jobs):
            report.samples += 1
            if error is not None:
                report.failed[sid] = error
                log.warning("export_failed", sample_id=sid, error=error)
            elif nbytes is None:
                report.skipped += 1
            else:
                report.written += 1
                report.bytes += nbytes
            if on_progress is not None:
                on_progress(1)
    report.seconds = time.perf_counter() - t0
    log.info(
        "exported",
        run=store.run,
        format="specforge",
        written=report.written,
        skipped=report.skipped,
        failed=len(report.failed),
        bytes=report.bytes,
        seconds=round(report.seconds, 2),
    )
    return report


def _window_map(
    pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterator[Any], window: int
) -> Iterator[Any]:
    pending: list[Any] = []
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.pop(0).result()
    for fut in pending:
        yield fut.result()


def export_manifest(store: RunStore, root: Path, *, partial: bool = False) -> int:
    """Write `root/manifest.jsonl` (sorted by path) from the run's manifest; returns lines."""
    check_complete(store, partial)
    rows = []
    for sid, raw in store.iter_manifest():
        try:
            e = checked_entry(sid, raw)
        except OutputError as exc:
            log.warning("manifest_entry_skipped", sample_id=sid, error=str(exc))
            continue
        line = {"id": sid, "path": e.path, "num_tokens": e.num_tokens, "bytes": e.bytes}
        rows.append((e.path, json.dumps(line)))
    rows.sort()
    text = "".join(line + "\n" for _, line in rows).encode()
    write_durably(root / MANIFEST, lambda fd: os.write(fd, text))
    return len(rows)
