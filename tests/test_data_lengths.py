"""hsq.data's `lengths` without manifest.jsonl: read from each output
file's header, not -1. Real output files (bench.scale writes them as the worker does)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from bench.scale_outputs import output_bytes
from hsq.data import HiddenStateDataset
from hsq.errors import OutputError
from hsq.outputs.format import output_relpath


def write(root: Path, sid: str, n: int) -> None:
    path = root / output_relpath(sid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(output_bytes(sid, "len", list(range(1, n + 1))))


def test_lengths_without_a_manifest_come_from_the_file_headers(tmp_path: Path) -> None:
    want = {"a": 3, "b": 17, "c": 1, "d": 40}
    for sid, n in want.items():
        write(tmp_path, sid, n)
    ds = HiddenStateDataset(tmp_path)
    assert ds.lengths == [want[item.sample_id] for item in ds.items]
    assert ds.lengths == [int(ds[i]["input_ids"].shape[0]) for i in range(len(ds))]
    # What DataLoader workers (and a sampler built from a pickled dataset) get.
    assert pickle.loads(pickle.dumps(ds)).lengths == ds.lengths


def test_a_damaged_file_is_named_when_lengths_are_read(tmp_path: Path) -> None:
    write(tmp_path, "ok", 5)
    bad = tmp_path / output_relpath("bad")
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    ds = HiddenStateDataset(tmp_path)
    with pytest.raises(OutputError, match=re.escape(output_relpath("bad"))):
        ds.lengths  # noqa: B018
