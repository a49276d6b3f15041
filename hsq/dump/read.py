"""Reading one dump: its meta against what the client sent (:func:`check_meta`), its tensor
file against its meta (:func:`open_dump_tensors`), or all of it loaded (:func:`read_dump`).

Everything here is untrusted input (a server wrote it): sizes are bounded, files are
opened only when they are regular files, and every failure is a DumpError.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hsq import fsio
from hsq.dump.format import (
    DONE_FILE,
    MAX_META_BYTES,
    META_FILE,
    TENSOR_FILE,
    DumpMeta,
    expected_shapes,
    tensor_dtype_code,
)
from hsq.errors import (
    CorruptDumpError,
    DumpDirError,
    IncompleteDumpError,
    MetaMismatchError,
    NonFiniteDumpError,
    StaleDumpError,
    WrongLengthError,
)
from hsq.states import AUX_TENSOR, DUMP_DTYPES, ENCODINGS, FP8, LAST_TENSOR, SCALE_SUFFIX
from hsq.stfile.engine import Range
from hsq.stfile.header import DTYPE_CODES, FormatError, Header, TensorInfo, map_file, read_header
from hsq.stfile.integrity import all_finite

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Expected:
    """What the client sent and what the run expects; None means "don't check"."""

    rid: str
    input_fingerprint: str
    num_tokens: int
    layer_ids: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    model_id: str | None = None
    store_dtype: str | None = None
    """The run's storage format: an fp8-e4m3 dump is usable only by an fp8-e4m3 run."""
    prenorm: bool = False
    """The run stores the pre-norm final state: a dump without it cannot serve."""


@dataclass(frozen=True)
class Dump:
    path: Path
    meta: DumpMeta
    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    """For an fp8-e4m3 dump, these are the stored float8 values (scales in `tensors`)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every tensor of the file by name (prenorm state, scales, and the two above)."""


def check_meta(meta: DumpMeta, exp: Expected) -> None:
    if meta.rid != exp.rid:
        raise StaleDumpError(f"dump rid {meta.rid!r} is not the request's rid {exp.rid!r}")
    if meta.input_fingerprint != exp.input_fingerprint:
        raise StaleDumpError("dump input fingerprint does not match the request's input ids")
    if meta.num_tokens != exp.num_tokens:
        raise WrongLengthError(f"dump has {meta.num_tokens} tokens, request had {exp.num_tokens}")
    checks: list[tuple[str, object, object]] = [
        ("layer_ids", meta.layer_ids, exp.layer_ids),
        ("hidden_size", meta.hidden_size, exp.hidden_size),
        ("dtype", meta.dtype, exp.dtype),
        ("model", meta.model.model_id, exp.model_id),
    ]
    for name, got, want in checks:
        if want is not None and got != want:
            raise MetaMismatchError(f"dump {name} is {got!r}, the run expects {want!r}")
    if meta.dtype not in DUMP_DTYPES:
        raise CorruptDumpError(f"unknown dtype {meta.dtype!r} in meta.json")
    if meta.encoding not in ENCODINGS:
        raise CorruptDumpError(f"unknown encoding {meta.encoding!r} in meta.json")
    if meta.encoding == FP8 and exp.store_dtype not in (None, FP8):
        raise MetaMismatchError(
            f"the server quantized this dump to {FP8} and the run stores {exp.store_dtype}: "
            f"a run takes such dumps only with `hsq enqueue --store-dtype {FP8}`; otherwise "
            "start the server without --dump-encoding fp8-e4m3 / SGLANG_HS_DUMP_ENCODING"
        )
    if exp.prenorm and not meta.prenorm:
        raise MetaMismatchError(
            "the run stores the pre-norm final state (hsq enqueue --prenorm) and this dump "
            "has none: start the server with --prenorm (SGLang: SGLANG_HS_PRENORM=1)"
        )
    want_shapes = expected_shapes(
        meta.num_tokens,
        len(meta.layer_ids),
        meta.hidden_size,
        encoding=meta.encoding,
        prenorm=meta.prenorm,
    )
    if meta.tensors != want_shapes:
        raise CorruptDumpError(f"meta tensors {meta.tensors} disagree with {want_shapes}")


def read_meta_bytes(path: Path) -> bytes:
    """meta.json of the dump at `path`, at most MAX_META_BYTES (+1: over it is refused)."""
    return fsio.read_regular(path / META_FILE, MAX_META_BYTES)


