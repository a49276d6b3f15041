"""Raw safetensors I/O for the hot paths: header build/parse and GIL-free writes.

The files are ordinary safetensors (an 8-byte little-endian header length, a JSON header,
then the tensor bytes) that `safetensors.safe_open` reads. Writes leave Python's GIL
released (pwrite, preadv, numpy and xxhash on buffers) and avoid the extra in-memory copy of
`safetensors.torch.save`: the dump writer shares its process with the model's forward, and
the worker's persist threads move gigabytes a second.

A worker copies a dump's bytes in one pass (`write` with `Range` sources): each chunk is
read into a page-aligned buffer of its own, checked for NaN/Inf, checksummed (xxh3) and
written from that buffer, so what is checked is what is written (a server rewriting its
file meanwhile cannot slip NaN in). Large files go to the disk with O_DIRECT from those
buffers where the filesystem allows it (not tmpfs): on the H200 machine's disk one buffered
stream with fsync reached 1.16 GB/s and one O_DIRECT stream 2.0 GB/s (BENCHMARKS.md); the
page cache's write-back, not the device, limited the buffered stream. HSQ_DIRECT_IO=0
turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsq import jsonsafe

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are touched, so header reads stay cheap for operator
# commands (`hsq verify` reads 100k headers).
_CODE_NAMES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "float8_e4m3fn": "F8_E4M3",
}


def dtype_code(dtype: torch.dtype) -> str:
    """safetensors' name for a torch dtype (BF16, F32, ...)."""
    return _CODE_NAMES[str(dtype).removeprefix("torch.")]


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype code (inverse of dtype_code)."""
    import torch

    for name, c in _CODE_NAMES.items():
        if c == code:
            dtype: torch.dtype = getattr(torch, name)
            return dtype
    raise FormatError(f"unsupported dtype {code!r}")


ITEMSIZE = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "F8_E4M3": 1,
}
MAX_HEADER = 100 * 2**20


class FormatError(ValueError):
    """Not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    start: int
    """Absolute offset of the first byte in the file."""
    nbytes: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous."""
    import torch

    arr: Any = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr)


def build_header(
    entries: Sequence[tuple[str, str, Sequence[int], int]], metadata: dict[str, str] | None
) -> bytes:
    """entries: (name, dtype code, shape, nbytes) in file order; returns length + JSON."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, code, shape, nbytes in entries:
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def read_header(fd: int) -> Header:
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise FormatError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise FormatError(f"implausible header length {n} for a {size}-byte file")
    try:
        raw = jsonsafe.loads(os.pread(fd, n, 8))
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"header is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise FormatError("header is not an object")
    base = 8 + n
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise FormatError("__metadata__ is not a map of strings")
    specs = [(name, _tensor_spec(name, spec)) for name, spec in raw.items()]
    tensors: dict[str, TensorInfo] = {}
    end = 0
    for name, (code, shape, lo, hi) in sorted(specs, key=lambda item: item[1][2]):
        if lo != end or hi - lo != ITEMSIZE[code] * _prod(shape):
            raise FormatError(f"tensor {name!r}: offsets {lo}..{hi} do not fit {code}{shape}")
        end = hi
        tensors[name] = TensorInfo(name, code, shape, base + lo, hi - lo)
    if base + end != size:
        raise FormatError(f"file is {size} bytes, header describes {base + end}")
    return Header(tensors, meta, size)


def _tensor_spec(name: str, spec: Any) -> tuple[str, list[int], int, int]:
    """(dtype code, shape, start, end) of one header entry, every field type-checked: the
    header comes from a file someone else wrote."""
    try:
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    except (KeyError, TypeError) as exc:
        raise FormatError(f"tensor {name!r}: bad entry {spec!r:.200}") from exc
    ints_ok = isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)
    if not ints_ok or not all(_is_dim(v) for v in [*offsets, *shape]):
        raise FormatError(f"tensor {name!r}: shape/offsets are not lists of integers")
    if not isinstance(code, str) or code not in ITEMSIZE:
        raise FormatError(f"tensor {name!r}: unknown dtype {code!r:.40}")
    return code, list(shape), offsets[0], offsets[1]


def _is_dim(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"bad dimension {d!r}")
        n *= d
    return n


# ---------------------------------------------------------------------------- checksums
# New files carry xxh3 (XXH3-64, tens of GB/s on one core); files written before it carry
# crc32 (zlib), and every reader accepts both by the name before the colon.
CHECKSUM = "xxh3"
CHECKSUMS = ("xxh3", "crc32")


