"""Adopting an output file that is already on disk: `recover` and `enqueue --recover` check
it as thoroughly as a worker checked the dump it came from (header, token ids against the
dataset line, every tensor, finite states) before marking the sample done."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsq.dataset import Sample
from hsq.errors import HsqError
from hsq.outputs import SUFFIX, ManifestEntry, check_output, file_checksum, output_relpath


def detect_store_dtype(out_root: Path) -> str | None:
    """The storage format of the first readable output file under out_root (a run holds one)."""
    from hsq.quant import store_dtype_of

    header = _first_header(out_root, lambda h: store_dtype_of(h.metadata))
    return None if header is None else store_dtype_of(header.metadata)


def detect_prenorm(out_root: Path) -> bool | None:
    """Whether the first readable output file under out_root stores the pre-norm state."""
    from hsq.quant import PRENORM

    header = _first_header(out_root)
    return None if header is None else PRENORM in header.tensors


def _first_header(out_root: Path, check: Callable[[Any], object] | None = None) -> Any:
    from hsq.outputs import read_header

    if not out_root.is_dir():
        return None
    for dirpath, _dirs, files in os.walk(out_root):
        for name in sorted(files):
            if name.endswith(SUFFIX):
                try:
                    header = read_header(Path(dirpath) / name)
                    if check is not None:
                        check(header)
                    return header
                except (OSError, ValueError, HsqError):
                    continue
    return None


def adopt_output(
    out_root: Path,
    sample: Sample,
    run: str,
    store_dtype: str | None = None,
    prenorm: bool = False,
) -> tuple[ManifestEntry | None, str]:
    """Check an existing output file of `sample` as `recover` does: header, every tensor,
    token ids against the dataset line (fingerprint and values), finite states; returns
    (a manifest entry with the file's checksum, "") or (None, why not)."""
    from hsq.outputs import read_header
    from hsq.protocol import fingerprint

    rel = output_relpath(sample.id)
    path = out_root / rel
    try:
        size = path.stat().st_size
        meta = read_header(path).metadata
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as exc:
        return None, f"unreadable header: {exc}"
    n = len(sample.input_ids)
    wanted = {
        "sample_id": sample.id,
        "run": run,
        "num_tokens": str(n),
        "input_fingerprint": fingerprint(sample.input_ids),
    }
    for key, want in wanted.items():
        if meta.get(key) != want:
            return None, f"{key} {str(meta.get(key))[:80]!r} is not {want[:80]!r}"
    from hsq.quant import store_dtype_of

    entry = ManifestEntry(
        path=rel,
        num_tokens=n,
        bytes=size,
        checksum=file_checksum(path),
        worker="recover",
        time=time.time(),
        attempt=0,
        store_dtype=store_dtype_of(meta),
    )
    if store_dtype is not None and entry.store_dtype != store_dtype:
        return None, f"stored as {entry.store_dtype}, the run stores {store_dtype}"
    problems = _tensor_problems(path, sample)
    if not problems:  # both formats' tensor checks (fp8: scales, no NaN; bf16: finite)
        problems = "; ".join(check_output(path, sample.id, entry, deep=True, prenorm=prenorm))
    if problems:
        return None, problems
    return entry, ""


def _tensor_problems(path: Path, sample: Sample) -> str:
    import torch
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for damaged files
        return f"unreadable tensors: {exc}"
    n = len(sample.input_ids)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    if "input_ids" not in t or t["input_ids"].tolist() != sample.input_ids:
        return "input_ids differ from the dataset line"
    if "loss_mask" not in t or t["loss_mask"].tolist() != mask:
        return "loss_mask differs from the dataset line"
    for name in ("aux_hidden_states", "last_hidden_state"):
        x = t.get(name)
        if x is None or x.dim() != 2 or x.shape[0] != n:
            return f"{name} missing or of the wrong shape"
        if x.dtype != torch.float8_e4m3fn and not bool(torch.isfinite(x).all()):
            return f"{name} holds NaN or Inf"
    return ""
