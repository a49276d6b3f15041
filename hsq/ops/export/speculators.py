"""`hsq export --format speculators`: what vLLM speculators 0.9.0's offline trainer reads
(`speculators.train.data.ArrowDataset(max_len, DEST)`).

    DEST/                                   an Arrow dataset (`datasets.save_to_disk`, torch
                                            format): one row per exported sample, sorted by
                                            id: input_ids, loss_mask (int64 lists), seq_len,
                                            and hsq's id
    DEST/hidden_states/hs_{i}.safetensors   row i's states: token_ids int64 [T] and
                                            hidden_states [T, k+1, H] = the k aux layers in
                                            the run's order, then the final layer BEFORE the
                                            model's norm (speculators applies the verifier's
                                            norm itself)
    DEST/token_freq.pt                      loss-masked token counts, from which its trainer
                                            builds the draft vocabulary mapping

hsq's `last_hidden_state` is after the norm (RMSNorm cannot be undone), so this format needs
runs whose outputs also hold `last_hidden_state_prenorm` (the enqueue-time pre-norm option);
others are refused. The Arrow dataset needs the `datasets` package (the extra
`hidden-state-queue[speculators]`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq import fsio
from hsq.errors import ConfigError, OutputError
from hsq.ops.export.common import (
    ExportReport,
    ExportRequest,
    Ledger,
    checked_entry,
    log_exported,
    run_files,
    save_file,
    without_consumed,
)
from hsq.ops.export.passes import Exported, export_pass, save_in, write_all
from hsq.outputs.format import OutputSample, read_header
from hsq.outputs.manifest import ManifestEntry
from hsq.states import PRENORM_TENSOR, scale_name

if TYPE_CHECKING:
    from hsq.runstore import RunStore

KIND = "speculators-v1"
HS_DIR = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
ARROW_FILES = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")
_HS_NAME = re.compile(r"hs_\d+\.safetensors")


def _is_hs_file(name: str) -> bool:
    return _HS_NAME.fullmatch(name) is not None


def hs_relpath(index: int) -> str:
    return f"{HS_DIR}/hs_{index}.safetensors"


def prenorm_state(path: Path, out: OutputSample) -> Any:
    """The pre-norm final state [T, H] of an output (bf16 for fp8 files), checked finite."""
    import torch
    from safetensors import safe_open

    from hsq import quant

    t = getattr(out, "last_hidden_state_prenorm", None)  # hsq.open_output, where it has it
    if t is None:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if PRENORM_TENSOR not in names:
                raise OutputError(f"{path} has no {PRENORM_TENSOR}")
            t = f.get_tensor(PRENORM_TENSOR)
            sname = scale_name(PRENORM_TENSOR)
            if sname in names:
                t = quant.dequantize(t, f.get_tensor(sname))
    want = list(out.last_hidden_state.shape)
    if list(t.shape) != want:
        raise OutputError(f"{PRENORM_TENSOR} shape {list(t.shape)}, expected {want}")
    if not bool(torch.isfinite(t).all()):
        raise OutputError(f"corrupt output: {PRENORM_TENSOR} holds NaN or Inf")
    return t


def speculators_tensors(out: OutputSample, prenorm: Any) -> dict[str, Any]:
    import torch

    n, h = out.last_hidden_state.shape
    aux = out.aux_hidden_states.reshape(n, -1, h)
    states = torch.cat([aux, prenorm.to(aux.dtype).unsqueeze(1)], dim=1).contiguous()
    return {"token_ids": out.input_ids.clone(), "hidden_states": states}


def _require_prenorm(root: Path, entries: list[tuple[str, ManifestEntry]], run: str) -> None:
    if not entries:
        return
    _sid, entry = entries[0]
    try:
        names = read_header(root / entry.path).tensors
    except (OSError, ValueError, OutputError) as exc:
        raise ConfigError(f"cannot read {root / entry.path}: {exc}") from exc
    require_prenorm_run(PRENORM_TENSOR in names, run)


def require_prenorm_run(prenorm: bool, run: str) -> None:
    """A run without the pre-norm state cannot become a speculators dataset: say so, and
    how to extract one, before anything is written."""
    if not prenorm:
        raise ConfigError(
            f"run {run!r} has no pre-norm final state ({PRENORM_TENSOR}): speculators trains on "
            "the last layer BEFORE the norm, which hsq's post-norm last_hidden_state cannot "
            "give back. Extract a new run with `hsq run DATASET --out OUT --prenorm` (its "
            "servers get --prenorm; with servers of your own: `hsq enqueue --prenorm` and "
            "each server started with --prenorm), see docs/training.md"
        )


def export_speculators(store: RunStore, req: ExportRequest) -> ExportReport:
    try:
        from datasets import Dataset
    except ImportError as exc:
        raise ConfigError(
            f"--format speculators writes an Arrow dataset and needs `datasets` ({exc}): "
            "pip install 'hidden-state-queue[speculators]'"
        ) from exc
    files = run_files(store, req)
    entries: list[tuple[str, ManifestEntry]] = []
    report = ExportReport()
    for sid, raw in without_consumed(store, report):
        try:
            entries.append((sid, checked_entry(sid, raw)))
        except OutputError as exc:
            report.failed[sid] = str(exc)
    entries.sort()
    _require_prenorm(req.root, entries, store.run)
    t0 = time.perf_counter()
    with export_pass(
        report, req.dest, KIND, temps=".safetensors", names=_is_hs_file, prune=req.prune
    ) as (
        dest,
        ledger,
    ):
        for old in dest.glob(".hsq-arrow-*.tmp"):  # a killed export's dataset directory
            shutil.rmtree(old, ignore_errors=True)

        def one(item: tuple[int, tuple[str, ManifestEntry]]) -> Exported:
            i, (sid, entry) = item
            rel = hs_relpath(i)
            if ledger.is_current(rel, sid, entry.checksum):
                return Exported(sid, rel, entry.checksum, None)
            out = files.read(sid, entry)
            tensors = speculators_tensors(out, prenorm_state(req.root / entry.path, out))
            return Exported(sid, rel, entry.checksum, _save(dest, rel, tensors))

        written = write_all(
            report,
            ledger,
            enumerate(entries),
            one,
            lambda item: item[1][0],
            jobs=req.jobs,
            on_progress=req.on_progress,
        )
        rows = {i: (got.sample, got.rel, got.source, entry) for (i, (_, entry)), got in written}
        n_rows = _write_rows(Dataset, rows, req.root, dest, ledger)
    log_exported(report, store.run, "speculators", t0, rows=n_rows)
    return report


def _write_rows(
    dataset_cls: Any,
    rows: dict[int, tuple[str, str, str, ManifestEntry]],
    root: Path,
    dest: Path,
    ledger: Ledger,
) -> int:
    """The Arrow dataset and token_freq.pt for the exported rows. Rows are contiguous: a
    failed sample's slot is closed up by renaming the files after it down (the trainer
    pairs row i with hs_i). Token ids are gathered into one int64 buffer (8 bytes a token),
    never into Python lists."""
    import numpy as np
    import pyarrow as pa

    from hsq.outputs.format import open_output

    order = sorted(rows)
    lengths = np.array([rows[i][3].num_tokens for i in order], dtype=np.int64)
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids_buf = np.empty(int(offsets[-1]), dtype=np.int64)
    mask_buf = np.empty(int(offsets[-1]), dtype=np.int64)
    for k, i in enumerate(order):
        sid, rel, source, entry = rows[i]
        if rel != hs_relpath(k):
            os.rename(dest / rel, dest / hs_relpath(k))
            ledger.seen.discard(rel)
            ledger.record(hs_relpath(k), sid, source)
        out = open_output(root / entry.path)  # mapped: only the two int64 tensors are read
        if out.num_tokens != entry.num_tokens:
            raise OutputError(
                f"{sid}: {out.num_tokens} tokens, the manifest says {entry.num_tokens}"
            )
        ids_buf[offsets[k] : offsets[k + 1]] = out.input_ids.numpy()
        mask_buf[offsets[k] : offsets[k + 1]] = out.loss_mask.numpy()
    lists = pa.LargeListArray if offsets[-1] >= 2**31 else pa.ListArray
    off = pa.array(offsets, type=pa.int64() if lists is pa.LargeListArray else pa.int32())
    table = pa.table(
        {
            "id": pa.array([rows[i][0] for i in order], type=pa.string()),
            "input_ids": lists.from_arrays(off, pa.array(ids_buf)),
            "loss_mask": lists.from_arrays(off, pa.array(mask_buf)),
            "seq_len": pa.array(lengths),
        }
    )
    _write_dataset(dataset_cls, table, dest)
    masked = ids_buf[mask_buf.astype(bool)]
    values, counts = np.unique(masked, return_counts=True)
    freq = {int(v): int(c) for v, c in zip(values, counts, strict=True)}
    _write_token_freq(freq, dest / TOKEN_FREQ)
    return len(order)


def _save(dest: Path, rel: str, tensors: dict[str, Any]) -> int:
    from safetensors.torch import save

    blob = save(tensors)

    def fill(fd: int) -> None:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]

    return save_in(dest, rel, fill)


def _write_dataset(dataset_cls: Any, table: Any, dest: Path) -> None:
    """save_to_disk into a dot-named directory, then rename its files into DEST (state.json
    last), so a killed export never leaves a torn Arrow file under the names the trainer
    loads."""
    from datasets.table import InMemoryTable

    ds = dataset_cls(InMemoryTable(table))
    ds.set_format(type="torch")
    tmp = dest / f".hsq-arrow-{secrets.token_hex(4)}.tmp"
    try:
        ds.save_to_disk(str(tmp))
        got = sorted(p.name for p in tmp.iterdir())
        if got != sorted(ARROW_FILES):
            raise OutputError(f"datasets wrote {got}, expected {sorted(ARROW_FILES)}")
        for name in ARROW_FILES:
            fsio.fsync_path(tmp / name)
            os.replace(tmp / name, dest / name)
        fsio.fsync_path(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_token_freq(counts: dict[int, int], path: Path) -> None:
    import torch

    def fill(fd: int) -> None:
        with open(fd, "wb", closefd=False) as f:
            torch.save(counts, f)

    save_file(path, fill)
