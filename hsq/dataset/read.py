"""A worker's O(1) read of one sample: seek to its index entry, read the line, check its
CRC (a dataset edited after enqueue is refused, never silently read), decode it (the fast
msgspec path first, hsq.dataset.jsonl.parse_line for anything else). A module of its own,
above both decoders, so that neither imports the other's module back."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from hsq.dataset import jsonl
from hsq.errors import DatasetError


def read_sample(path: Path, sample_id: str, entry: jsonl.IndexEntry) -> jsonl.Sample:
    """O(1) read of one sample; refuses a line whose bytes changed since indexing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise DatasetError(f"cannot open dataset {path}: {exc}", "dataset_unreadable") from exc
    if not 0 <= entry.length <= jsonl.MAX_LINE_BYTES or entry.offset < 0:
        raise DatasetError(f"index entry of {sample_id!r} is implausible", "dataset_changed")
    try:
        body = os.pread(fd, entry.length, entry.offset)
    except OSError as exc:  # EIO and friends: the file, not the sample, is at fault
        raise DatasetError(f"cannot read dataset {path}: {exc}", "dataset_unreadable") from exc
    finally:
        os.close(fd)
    if len(body) != entry.length or zlib.crc32(body) != entry.crc:
        raise DatasetError(
            f"dataset line of {sample_id!r} changed since it was enqueued", "dataset_changed"
        )
    from hsq.dataset.fastline import fast_line  # msgspec: loaded by the first read only

    sample = fast_line(body) or jsonl.parse_line(body)
    if sample.id != sample_id:
        raise DatasetError(f"index points at {sample.id!r}, not {sample_id!r}", "dataset_changed")
    return sample
