"""Raw safetensors I/O for the hot paths: header build/parse and GIL-free writes.

The files are ordinary safetensors (an 8-byte little-endian header length, a JSON header,
then the tensor bytes) that `safetensors.safe_open` reads. Writing from memoryviews with
os.write and copying between files with copy_file_range keeps Python's GIL released and
avoids the extra in-memory copy of `safetensors.torch.save`: the dump writer shares its
process with the model's forward, and the worker's persist threads move gigabytes a second.

Large files go to the disk with O_DIRECT from page-aligned staging buffers where the
filesystem allows it (not tmpfs): on the H200 machine's disk one buffered stream with fsync
reached 1.16 GB/s and one O_DIRECT stream 2.0 GB/s (BENCHMARKS.md); the page cache's
write-back, not the device, limited the buffered stream. HSQ_DIRECT_IO=0 turns it off.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Sequence
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
# Exponent bits all set means Inf or NaN; checked on an integer view of the raw bytes.
# float8_e4m3fn has no Inf, and NaN only as S.1111.111.
_NONFINITE = {
    "BF16": ("int16", 0x7F80),
    "F16": ("int16", 0x7C00),
    "F32": ("int32", 0x7F800000),
    "F8_E4M3": ("uint8", 0x7F),
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


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _copy_range(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Kernel-side copy at dst's position. copy_file_range refuses some pairs of
    filesystems (tmpfs dump dir -> ext4/NFS output: EXDEV); sendfile takes any regular file."""
    use_cfr = True
    while nbytes:
        try:
            if use_cfr:
                n = os.copy_file_range(src, dst, nbytes, offset)
            else:
                n = os.sendfile(dst, src, offset, nbytes)
        except OSError as exc:
            if use_cfr and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                use_cfr = False
                continue
            raise
        if n == 0:
            raise FormatError("source file ended early")
        offset += n
        nbytes -= n


DIRECT_ALIGN = 4096
DIRECT_MIN_BYTES = 8 * 2**20
DIRECT_CHUNK = 8 * 2**20
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


def _writes() -> ThreadPoolExecutor:
    """Threads that issue the O_DIRECT writes while the caller stages the next chunk."""
    global _direct_pool
    with _pool_lock:
        if _direct_pool is None:
            _direct_pool = ThreadPoolExecutor(16, thread_name_prefix="stfile-direct")
        return _direct_pool


def _crc_after(view: memoryview, prev: Future[int] | None) -> int:
    return zlib.crc32(view, prev.result() if prev is not None else 0)


class _Staged:
    """A file written with O_DIRECT through rotating page-aligned buffers: while the
    caller reads the next chunk into one buffer, pool threads crc (in order) and write the
    others, so a file streams at about the slowest of read, crc and write, not their sum."""

    BUFFERS = 3

    def __init__(self, fd: int, dfd: int, crc: bool) -> None:
        self.fd, self.dfd, self.crc = fd, dfd, crc
        self.bufs = [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(self.BUFFERS)]
        self.views = [memoryview(b) for b in self.bufs]
        self.busy: list[list[Future[Any]]] = [[] for _ in self.bufs]
        self.cur = self.fill = self.at = 0
        self.value: Future[int] | None = None
        self.pool = _writes()

    def add(self, src: memoryview | bytes | tuple[int, int, int]) -> None:
        if isinstance(src, tuple):
            sfd, off, n = src
            while n:
                k = min(n, DIRECT_CHUNK - self.fill)
                view = self.views[self.cur][self.fill : self.fill + k]
                k = os.preadv(sfd, [view], off)  # GIL released
                if k == 0:
                    raise FormatError("source file ended early")
                self._advance(k)
                off, n = off + k, n - k
        else:
            data = memoryview(src).cast("B")
            while data:
                k = min(len(data), DIRECT_CHUNK - self.fill)
                self.views[self.cur][self.fill : self.fill + k] = data[:k]
                self._advance(k)
                data = data[k:]

    def finish(self) -> tuple[int, int]:
        aligned = self.fill - self.fill % DIRECT_ALIGN
        if aligned:
            tail = bytes(self.views[self.cur][aligned : self.fill])
            self._emit(aligned, direct=True)
            self.views[self.cur][: len(tail)] = tail
            self.fill = len(tail)
        if self.fill:
            self._emit(self.fill, direct=False)  # the unaligned tail, through the page cache
        for i in range(len(self.bufs)):
            self._wait(i)
        return self.at, self.value.result() if self.value is not None else 0

    def close(self) -> None:
        for jobs in self.busy:  # after an error: nothing may still read a buffer we close
            for job in jobs:
                job.exception()
        for view, buf in zip(self.views, self.bufs, strict=True):
            try:
                view.release()
                buf.close()
            except BufferError:
                pass  # a failed write's traceback still holds a slice: freed with it

    def _advance(self, k: int) -> None:
        self.fill += k
        if self.fill == DIRECT_CHUNK:
            self._emit(self.fill, direct=True)

    def _emit(self, upto: int, direct: bool) -> None:
        view = self.views[self.cur][:upto]
        jobs: list[Future[Any]] = [
            self.pool.submit(_pwrite_all, self.dfd if direct else self.fd, view, self.at)
        ]
        if self.crc:
            self.value = self.pool.submit(_crc_after, view, self.value)
            jobs.append(self.value)
        self.busy[self.cur] = jobs
        self.at += upto
        self.cur, self.fill = (self.cur + 1) % len(self.bufs), 0
        self._wait(self.cur)  # the next buffer must be written before it is refilled

    def _wait(self, i: int) -> None:
        jobs, self.busy[i] = self.busy[i], []
        for job in jobs:
            job.result()


