"""Writing safetensors files on the hot paths, with the GIL released and no extra copy.

Writes leave Python's GIL released (pwrite, preadv, numpy and xxhash on buffers) and avoid
the extra in-memory copy of `safetensors.torch.save`: the dump writer shares its process
with the model's forward, and the worker's persist threads move gigabytes a second.

A dump is tensors already in memory, read back at once by the worker: `write_from_memory`
writes them where they are, through the page cache. A worker copies a dump's bytes in one
pass through a :class:`WriteEngine` (`write` with `Range` sources): each chunk is read into a
page-aligned buffer of its own, checked for NaN/Inf, checksummed (xxh3) and written from
that buffer, so what is checked is what is written (a server rewriting its file meanwhile
cannot slip NaN in). Large files go to the disk with O_DIRECT from those buffers where the
filesystem allows it (not tmpfs): on the H200 machine's disk one buffered stream with
fsync reached 1.16 GB/s and one O_DIRECT stream 2.0 GB/s (BENCHMARKS.md); the page cache's
write-back, not the device, limited the buffered stream. `WriteEngine(direct_io=False)`
(the worker's `--no-direct-io`, HSQ_DIRECT_IO=0) turns it off.

The engine owns its write threads and staging buffers: whoever makes one closes it (the
worker's persist stage does, hsq/workers/persist/stage.py).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from hsq.stfile.header import FormatError
from hsq.stfile.integrity import Digest, FiniteCheck


class SourceError(FormatError):
    """A source file could not be read, or ended before its range did."""


@dataclass(frozen=True)
class Range:
    """`nbytes` of file `fd` from `offset`, read into the writer's own buffers (never
    mapped, never copied in the kernel): the bytes checked (`check`: a dtype code whose
    NaN/Inf are refused) and checksummed are exactly the bytes written, whatever the source
    file does meanwhile."""

    fd: int
    offset: int
    nbytes: int
    check: str | None = None
    name: str = "tensor"


@dataclass(frozen=True)
class Produced:
    """Bytes made on the way (e.g. quantized chunks): `make()` yields them in order,
    `nbytes` in all; called again if the file has to be started over."""

    make: Callable[[], Iterator[memoryview | bytes]]
    nbytes: int


Source = memoryview | bytes | tuple[int, int, int] | Range | Produced


def _size(src: Source) -> int:
    if isinstance(src, tuple):
        return src[2]
    if isinstance(src, Range | Produced):
        return src.nbytes
    return memoryview(src).nbytes


def _pwrite_all(fd: int, data: memoryview | bytes, at: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def write_from_memory(fd: int, header: bytes, buffers: Sequence[memoryview | bytes]) -> int:
    """Write a header then each buffer from where it is, from offset 0 of `fd`, through the
    page cache (os.pwrite: no copy of ours, the GIL released); the bytes written. For files
    read back at once, such as a dump: buffered writes to one file take its inode lock in
    turn, so threads would not make this faster."""
    at = 0
    for data in (header, *buffers):
        _pwrite_all(fd, data, at)
        at += memoryview(data).nbytes
    os.lseek(fd, at, os.SEEK_SET)  # as if written through fd
    return at


DIRECT_ALIGN = 4096
DIRECT_MIN_BYTES = 2**20
"""Files this large bypass the page cache: with many small files the fsyncs of buffered
writes, not the bytes, limited the rate (measured: 118 against 45 samples/s of 64-512
tokens at the 8B shape, 8 persist threads)."""
DIRECT_CHUNK = 8 * 2**20
"""The size of each staging buffer (a multiple of DIRECT_ALIGN)."""
BUFFERS = 3
THREADS = 16
"""Write threads of an engine: shared by every file it writes at once (the worker's 8
persist threads by default)."""
_WRITE_IN_PLACE = 1 << 20
"""Memory sources this large are written from where they are when not O_DIRECT."""
_MAX_FREE_BUFFER_SETS = 8
# Memory-only filesystems gain nothing from O_DIRECT and would pay an extra copy.
_MEMORY_FS = {"tmpfs", "ramfs", "hugetlbfs"}


def _memory_devices() -> set[int]:
    devs: set[int] = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                fstype = fields[fields.index("-") + 1]
                if fstype in _MEMORY_FS:
                    major, minor = fields[2].split(":")
                    devs.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError, IndexError):
        pass
    return devs


class WriteEngine:
    """Writes files through rotating page-aligned buffers and a pool of write threads.

    `threads` write threads issue the writes while the caller fills the next buffer
    (0: the caller writes them itself); `direct_io` lets files of DIRECT_MIN_BYTES or more
    bypass the page cache (O_DIRECT) where the filesystem allows it. Staging buffers are
    reused across files: a fresh mapping per file costs a page fault per 4 KiB, on some
    VMs more than the copy itself. Thread-safe; close() (or `with`) ends the threads."""

    def __init__(self, *, threads: int = THREADS, direct_io: bool = True) -> None:
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="stfile-write") if threads else None
        )
        self._lock = threading.Lock()
        self._free_buffers: list[list[mmap.mmap]] = []
        self.direct_refused: set[int] = set()
        """st_dev of filesystems that refused O_DIRECT: not tried again."""

    def __enter__(self) -> WriteEngine:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the write threads to finish and end them; free the buffers."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            sets, self._free_buffers = self._free_buffers, []
        for bufs in sets:
            _close_buffers(bufs)

    def write(
        self,
        fd: int,
        header: bytes,
        sources: Sequence[Source],
        *,
        crc: bool = True,
        stats: dict[str, float] | None = None,
    ) -> tuple[int, str]:
        """Write a header then each source, from offset 0 of `fd`: bytes/memoryview; a Range
        (or a tuple (fd, offset, nbytes)) read from another file; a Produced (chunks made on
        the way). Returns (bytes written, the file's checksum "xxh3:<hex>", or "" without
        `crc`).

        Every byte passes once through buffers of ours, where it is checked (Range.check)
        and checksummed before it is written, so a source changed meanwhile cannot slip
        unchecked bytes in. `stats` accumulates seconds spent per step (read_s, finite_s,
        checksum_s, write_s: waiting for the writes)."""
        size = len(header) + sum(_size(s) for s in sources)
        if size >= DIRECT_MIN_BYTES and (dfd := self._open_direct(fd)) is not None:
            try:
                return self._write_all(fd, dfd, header, sources, crc, stats)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Opened but refused the writes (alignment rules of some filesystems): start
                # the file over through the page cache, and stop trying on that filesystem.
                self.direct_refused.add(os.fstat(fd).st_dev)
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
            finally:
                os.close(dfd)
        return self._write_all(fd, None, header, sources, crc, stats)

    def _write_all(
        self,
        fd: int,
        dfd: int | None,
        header: bytes,
        sources: Sequence[Source],
        crc: bool,
        stats: dict[str, float] | None,
    ) -> tuple[int, str]:
        digest = Digest() if crc else None
        w = _Writer(self, fd, dfd, digest, stats)
        try:
            w.put(header)
            for src in sources:
                if isinstance(src, tuple):
                    w.pull(Range(*src))
                elif isinstance(src, Range):
                    w.pull(src)
                elif isinstance(src, Produced):
                    made = 0
                    for piece in src.make():
                        made += memoryview(piece).nbytes
                        w.put(piece, stable=False)  # the maker may reuse its buffer
                    if made != src.nbytes:
                        raise FormatError(f"a produced source made {made} bytes, not {src.nbytes}")
                else:
                    w.put(src)
            total = w.finish()
        finally:
            w.close()
        os.lseek(fd, total, os.SEEK_SET)  # as if written through fd
        return total, digest.text if digest is not None else ""

    def _open_direct(self, fd: int) -> int | None:
        """A second, O_DIRECT descriptor on fd's file, or None where that is not possible."""
        if not self.direct_io:
            return None
        st = os.fstat(fd)
        if st.st_dev in self.direct_refused or os.lseek(fd, 0, os.SEEK_CUR) != 0:
            return None
        if st.st_dev in _memory_devices():
            self.direct_refused.add(st.st_dev)
            return None
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
        except OSError:
            self.direct_refused.add(st.st_dev)  # tmpfs and some FUSE/overlay mounts: EINVAL
            return None

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        """Run a write on a pool thread (or here and now, without threads)."""
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[None] = Future()
        try:
            fn(*args)
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def take_buffers(self) -> list[mmap.mmap]:
        with self._lock:
            if self._free_buffers:
                return self._free_buffers.pop()
        return [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(BUFFERS)]

    def give_buffers(self, bufs: list[mmap.mmap]) -> None:
        with self._lock:
            if len(self._free_buffers) < _MAX_FREE_BUFFER_SETS:
                self._free_buffers.append(bufs)
                return
        _close_buffers(bufs)


