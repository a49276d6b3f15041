"""Real output files for bench.scale's verify and recover steps: a run of n tiny outputs
written as a worker would leave them (files on disk, done marks and index in Redis), and
dropping their pages from the page cache for the cold rows."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from hsq.dump.format import LAYER_CONVENTION, fingerprint
from hsq.outputs.format import OUTPUT_FORMAT, output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.states import AUX_TENSOR, LAST_TENSOR
from hsq.stfile.header import build_header
from hsq.store import connect


def mark(store: RunStore, entries: list[tuple[str, ManifestEntry]]) -> None:
    many = getattr(store, "mark_done_many", None)
    if many is not None:
        many(entries)
    else:  # an hsq from before the batch call (the "before" figures)
        for sid, e in entries:
            store.mark_done(sid, e)


def output_bytes(sid: str, run: str, tokens: list[int]) -> bytes:
    """A real (tiny) output file: 3 aux layers of hidden size 8, bf16 zeros."""
    n, hidden, layers = len(tokens), 8, [1, 2, 3]
    meta = {
        "format": OUTPUT_FORMAT,
        "sample_id": sid,
        "run": run,
        "layer_ids": json.dumps(layers),
        "layer_convention": LAYER_CONVENTION,
        "model_id": "bench/tiny@0",
        "num_tokens": str(n),
        "input_fingerprint": fingerprint(tokens),
        "store_dtype": "bf16",
    }
    aux, last = 2 * n * hidden * len(layers), 2 * n * hidden
    header = build_header(
        [
            ("input_ids", "I64", [n], 8 * n),
            ("loss_mask", "I64", [n], 8 * n),
            (AUX_TENSOR, "BF16", [n, hidden * len(layers)], aux),
            (LAST_TENSOR, "BF16", [n, hidden], last),
        ],
        meta,
    )
    ints = struct.pack(f"<{n}q", *tokens) + struct.pack(f"<{n}q", *([1] * n))
    return header + ints + bytes(aux + last)


def make_outputs(work: Path, run: str, n: int, url: str) -> tuple[Path, Path]:
    """A dataset of n 4-token samples, every output file written, each sample marked done
    (mark_done_many, 500 a call) as a worker would have. Returns (dataset, out root).

    Fast enough for a million files: ids have one length, so each file is one of 1,000
    templates (tokens [i % 1000, 7, 8, 9]) with its id put in, written by os.open/os.write
    (no fsync: verify reads what the page cache holds, as after any worker's write)."""
    ds, out = work / f"{run}.jsonl", work / "out"
    store = RunStore(connect(url), run)
    store.create_config(RunConfig(run=run, dataset=str(ds), out=str(out)))
    root = out / run
    placeholder = "v" + "0" * 8
    templates: dict[int, bytes] = {}
    made: set[str] = set()
    batch: list[tuple[str, ManifestEntry]] = []
    index: list[tuple[str, str]] = []
    offset = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with open(ds, "wb", buffering=2**20) as f:
        for i in range(n):
            sid = f"v{i:08d}"
            k = i % 1000
            tpl = templates.get(k)
            if tpl is None:
                tpl = templates[k] = output_bytes(placeholder, run, [k, 7, 8, 9])
                assert tpl.count(f'"{placeholder}"'.encode()) == 1
            data = tpl.replace(f'"{placeholder}"'.encode(), f'"{sid}"'.encode(), 1)
            line = f'{{"id": "{sid}", "input_ids": [{k}, 7, 8, 9], "loss_mask": [1, 1, 1, 1]}}'
            f.write(line.encode() + b"\n")
            index.append((sid, f"{offset}:{len(line)}:0:4"))
            offset += len(line) + 1
            rel = output_relpath(sid)
            shard = rel[:2]
            if shard not in made:
                (root / shard).mkdir(parents=True, exist_ok=True)
                made.add(shard)
            fd = os.open(root / rel, flags, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            batch.append((sid, ManifestEntry(rel, 4, len(data), "crc32:0", "bench", 0.0, 0)))
            if len(batch) >= 500:
                mark(store, batch)
                store.config_index.put_index(index)
                batch, index = [], []
    mark(store, batch)
    store.config_index.put_index(index)
    store.set_totals(samples=n, tokens=4 * n, invalid_lines=0)
    return ds, out


def evict_pages(root: Path) -> int:
    """Drop the page-cache pages of every file under root (posix_fadvise DONTNEED; no root
    needed, nothing else's cache touched): verify then reads them from the disk. Inodes and
    directory entries stay cached. Returns the number of files."""
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n