class Digest:
    """A running checksum over a file's bytes in order; `text` is "<algo>:<hex>"."""

    def __init__(self, algo: str = CHECKSUM) -> None:
        if algo not in CHECKSUMS:
            raise FormatError(f"unknown checksum {algo!r}")
        self.algo = algo
        self._crc = 0
        self._xxh: Any = None
        if algo == "xxh3":
            import xxhash

            self._xxh = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    @property
    def text(self) -> str:
        if self._xxh is not None:
            return f"xxh3:{self._xxh.intdigest():016x}"
        return f"crc32:{self._crc:08x}"


def checksum_algo(text: str) -> str:
    """The algorithm a recorded checksum names ("xxh3:..." -> "xxh3"); FormatError if none."""
    algo = text.partition(":")[0]
    if algo not in CHECKSUMS:
        raise FormatError(f"unknown checksum {text[:40]!r}")
    return algo


# ---------------------------------------------------------------------------- finite checks
# Exponent bits all set means Inf or NaN; checked on an unsigned view of the raw bytes, a
# slice at a time into a per-thread scratch array (numpy releases the GIL, no torch).
_NONFINITE_NP = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000)}
_NONFINITE_NP["F8_E4M3"] = ("u1", 0x7F)  # float8_e4m3fn: no Inf, NaN only as S.1111.111
_SCRATCH_BYTES = 1 << 20
_scratch = threading.local()


def nonfinite_in(data: memoryview | bytes, code: str) -> bool:
    """Whether raw little-endian values of dtype `code` hold a NaN or Inf (whole elements)."""
    if code not in _NONFINITE_NP:
        return False
    import numpy as np

    np_dtype, mask = _NONFINITE_NP[code]
    values = np.frombuffer(data, dtype=np_dtype)
    step = _SCRATCH_BYTES // values.itemsize
    key = f"s{values.itemsize}"
    tmp = getattr(_scratch, key, None)
    if tmp is None:
        tmp = np.empty(step, dtype=np_dtype)
        setattr(_scratch, key, tmp)
    for lo in range(0, len(values), step):
        part = values[lo : lo + step]
        out = tmp[: len(part)]
        np.bitwise_and(part, mask, out=out)
        if int(out.max()) == mask:
            return True
    return False


class _Finite:
    """Checks a tensor's bytes as they stream past, whatever the piece boundaries."""

    def __init__(self, code: str, name: str) -> None:
        self.code, self.name = code, name
        self.item = ITEMSIZE[code]
        self.carry = b""

    def feed(self, piece: memoryview) -> None:
        if self.carry:
            need = self.item - len(self.carry)
            self.carry += bytes(piece[:need])
            piece = piece[need:]
            if len(self.carry) < self.item:
                return
            self._check(self.carry)
            self.carry = b""
        whole = len(piece) - len(piece) % self.item
        if whole:
            self._check(piece[:whole])
        self.carry = bytes(piece[whole:])

    def _check(self, data: memoryview | bytes) -> None:
        if nonfinite_in(data, self.code):
            raise NonFiniteError(f"{self.name} holds NaN or Inf")


class NonFiniteError(FormatError):
    """A checked source held NaN or Inf."""


class SourceError(FormatError):
    """A source file could not be read, or ended before its range did."""


def all_finite(buf: mmap.mmap | bytes, info: TensorInfo, chunk_bytes: int = 64 * 2**20) -> bool:
    """No NaN or Inf in one tensor of a mapped (or read) file, checked a chunk at a time."""
    view = memoryview(buf)
    item = ITEMSIZE[info.dtype]
    step = max(item, chunk_bytes - chunk_bytes % item)
    end = info.start + info.nbytes
    return not any(
        nonfinite_in(view[off : min(end, off + step)], info.dtype)
        for off in range(info.start, end, step)
    )


def map_file(fd: int) -> mmap.mmap:
    """A private mapping (writable as far as torch.frombuffer cares; nothing is written)."""
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)


# ---------------------------------------------------------------------------- writing


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


DIRECT_ALIGN = 4096
DIRECT_MIN_BYTES = 2**20
"""Files this large bypass the page cache: with many small files the fsyncs of buffered
writes, not the bytes, limited the rate (measured: 118 against 45 samples/s of 64-512
tokens at the 8B shape, 8 persist threads)."""
DIRECT_CHUNK = 8 * 2**20
"""The size of each staging buffer (a multiple of DIRECT_ALIGN)."""
BUFFERS = 3
_WRITE_IN_PLACE = 1 << 20
"""Memory sources this large are written from where they are when not O_DIRECT."""
_direct_refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT
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


