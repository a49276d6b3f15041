"""Integrity checks on raw tensor bytes: checksums and NaN/Inf detection, without torch.

Both run on buffers with the GIL released (xxhash, numpy), so the worker's persist threads
check gigabytes a second while they copy them (hsq.stfile.engine).
"""

from __future__ import annotations

import mmap
import threading
import zlib
from typing import Any

from hsq.stfile.header import ITEMSIZE, FormatError, TensorInfo

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


class NonFiniteError(FormatError):
    """A checked source held NaN or Inf."""


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


class FiniteCheck:
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