def _close_buffers(bufs: list[mmap.mmap]) -> None:
    for b in bufs:
        with contextlib.suppress(BufferError):  # still exported: freed with its last view
            b.close()


class _Timer:
    def __init__(self, stats: dict[str, float] | None, key: str) -> None:
        self.stats, self.key = stats, key

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *_exc: object) -> None:
        if self.stats is not None:
            self.stats[self.key] = self.stats.get(self.key, 0.0) + time.perf_counter() - self.t0


class _Writer:
    """Streams one file through rotating page-aligned buffers of the engine's: each chunk is
    read (or copied) in, checked, checksummed, then written by a pool thread (O_DIRECT
    where the file allows it) while the caller fills the next buffer. One pass over every
    byte."""

    def __init__(
        self,
        engine: WriteEngine,
        fd: int,
        dfd: int | None,
        digest: Digest | None,
        stats: dict[str, float] | None,
    ) -> None:
        self.engine = engine
        self.fd, self.dfd, self.digest, self.stats = fd, dfd, digest, stats
        self.bufs = engine.take_buffers()
        self.views = [memoryview(b) for b in self.bufs]
        self.busy: list[list[Future[None]]] = [[] for _ in self.bufs]
        self.cur = self.fill = self.at = 0
        self.direct_jobs: list[Future[None]] = []

    def put(self, data: memoryview | bytes, *, stable: bool = True) -> None:
        """Copy `data` in; `stable` memory (unchanged until finish() returns) may instead be
        written from where it is."""
        view = memoryview(data).cast("B")
        if stable and self.dfd is None and len(view) >= _WRITE_IN_PLACE:
            # Through the page cache a caller's memory can be written as it is (a server's
            # tensors): no copy into our buffers. It stays alive until finish() returns.
            if self.fill:
                self._emit(self.fill)
            if self.digest is not None:
                with _Timer(self.stats, "checksum_s"):
                    self.digest.update(view)
            self.direct_jobs.append(self.engine.submit(_pwrite_all, self.fd, view, self.at))
            self.at += len(view)
            return
        while view:
            k = min(len(view), DIRECT_CHUNK - self.fill)
            self.views[self.cur][self.fill : self.fill + k] = view[:k]
            view = view[k:]
            self._advance(k)

    def pull(self, src: Range) -> None:
        check = FiniteCheck(src.check, src.name) if src.check else None
        off, n = src.offset, src.nbytes
        while n:
            k = min(n, DIRECT_CHUNK - self.fill)
            view = self.views[self.cur][self.fill : self.fill + k]
            with _Timer(self.stats, "read_s"):
                try:
                    got = os.preadv(src.fd, [view], off)  # GIL released
                except OSError as exc:
                    raise SourceError(f"cannot read the source: {exc}") from exc
            if got == 0:
                raise SourceError("source file ended early")
            if check is not None:
                with _Timer(self.stats, "finite_s"):
                    check.feed(view[:got])
            off, n = off + got, n - got
            self._advance(got)

    def finish(self) -> int:
        if self.fill:
            self._emit(self.fill)
        for i in range(len(self.bufs)):
            self._wait(i)
        jobs, self.direct_jobs = self.direct_jobs, []
        with _Timer(self.stats, "write_s"):
            for job in jobs:
                job.result()
        return self.at

    def close(self) -> None:
        for jobs in [*self.busy, self.direct_jobs]:  # after an error: nothing may still
            for job in jobs:  # read a buffer we reuse, or the caller's memory
                job.exception()
        try:
            for view in self.views:
                view.release()
        except BufferError:  # a failed step's traceback still holds a slice: let GC free it
            return
        self.engine.give_buffers(self.bufs)

    def _advance(self, k: int) -> None:
        self.fill += k
        if self.fill == DIRECT_CHUNK:
            self._emit(self.fill)

    def _emit(self, upto: int) -> None:
        view = self.views[self.cur][:upto]
        if self.digest is not None:
            with _Timer(self.stats, "checksum_s"):
                self.digest.update(view)
        # O_DIRECT takes whole pages; a file's unaligned tail goes through the page cache.
        dfd = self.dfd
        aligned = upto - upto % DIRECT_ALIGN if dfd is not None else 0
        jobs = []
        if aligned and dfd is not None:
            jobs.append(self.engine.submit(_pwrite_all, dfd, view[:aligned], self.at))
        if upto > aligned:
            jobs.append(
                self.engine.submit(_pwrite_all, self.fd, view[aligned:upto], self.at + aligned)
            )
        self.busy[self.cur] = jobs
        self.at += upto
        self.cur, self.fill = (self.cur + 1) % len(self.bufs), 0
        self._wait(self.cur)  # the next buffer must be written before it is refilled

    def _wait(self, i: int) -> None:
        jobs, self.busy[i] = self.busy[i], []
        with _Timer(self.stats, "write_s"):
            for job in jobs:
                job.result()
