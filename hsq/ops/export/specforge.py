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
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, cast

from hsq.ops.export.common import (
    ExportReport,
    ExportRequest,
    checked_entry,
    log_exported,
    run_files,
    without_consumed,
)
from hsq.ops.export.passes import Exported, export_pass, save_in, write_all
from hsq.outputs.format import OutputSample, output_relpath
from hsq.outputs.manifest import ManifestEntry

if TYPE_CHECKING:
    from hsq.runstore import RunStore

CKPT = ".ckpt"
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


def _save(dest: Path, rel: str, tensors: dict[str, Any]) -> int:
    import torch

    def fill(fd: int) -> None:
        with open(fd, "wb", closefd=False) as f:
            sink = _Sink(f)
            try:
                torch.save(tensors, cast("IO[bytes]", sink))  # write and flush are enough
            except RuntimeError:
                # torch.save turns a failed write (ENOSPC: "unexpected pos ...") into a
                # RuntimeError: raise the OSError it hid, so a full disk reads as one.
                if sink.error is not None:
                    raise sink.error from None
                raise

    return save_in(dest, rel, fill)


class _Sink:
    """The file torch.save writes to, keeping the OSError of a failed write."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def export_specforge(store: RunStore, req: ExportRequest) -> ExportReport:
    files = run_files(store, req)
    t0 = time.perf_counter()
    report = ExportReport()
    cast: set[str] = set()
    with export_pass(
        report,
        req.dest,
        KIND,
        temps=CKPT,
        names=lambda n: n.endswith((CKPT, CKPT + ".gz")),
        prune=req.prune,
    ) as (dest, ledger):

        def one(item: tuple[str, ManifestEntry | None]) -> Exported:
            sid, raw = item
            entry = checked_entry(sid, raw)
            rel = ckpt_relpath(sid)
            if ledger.is_current(rel, sid, entry.checksum):
                return Exported(sid, rel, entry.checksum, None)
            out = files.read(sid, entry)
            dtype = str(out.aux_hidden_states.dtype).removeprefix("torch.")
            if dtype != "bfloat16":
                cast.add(dtype)
            return Exported(sid, rel, entry.checksum, _save(dest, rel, specforge_tensors(out)))

        write_all(
            report,
            ledger,
            without_consumed(store, report),
            one,
            lambda item: item[0],
            jobs=req.jobs,
            on_progress=req.on_progress,
        )
    for dtype in sorted(cast):
        report.notes.append(f"{dtype} states written as bfloat16 (SpecForge's LM head is bf16)")
    if files.layers is not None:
        report.notes.append(layer_note(files.layers))
    log_exported(report, store.run, "specforge", t0, stale=len(report.stale), bytes=report.bytes)
    return report


def layer_note(layers: list[int]) -> str:
    sglang = [i - 1 for i in layers]
    return (
        f"layers: HF hidden_states {layers} = SGLang/SpecForge ids {sglang} on a Llama-family "
        "target; --target-model writes them into draft_config.json (docs/training.md)"
    )
