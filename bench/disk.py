"""The output disk's best durable write rate, and what hsq's own writer reaches on it.

Each design writes `total_mb` in files of `file_mb`, every file fsynced before it counts:
  one stream       buffered writes + fsync, one file after another (the old storage bound)
  buffered xN      N threads doing the same on their own files
  direct xN        N threads writing with O_DIRECT from a page-aligned buffer, then fsync
  stfile xN        N threads through hsq's WriteEngine (read from a tmpfs source into its
                   buffers, checksum, write, as the worker's persist stage does), with and
                   without its O_DIRECT path
The storage bound is the best of the plain designs; the stfile rows say whether hsq's writer
gets there.

    python -m bench.disk --dir /root/bw --total-mb 2048
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hsq.stfile.engine import Range, WriteEngine
from hsq.stfile.header import build_header

CHUNK = 8 * 2**20


def _buffered(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = data
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _direct(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for at in range(0, len(data), CHUNK):  # data is page-aligned, sizes a multiple of 4k
            chunk = data[at : at + CHUNK]
            while chunk:
                n = os.pwrite(fd, chunk, at)
                chunk, at = chunk[n:], at + n
        os.fsync(fd)
    finally:
        os.close(fd)


def _stfile(engine: WriteEngine, src_fd: int, nbytes: int) -> Callable[[Path, memoryview], None]:
    header = build_header([("x", "U8", [nbytes], nbytes)], None)

    def write(path: Path, _data: memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            engine.write(fd, header, [Range(src_fd, 0, nbytes)])
            os.fsync(fd)
        finally:
            os.close(fd)

    return write


def _rate(
    directory: Path, writers: int, files: int, data: memoryview, one: Callable[..., None]
) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"bw{i}.bin" for i in range(files)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        for f in [pool.submit(one, p, data) for p in paths]:
            f.result()
    elapsed = time.perf_counter() - t0
    for p in paths:
        p.unlink()
    return files * len(data) / elapsed


def probe(
    directory: Path,
    total_mb: int = 1024,
    file_mb: int = 64,
    writers: tuple[int, ...] = (4, 8),
    with_stfile: bool = True,
) -> dict[str, object]:
    """GB/s per design, the best plain design and its rate (bytes/s) as `best_bytes_s`."""
    files = max(1, total_mb // file_mb)
    buf = mmap.mmap(-1, file_mb * 2**20)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(file_mb * 2**20))
    data = memoryview(buf)
    rates: dict[str, float] = {"one stream": _rate(directory, 1, files, data, _buffered)}
    for n in writers:
        rates[f"buffered x{n}"] = _rate(directory, n, files, data, _buffered)
    for n in (1, *writers):
        try:
            rates[f"direct x{n}"] = _rate(directory, n, files, data, _direct)
        except OSError:  # tmpfs or a filesystem without O_DIRECT
            break
    best = max(rates, key=lambda k: rates[k])
    result: dict[str, object] = {
        "gb_s": {k: round(v / 1e9, 3) for k, v in rates.items()},
        "best": best,
        "best_bytes_s": rates[best],
        "one_stream_bytes_s": rates["one stream"],
    }
    if with_stfile:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        src = Path(tempfile.mkstemp(prefix="hsq-bw-src-", dir=shm)[1])
        src.write_bytes(data)
        sfd = os.open(src, os.O_RDONLY)
        try:
            for label, direct in (("stfile x2, O_DIRECT", True), ("stfile x2, buffered", False)):
                with WriteEngine(direct_io=direct) as engine:
                    r = _rate(directory, 2, files, data, _stfile(engine, sfd, len(data)))
                result["gb_s"][label] = round(r / 1e9, 3)  # type: ignore[index]
        finally:
            os.close(sfd)
            src.unlink()
    data.release()
    buf.close()
    shutil.rmtree(directory, ignore_errors=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="[default: a temp dir]")
    ap.add_argument("--total-mb", type=int, default=1024)
    ap.add_argument("--file-mb", type=int, default=64)
    args = ap.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="hsq-bw-")) / "bw"
    res = probe(directory, args.total_mb, args.file_mb)
    for name, gbs in res["gb_s"].items():  # type: ignore[attr-defined]
        print(f"  {name:<24} {gbs:>7.3f} GB/s")
    print(f"  best plain design: {res['best']}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