def read_meta(path: Path) -> DumpMeta:
    if not os.path.lexists(path / DONE_FILE):
        raise IncompleteDumpError(f"{path.name} has no `done` marker")
    try:
        data = read_meta_bytes(path)
    except OSError as exc:
        raise CorruptDumpError(f"{path.name}: cannot read meta.json: {exc}") from exc
    return DumpMeta.from_json(data)


@dataclass
class DumpTensors:
    """A dump tensor file whose header agrees with its meta: open, not read. `mm` is a
    private mapping when asked for (readers of tensors); the worker reads the bytes once
    with pread instead (:meth:`source`), checks them and writes them."""

    fd: int
    mm: mmap.mmap | None
    header: Header

    def source(self, name: str) -> Range:
        """One tensor's bytes for a copy that refuses NaN/Inf on the way."""
        info = self.header.tensors[name]
        return Range(self.fd, info.start, info.nbytes, info.dtype, info.name)

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        os.close(self.fd)


def open_dump_tensors(
    path: Path, meta: DumpMeta, *, check_finite: bool = True, mapped: bool = True
) -> DumpTensors:
    """Open the tensor file of a dump whose meta passed check_meta, and check that its
    header agrees with the meta (names, shapes, dtype, size) and, with `check_finite`, that
    the values are finite (which needs `mapped`)."""
    try:
        fd = fsio.open_regular(path / TENSOR_FILE)  # a FIFO here blocked the persist thread
    except FileNotFoundError as exc:
        if not os.path.lexists(path):
            # The whole dump is gone, not its tensor file: its directory (the worker's
            # staging dir) was removed or moved away. The environment's fault.
            raise DumpDirError(f"{path} vanished: its directory was removed or moved") from exc
        raise CorruptDumpError(f"{path.name}: cannot open tensors: {exc}") from exc
    except OSError as exc:
        raise CorruptDumpError(f"{path.name}: cannot open tensors: {exc}") from exc
    try:
        header = read_header(fd)
        mm = map_file(fd) if mapped else None
    except (FormatError, OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        # Untrusted header JSON: entries that are not objects, offsets that are strings...
        os.close(fd)
        raise CorruptDumpError(f"{path.name}: unreadable tensors: {exc!r}") from exc
    dt = DumpTensors(fd, mm, header)
    try:
        if set(header.tensors) != set(meta.tensors):
            raise CorruptDumpError(
                f"{path.name}: tensors {sorted(header.tensors)}, meta {sorted(meta.tensors)}"
            )
        for name, shape in meta.tensors.items():
            info = header.tensors[name]
            code = tensor_dtype_code(name, meta)
            if info.shape != shape:
                raise CorruptDumpError(f"{path.name}: {name} has shape {info.shape}, meta {shape}")
            if info.dtype != code:
                raise CorruptDumpError(
                    f"{path.name}: {name} is {info.dtype}, meta says {meta.dtype} "
                    f"({meta.encoding}): {code}"
                )
            if check_finite and mm is not None and not all_finite(mm, info):
                raise NonFiniteDumpError(f"{path.name}: {name} holds NaN or Inf")
            if name.endswith(SCALE_SUFFIX) and _has_negative(fd, mm, info):
                raise CorruptDumpError(f"{path.name}: {name} holds negative scales")
    except BaseException:
        dt.close()
        raise
    return dt


def read_dump(path: Path, expected: Expected, *, check_finite: bool = True) -> Dump:
    """Load and validate one dump against what was sent. Cheap checks run first."""
    meta = read_meta(path)
    check_meta(meta, expected)
    open_dump_tensors(path, meta, check_finite=check_finite).close()
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path / TENSOR_FILE))  # an independent parser, as a check
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CorruptDumpError(f"{path.name}: unreadable tensors: {exc}") from exc
    return Dump(
        path=path,
        meta=meta,
        aux_hidden_states=tensors[AUX_TENSOR],
        last_hidden_state=tensors[LAST_TENSOR],
        tensors=tensors,
    )


def _has_negative(fd: int, mm: mmap.mmap | None, info: TensorInfo) -> bool:
    """A float32 scale tensor (small: [T, groups]) holding a value below zero."""
    if info.dtype != DTYPE_CODES["float32"] or not info.nbytes:
        return False
    import numpy as np

    raw = mm[info.start : info.start + info.nbytes] if mm is not None else None
    if raw is None:
        raw = os.pread(fd, info.nbytes, info.start)
    return bool((np.frombuffer(raw, dtype="<f4") < 0).any())