def _open_direct(fd: int) -> int | None:
    """A second, O_DIRECT descriptor on fd's file, or None where that is not possible."""
    if os.environ.get("HSQ_DIRECT_IO", "1") == "0" or not hasattr(os, "O_DIRECT"):
        return None
    st = os.fstat(fd)
    if st.st_dev in _direct_refused or os.lseek(fd, 0, os.SEEK_CUR) != 0:
        return None
    if st.st_dev in _memory_devices():
        _direct_refused.add(st.st_dev)
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
    except OSError:
        _direct_refused.add(st.st_dev)  # tmpfs and some FUSE/overlay mounts say EINVAL
        return None


_direct_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_free_buffers: list[list[mmap.mmap]] = []
_MAX_FREE_BUFFER_SETS = 8


def _writes() -> ThreadPoolExecutor:
    """Threads that issue the writes while the caller fills the next buffer."""
    global _direct_pool
    with _pool_lock:
        if _direct_pool is None:
            _direct_pool = ThreadPoolExecutor(16, thread_name_prefix="stfile-write")
        return _direct_pool


def _take_buffers() -> list[mmap.mmap]:
    # Reused: a fresh mapping per file costs a page fault per 4 KiB, on some VMs more than
    # the copy itself.
    with _pool_lock:
        if _free_buffers:
            return _free_buffers.pop()
    return [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(BUFFERS)]


def _give_buffers(bufs: list[mmap.mmap]) -> None:
    with _pool_lock:
        if len(_free_buffers) < _MAX_FREE_BUFFER_SETS:
            _free_buffers.append(bufs)
            return
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
    """Streams a file through rotating page-aligned buffers of our own: each chunk is read
    (or copied) in, checked, checksummed, then written by a pool thread (O_DIRECT where the
    file allows it) while the caller fills the next buffer. One pass over every byte."""

    def __init__(
        self, fd: int, dfd: int | None, digest: Digest | None, stats: dict[str, float] | None
    ) -> None:
        self.fd, self.dfd, self.digest, self.stats = fd, dfd, digest, stats
        self.bufs = _take_buffers()
        self.views = [memoryview(b) for b in self.bufs]
        self.busy: list[list[Future[None]]] = [[] for _ in self.bufs]
        self.cur = self.fill = self.at = 0
        self.pool = _writes()
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
            self.direct_jobs.append(self.pool.submit(_pwrite_all, self.fd, view, self.at))
            self.at += len(view)
            return
        while view:
            k = min(len(view), DIRECT_CHUNK - self.fill)
            self.views[self.cur][self.fill : self.fill + k] = view[:k]
            view = view[k:]
            self._advance(k)

    def pull(self, src: Range) -> None:
        check = _Finite(src.check, src.name) if src.check else None
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
        _give_buffers(self.bufs)

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
            jobs.append(self.pool.submit(_pwrite_all, dfd, view[:aligned], self.at))
        if upto > aligned:
            jobs.append(
                self.pool.submit(_pwrite_all, self.fd, view[aligned:upto], self.at + aligned)
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


def _write_all_sources(
    fd: int,
    dfd: int | None,
    header: bytes,
    sources: Sequence[Source],
    crc: bool,
    stats: dict[str, float] | None,
) -> tuple[int, str]:
    digest = Digest() if crc else None
    w = _Writer(fd, dfd, digest, stats)
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


def write(
    fd: int,
    header: bytes,
    sources: Sequence[Source],
    *,
    crc: bool = True,
    stats: dict[str, float] | None = None,
    direct: bool = True,
) -> tuple[int, str]:
    """Write a header then each source, from offset 0 of `fd`: bytes/memoryview; a Range
    (or a tuple (fd, offset, nbytes)) read from another file; a Produced (chunks made on
    the way). Returns (bytes written, the file's checksum "xxh3:<hex>", or "" without `crc`).

    Every byte passes once through buffers of ours, where it is checked (Range.check) and
    checksummed before it is written, so a source changed meanwhile cannot slip unchecked
    bytes in. Files of DIRECT_MIN_BYTES or more bypass the page cache (O_DIRECT) where the
    filesystem allows it. `stats` accumulates seconds spent per step (read_s, finite_s,
    checksum_s, write_s: waiting for the writes). `direct=False` keeps the page cache (a
    file read back at once, such as a dump)."""
    size = len(header) + sum(_size(s) for s in sources)
    if direct and size >= DIRECT_MIN_BYTES and (dfd := _open_direct(fd)) is not None:
        try:
            return _write_all_sources(fd, dfd, header, sources, crc, stats)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Opened but refused the writes (alignment rules of some filesystems): start
            # the file over through the page cache, and stop trying on that filesystem.
            _direct_refused.add(os.fstat(fd).st_dev)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
        finally:
            os.close(dfd)
    return _write_all_sources(fd, None, header, sources, crc, stats)
