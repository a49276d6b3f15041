"""Where `hsq enqueue`'s CPU goes, part by part, in one process (BENCHMARKS.md 5, fifth round).

    python -m bench.enqueue_parts DATASET [--pieces 20] [--map 3000000] [--repeat 5]

Scanning processes' side, on the first piece of DATASET (best of --repeat, CPU time): the
whole `scan_piece` with and without the index HSET packing, then its parts (read, split,
the fast path's decode and checks, crc32, the entry text). The enqueue process's side, on
--pieces pieces: unpickling them, settling duplicates against an id map of --map ids, and
RQ's job creation at chunk 1024 (job_kwargs, the JSON of a job, the zlib of it that RQ's
Job.to_dict does). Every figure is microseconds of CPU per valid line.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsq.producer import fastscan
from hsq.store.jobs import JOB_FUNC, job_kwargs


def best(fn: Callable[[], Any], repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        out = min(out, time.process_time() - t0)
    return out


def scan_parts(path: Path, repeat: int) -> dict[str, float]:
    end = fastscan.PIECE_BYTES
    p = fastscan.scan_piece(path, 0, end, None, None, "k", 5000)
    n = len(p.ids)
    with open(path, "rb") as f:
        buf = f.read(end)
    lines = buf.split(b"\n")[:-1]
    fast, crc = fastscan._fast_count, zlib.crc32

    def us(fn: Callable[[], Any]) -> float:
        return round(best(fn, repeat) / n * 1e6, 3)

    return {
        "lines": n,
        "scan_piece": us(lambda: fastscan.scan_piece(path, 0, end, None, None, "k", 5000)),
        "scan_piece_without_packing": us(lambda: fastscan.scan_piece(path, 0, end, None)),
        "read": us(lambda: open(path, "rb").read(end)),
        "split": us(lambda: buf.split(b"\n")),
        "fast_count": us(lambda: [fast(x, None) for x in lines]),
        "crc32": us(lambda: [crc(x) for x in lines]),
        "entry_text": us(lambda: [f"{i}:{len(x)}:{crc(x)}:64" for i, x in enumerate(lines)]),
        "pickle_piece": us(lambda: pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)),
    }


def enqueue_parts(path: Path, pieces: int, map_size: int) -> dict[str, float]:
    size = fastscan.PIECE_BYTES
    got = [
        fastscan.scan_piece(path, i * size, (i + 1) * size, None, None, "k") for i in range(pieces)
    ]
    blobs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in got]
    n = sum(len(p.ids) for p in got)
    out: dict[str, float] = {"lines": n}

    def us(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.process_time()
        r = fn()
        out[name] = round((time.process_time() - t0) / n * 1e6, 3)
        return r

    ps = us("unpickle", lambda: [pickle.loads(b) for b in blobs])
    seen = {f"z{i:09d}": i for i in range(map_size)}  # the map as it is well into a large run

    def settle() -> list[tuple[str, str]]:
        valid: list[tuple[str, str]] = []
        base = 0
        for p in ps:  # scan_batches' usual case: no duplicate
            firsts = dict(zip(p.ids, map(base.__add__, p.line_nos), strict=True))
            assert len(firsts) == len(p.ids) and seen.keys().isdisjoint(firsts)
            seen.update(firsts)
            valid += zip(p.ids, p.entries, strict=True)
            base += p.physical
        return valid

    valid = us("settle", settle)
    chunks = [valid[i : i + 1024] for i in range(0, len(valid), 1024)]
    kws = us("job_kwargs", lambda: [job_kwargs("r", c, 0, None) for c in chunks])
    data = us("job_json", lambda: [json.dumps([JOB_FUNC, None, [], k]).encode() for k in kws])
    us("job_zlib", lambda: [zlib.compress(d) for d in data])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", type=Path)
    ap.add_argument("--pieces", type=int, default=20)
    ap.add_argument("--map", type=int, default=3_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps({"scan_us_per_line": scan_parts(args.dataset, args.repeat)}))
    parts = enqueue_parts(args.dataset, args.pieces, args.map)
    print(json.dumps({"enqueue_us_per_line": parts}))


if __name__ == "__main__":
    main()
