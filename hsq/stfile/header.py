"""The safetensors header: the one dtype table, building and strictly parsing headers.

A file is an 8-byte little-endian header length, a JSON header (`{name: {dtype, shape,
data_offsets}}` plus an optional `__metadata__` map of strings), then the tensor bytes.
Headers come from files someone else wrote (a server's dump): every field is type-checked
and the offsets must tile the file exactly.

torch is imported where tensors are touched, so header reads stay cheap for operator
commands (`hsq verify` reads 100k headers).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import msgspec

from hsq import jsonsafe

if TYPE_CHECKING:
    import torch

_TABLE = (
    # torch's name, safetensors' code, bytes per element
    ("bfloat16", "BF16", 2),
    ("float16", "F16", 2),
    ("float32", "F32", 4),
    ("int64", "I64", 8),
    ("int32", "I32", 4),
    ("int16", "I16", 2),
    ("int8", "I8", 1),
    ("uint8", "U8", 1),
    ("float8_e4m3fn", "F8_E4M3", 1),
)
DTYPE_CODES = {name: code for name, code, _ in _TABLE}
"""The one dtype table: every dtype hsq reads or writes, by torch's name -> its code."""
DTYPE_NAMES = {code: name for name, code, _ in _TABLE}
ITEMSIZE = {code: size for _, code, size in _TABLE}
MAX_HEADER = 100 * 2**20


class FormatError(ValueError):
    """Not a well-formed safetensors file."""


def dtype_code(dtype: torch.dtype) -> str:
    """safetensors' name for a torch dtype (BF16, F32, ...)."""
    return DTYPE_CODES[str(dtype).removeprefix("torch.")]


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype code (inverse of dtype_code)."""
    import torch

    name = DTYPE_NAMES.get(code)
    if name is None:
        raise FormatError(f"unsupported dtype {code!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


class TensorInfo(NamedTuple):
    # NamedTuples, not frozen dataclasses: a header check builds one per tensor a file, and
    # a frozen dataclass's __init__ (object.__setattr__ per field) cost 2-3x as much.
    name: str
    dtype: str
    shape: list[int]
    start: int
    """Absolute offset of the first byte in the file."""
    nbytes: int


class Header(NamedTuple):
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


FIRST_READ = 16 * 1024
"""Bytes read at once from a file's start: a small file's header comes in one read."""


_Size = Annotated[int, msgspec.Meta(ge=0)]


class _Tensor(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One header entry as the fast path takes it: exactly these keys (msgspec would skip
    an unknown key's value unchecked), each of its type; anything else: the strict parser."""

    dtype: str
    shape: list[_Size]
    data_offsets: tuple[_Size, _Size]


class FastHeader:
    """A compiled (msgspec) decoder for headers whose tensors all have names from a known
    set (an output file's): it decodes and type-checks in C what `read_header`'s parser
    checks in Python, ~5x cheaper (`hsq verify` reads a million headers). It only ever
    accepts a header the strict parser accepts, and builds the same Header (tests/
    test_stfile.py compares both on damaged headers): whatever it does not take (another
    key, an empty tensor, a type msgspec refuses, offsets that do not tile) returns None
    and goes to the strict parser, which gives its own verdict and message."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        fields: list[Any] = [
            ("metadata", dict[str, str] | None, msgspec.field(default=None, name="__metadata__"))
        ]
        # UNSET, not None, for an absent tensor: `"name": null` is refused, as the parser does.
        fields += [(name, _Tensor | msgspec.UnsetType, msgspec.UNSET) for name in self.names]
        if "metadata" in self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"tensor names {self.names} cannot be struct fields")
        kind = msgspec.defstruct("_Header", fields, forbid_unknown_fields=True, gc=False)
        self._decode = msgspec.json.Decoder(kind).decode

    def parse(self, text: bytes, base: int, size: int) -> Header | None:
        """The Header of a valid header `text` of a `size`-byte file whose tensor data
        starts at `base`; None for anything the strict parser must decide."""
        try:
            got: Any = self._decode(text)
        except msgspec.DecodeError:
            return None
        found: list[tuple[tuple[int, int], str, _Tensor]] = []
        for name in self.names:
            spec = getattr(got, name)
            if spec is not msgspec.UNSET:
                found.append((spec.data_offsets, name, spec))
        found.sort()  # by start (and end), as the parser orders them
        tensors: dict[str, TensorInfo] = {}
        end = 0
        for (lo, hi), name, spec in found:
            # An empty tensor is declined: two at one offset are in the JSON's order there.
            nbytes = ITEMSIZE.get(spec.dtype)
            if lo != end or hi <= lo or nbytes is None:
                return None
            for dim in spec.shape:
                nbytes *= dim
            if hi - lo != nbytes:
                return None
            end = hi
            tensors[name] = TensorInfo(name, spec.dtype, spec.shape, base + lo, nbytes)
        if base + end != size:
            return None
        return Header(tensors, got.metadata or {}, size)


def read_header(fd: int, size: int | None = None, fast: FastHeader | None = None) -> Header:
    """`size`: the file's size if the caller has just taken it (fstat) already. `fast`: a
    compiled decoder to try first (the strict parser decides what it does not take)."""
    size = os.fstat(fd).st_size if size is None else size
    first = os.pread(fd, FIRST_READ, 0)
    if len(first) < 8:
        raise FormatError("shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", first)
    if n > MAX_HEADER or 8 + n > size:
        raise FormatError(f"implausible header length {n} for a {size}-byte file")
    text = first[8 : 8 + n] if 8 + n <= len(first) else os.pread(fd, n, 8)
    if fast is not None:
        header = fast.parse(text, 8 + n, size)
        if header is not None:
            return header
    return parse_header(text, 8 + n, size)


def parse_header(text: bytes, base: int, size: int) -> Header:
    """The strict parser: the header JSON `text` of a `size`-byte file whose tensor data
    starts at `base`, every field type-checked; FormatError otherwise."""
    try:
        raw = jsonsafe.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"header is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise FormatError("header is not an object")
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
    ints_ok = type(offsets) is list and len(offsets) == 2 and type(shape) is list
    # `type(v) is int`: JSON's ints exactly (no bool); one loop, not a call per value.
    if not ints_ok or any(type(v) is not int or v < 0 for v in (*offsets, *shape)):
        raise FormatError(f"tensor {name!r}: shape/offsets are not lists of integers")
    if not isinstance(code, str) or code not in ITEMSIZE:
        raise FormatError(f"tensor {name!r}: unknown dtype {code!r:.40}")
    return code, list(shape), offsets[0], offsets[1]


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"bad dimension {d!r}")
        n *= d
    return n


def map_file(fd: int) -> mmap.mmap:
    """A private mapping (writable as far as torch.frombuffer cares; nothing is written)."""
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
