"""`hsq export --format specforge`: the files SpecForge 0.2.0's offline trainer reads.

One `<shard>/<id>.ckpt` per done sample, `torch.save` (zipfile format, so SpecForge's
`torch.load(mmap=True)` works) of
    input_ids int64 [T], loss_mask int64 [T],
    hidden_state [1, T, H] (post-norm), aux_hidden_state [1, T, k*H] (run's layer order),
each a contiguous bfloat16 tensor with its own storage. bfloat16 always: SpecForge's
LM-head step (`TargetHead`) is hard-wired to bf16 and a float32 or float16 state crashes it
("expected m1 and m2 to have the same dtype"), so other dump dtypes are cast (fp8 runs are
dequantized to bf16 by hsq.open_output).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq.app.export.common import (
    ExportReport,
    Ledger,
    check_complete,
    check_layers,
    checked_entry,
    clear_temps,
    ensure_dir,
    log,
    prepare_dest,
    read_verified,
    save_file,
    sweep_stale,
    timed,
    walk_files,
    window_map,
)
from hsq.errors import OutputError
from hsq.outputs import ManifestEntry, OutputSample, output_relpath

if TYPE_CHECKING:
    from hsq.runstore import RunStore

CKPT = ".ckpt"
SPECFORGE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
KIND = "specforge-bf16-v1"
"""The ledger's format tag: a change to what a .ckpt holds must change it."""


def ckpt_relpath(sample_id: str) -> str:
    """`<shard>/<id>.ckpt`, the same shard as the output (the id is checked there)."""
    return str(Path(output_relpath(sample_id)).parent / f"{sample_id}{CKPT}")


def ckpt_path(dest: Path, sample_id: str) -> Path:
    return dest / ckpt_relpath(sample_id)


def specforge_tensors(out: OutputSample) -> dict[str, Any]:
    import torch

    def state(t: Any) -> Any:
        # bf16 copy, contiguous with its own storage (torch.save writes only it).
        return t.unsqueeze(0).to(torch.bfloat16).clone()

    return {
        "input_ids": out.input_ids.clone(),
        "loss_mask": out.loss_mask.clone(),
        "hidden_state": state(out.last_hidden_state),
        "aux_hidden_state": state(out.aux_hidden_states),
    }


def _save(path: Path, tensors: dict[str, Any]) -> int:
    import torch

    def fill(fd: int) -> None:
        with open(fd, "wb", closefd=False) as f:
            torch.save(tensors, f)

    return save_file(path, fill)


def export_specforge(
    store: RunStore,
    root: Path,
    dest: Path,
    *,
    jobs: int = 4,
    partial: bool = False,
    expect_layers: list[int] | None = None,
    prune: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> ExportReport:
    check_complete(store, partial)
    layers = check_layers(store, expect_layers)
    store_dtype = store.require_config().store_dtype
    t0 = time.perf_counter()
    report = ExportReport()
    dest = prepare_dest(dest)
    clear_temps(dest, CKPT)
    ledger = Ledger(dest, KIND)
    cast: set[str] = set()

    def one(item: tuple[str, ManifestEntry | None]) -> tuple[str, str, str, int | None]:
        sid, raw = item
        entry = checked_entry(sid, raw)
        rel = ckpt_relpath(sid)
        if ledger.is_current(rel, sid, entry.checksum):
            return sid, rel, entry.checksum, None
        out = read_verified(root, sid, entry, store_dtype)
        if expect_layers is not None and out.layer_ids != expect_layers:
            raise OutputError(f"layers {out.layer_ids}, not {expect_layers}")
        dtype = str(out.aux_hidden_states.dtype).removeprefix("torch.")
        if dtype != "bfloat16":
            cast.add(dtype)
        ensure_dir(dest, Path(rel).parent)
        return sid, rel, entry.checksum, _save(dest / rel, specforge_tensors(out))

    def guarded(item: tuple[str, ManifestEntry | None]) -> tuple[Any, ...]:
        try:
            return (*one(item), None)
        except (OutputError, OSError) as exc:
            return item[0], None, None, None, str(exc)

    done = False
    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for sid, rel, source, nbytes, error in window_map(
                pool, guarded, store.iter_manifest(), 4 * jobs
            ):
                report.samples += 1
                if error is not None:
                    report.failed[sid] = error
                    log.warning("export_failed", sample_id=sid, error=error)
                elif nbytes is None:
                    ledger.keep(rel)
                    report.skipped += 1
                else:
                    ledger.record(rel, sid, source)
                    report.written += 1
                    report.bytes += nbytes
                if on_progress is not None:
                    on_progress(1)
        names = walk_files(dest, lambda n: n.endswith((CKPT, CKPT + ".gz")))
        sweep_stale(report, dest, names, ledger, prune)
        done = True
    finally:
        ledger.close(compact=done)
    for dtype in sorted(cast):
        report.notes.append(f"{dtype} states written as bfloat16 (SpecForge's LM head is bf16)")
    if layers is not None:
        report.notes.append(layer_note(layers))
    timed(report, t0)
    log.info(
        "exported",
        run=store.run,
        format="specforge",
        written=report.written,
        skipped=report.skipped,
        failed=len(report.failed),
        stale=len(report.stale),
        bytes=report.bytes,
        seconds=round(report.seconds, 2),
    )
    return report


def layer_note(layers: list[int]) -> str:
    sglang = [i - 1 for i in layers]
    return (
        f"layers: HF hidden_states {layers} = SGLang/SpecForge ids {sglang} on a Llama-family "
        "target; --target-model writes them into draft_config.json (docs/training.md)"
    )