def _write_direct(
    fd: int,
    dfd: int,
    header: bytes,
    sources: Sequence[memoryview | bytes | tuple[int, int, int]],
    crc: bool,
) -> tuple[int, int]:
    staged = _Staged(fd, dfd, crc)
    try:
        for src in (header, *sources):
            staged.add(src)
        total, value = staged.finish()
    finally:
        staged.close()
    os.lseek(fd, total, os.SEEK_SET)  # as if written through fd
    return total, value


def write(
    fd: int,
    header: bytes,
    sources: Sequence[memoryview | bytes | tuple[int, int, int]],
    *,
    crc: bool = True,
    crc_of: mmap.mmap | None = None,
) -> tuple[int, int]:
    """Write a header then each source: bytes/memoryview, or (src_fd, offset, nbytes) copied
    in the kernel (copy_file_range). Returns (bytes written, crc32 of the whole file, or 0
    without `crc`); copied ranges are read for the crc from `crc_of`, the source's mapping.
    Files of DIRECT_MIN_BYTES or more, written from offset 0, bypass the page cache
    (O_DIRECT) where the filesystem supports it."""
    size = len(header) + sum(
        s[2] if isinstance(s, tuple) else memoryview(s).nbytes for s in sources
    )
    if size >= DIRECT_MIN_BYTES and (dfd := _open_direct(fd)) is not None:
        try:
            return _write_direct(fd, dfd, header, sources, crc)
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
    value = zlib.crc32(header) if crc else 0
    _write_all(fd, header)
    total = len(header)
    for src in sources:
        if isinstance(src, tuple):
            sfd, off, n = src
            _copy_range(sfd, fd, off, n)
            if crc:
                if crc_of is None:
                    raise ValueError("a copied range needs crc_of, the source file's mapping")
                value = zlib.crc32(memoryview(crc_of)[off : off + n], value)
            total += n
        else:
            if crc:
                value = zlib.crc32(src, value)
            _write_all(fd, src)
            total += memoryview(src).nbytes
    return total, value


def _pwrite_all(fd: int, data: memoryview | bytes, at: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def all_finite(buf: mmap.mmap, info: TensorInfo, chunk_bytes: int = 64 * 2**20) -> bool:
    """No NaN or Inf, checked on the raw bytes in chunks (bounded temporaries)."""
    import torch

    if info.dtype not in _NONFINITE:
        return True
    int_name, mask = _NONFINITE[info.dtype]
    int_dtype = getattr(torch, int_name)
    item = ITEMSIZE[info.dtype]
    step = max(item, chunk_bytes - chunk_bytes % item)
    for off in range(info.start, info.start + info.nbytes, step):
        n = min(step, info.start + info.nbytes - off)
        x = torch.frombuffer(buf, dtype=int_dtype, count=n // item, offset=off)
        if bool(((x & mask) == mask).any()):
            return False
    return True


def map_file(fd: int) -> mmap.mmap:
    """A private mapping (writable as far as torch.frombuffer cares; nothing is written)."""
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
