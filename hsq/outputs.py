"""Training outputs: one safetensors file per sample, written durably, checked on demand.

    <out>/<run>/<shard>/<sample_id>.safetensors     shard = first 2 hex of sha256(id)

Tensors: input_ids int64 [T], loss_mask int64 [T], aux_hidden_states [T, k*H],
last_hidden_state [T, H] (post-norm); with the run's store dtype fp8-e4m3 the two states are
float8_e4m3fn plus float32 `*_scale` tensors (hsq/quant.py). Metadata: format, sample_id,
run, layer_ids, layer_convention, model_id, num_tokens, input_fingerprint, store_dtype.
"""

from __future__ import annotations

import array
import builtins
import errno
import hashlib
import json
import os
import re
import secrets
import socket
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hsq import jsonsafe
from hsq.dataset import Sample, check_sample_id
from hsq.errors import OutputError

if TYPE_CHECKING:
    from hsq.protocol import DumpMeta, DumpTensors

# torch and safetensors are imported inside the functions that need them, so operator
# commands (status, requeue, verify without --deep) start in a fraction of a second.

OUTPUT_FORMAT = "hsq-eagle3-v1"
SUFFIX = ".safetensors"


def output_relpath(sample_id: str) -> str:
    sid = check_sample_id(sample_id)  # never trust an id as a path, even from Redis
    shard = hashlib.sha256(sid.encode()).hexdigest()[:2]
    return f"{shard}/{sid}{SUFFIX}"


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    num_tokens: int
    bytes: int
    checksum: str
    worker: str
    time: float
    attempt: int
    store_dtype: str = "bf16"
    """Entries written before FP8 existed have none: bf16."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | builtins.bytes) -> ManifestEntry:
        return cls(**json.loads(text))


def _int64_bytes(values: list[int]) -> bytes:
    arr = array.array("q", values)
    if sys.byteorder != "little":
        arr.byteswap()  # safetensors is little-endian
    return arr.tobytes()


def write_output(
    path: Path,
    sample: Sample,
    meta: DumpMeta,
    dump: DumpTensors,
    run: str,
    store_dtype: str = "bf16",
) -> tuple[int, str]:
    """Write a sample's training file durably from a validated dump; (bytes, checksum).

    bf16: the hidden states are copied file to file in the kernel (copy_file_range), never
    through Python objects; the crc32 is computed from the dump's mapping on the way.
    fp8-e4m3: they are quantized here (torch kernels, GIL released) and written from memory.
    """
    from hsq import quant, stfile
    from hsq.protocol import AUX_TENSOR, LAST_TENSOR, LAYER_CONVENTION

    n = len(sample.input_ids)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    aux, last = dump.header.tensors[AUX_TENSOR], dump.header.tensors[LAST_TENSOR]
    metadata = {
        "format": OUTPUT_FORMAT,
        "sample_id": sample.id,
        "run": run,
        "layer_ids": json.dumps(meta.layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "model_id": meta.model.model_id,
        "num_tokens": str(n),
        "input_fingerprint": meta.input_fingerprint,
        quant.META_KEY: quant.check_store_dtype(store_dtype),
    }
    if store_dtype == quant.FP8:
        return _write_fp8(path, sample, mask, meta, dump, metadata)
    header = stfile.build_header(
        [
            ("input_ids", "I64", [n], 8 * n),
            ("loss_mask", "I64", [n], 8 * n),
            (AUX_TENSOR, aux.dtype, aux.shape, aux.nbytes),
            (LAST_TENSOR, last.dtype, last.shape, last.nbytes),
        ],
        metadata,
    )
    sources: list[memoryview | bytes | tuple[int, int, int]] = [
        _int64_bytes(sample.input_ids),
        _int64_bytes(mask),
        (dump.fd, aux.start, aux.nbytes),
        (dump.fd, last.start, last.nbytes),
    ]
    nbytes, crc = write_durably(path, lambda fd: stfile.write(fd, header, sources, crc_of=dump.mm))
    return nbytes, f"crc32:{crc:08x}"


def _write_fp8(
    path: Path,
    sample: Sample,
    mask: list[int],
    meta: DumpMeta,
    dump: DumpTensors,
    metadata: dict[str, str],
) -> tuple[int, str]:
    import torch

    from hsq import quant, stfile
    from hsq.protocol import AUX_TENSOR, LAST_TENSOR

    n = len(sample.input_ids)
    entries: list[tuple[str, str, list[int], int]] = [
        ("input_ids", "I64", [n], 8 * n),
        ("loss_mask", "I64", [n], 8 * n),
    ]
    sources: list[memoryview | bytes | tuple[int, int, int]] = [
        _int64_bytes(sample.input_ids),
        _int64_bytes(mask),
    ]
    for name, groups in ((AUX_TENSOR, len(meta.layer_ids)), (LAST_TENSOR, 1)):
        info = dump.header.tensors[name]
        dtype = stfile.torch_dtype(info.dtype)
        x = torch.frombuffer(
            dump.mm, dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.start
        ).view(info.shape)
        q, scale = quant.quantize(x, groups)
        sname = quant.scale_name(name)
        entries += [
            (name, quant.FP8_CODE, list(q.shape), q.numel()),
            (sname, "F32", list(scale.shape), 4 * scale.numel()),
        ]
        sources += [stfile.tensor_bytes(q), stfile.tensor_bytes(scale)]
    header = stfile.build_header(entries, metadata)
    nbytes, crc = write_durably(path, lambda fd: stfile.write(fd, header, sources))
    return nbytes, f"crc32:{crc:08x}"


def file_checksum(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


T = TypeVar("T")


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
FOREIGN_TEMP_AGE_S = 600.0
"""A temp file from another host this old has no live writer: one sample writes in seconds."""


def write_durably(path: Path, fill: Callable[[int], T]) -> T:
    """`fill(fd)` a temp file in the same directory, fsync, rename, fsync the directory;
    OutputError when the disk refuses (full, read-only, ...), leaving no temp behind.

    The temp is named after its writer (host, pid), so whoever writes the same output next
    can remove what a killed writer left (`_sweep_dead_temps`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            result = fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        what = "disk full" if exc.errno == errno.ENOSPC else exc.strerror
        raise OutputError(f"cannot write {path}: {what}") from exc
    _sweep_dead_temps(path)
    return result


def _sweep_dead_temps(path: Path) -> None:
    """Remove temps of `path` whose writer is dead (kill -9 mid-write leaves one).

    Same host: the pid is gone. Another host: older than FOREIGN_TEMP_AGE_S. A live
    duplicate writer's temp is never touched, so its rename still lands. Best effort."""
    prefix = f".{path.name}."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix) : -len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        host, pid = parts[0], int(parts[1])
        temp = path.parent / name
        try:
            if host == _HOST:
                if pid == os.getpid() or _alive(pid):
                    continue
            elif time.time() - temp.stat().st_mtime < FOREIGN_TEMP_AGE_S:
                continue
            temp.unlink()
        except OSError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


def read_header(path: Path) -> Any:
    """The safetensors header of a file (stfile.Header): cheap enough for 100k files."""
    from hsq import stfile

    fd = os.open(path, os.O_RDONLY)
    try:
        return stfile.read_header(fd)
    finally:
        os.close(fd)


def check_output(
    path: Path,
    sample_id: str,
    entry: ManifestEntry,
    *,
    deep: bool = False,
    store_dtype: str | None = None,
) -> list[str]:
    """Problems with one output file (empty list: fine). Deep reads every byte.

    `store_dtype` is the run's storage format: a file in another format is a problem (a
    run holds one format, so readers never meet a mix)."""
    from hsq import quant

    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return ["missing"]
    problems: list[str] = []
    if size != entry.bytes:
        problems.append(f"size {size} != manifest {entry.bytes}")
    try:
        header = read_header(path)
        meta = header.metadata
        n = entry.num_tokens
        if meta.get("sample_id") != sample_id:
            problems.append(f"sample_id {meta.get('sample_id')!r} != {sample_id!r}")
        if meta.get("num_tokens") != str(n):
            problems.append(f"num_tokens {meta.get('num_tokens')} != manifest {n}")
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"):
            info = header.tensors.get(name)
            if info is None or not info.shape or info.shape[0] != n:
                shape = None if info is None else info.shape
                problems.append(f"{name} shape {shape} does not start with {n}")
        fmt = quant.store_dtype_of(meta)
        if store_dtype is not None and fmt != store_dtype:
            problems.append(f"stored as {fmt}, the run stores {store_dtype}")
        if entry.store_dtype != fmt:
            problems.append(f"stored as {fmt}, manifest says {entry.store_dtype}")
        layer_ids = jsonsafe.loads(meta.get("layer_ids", "null"))
        groups = len(layer_ids) if isinstance(layer_ids, list) and layer_ids else None
        problems += quant.layout_problems(fmt, header.tensors, n, groups)
    except (OSError, ValueError, OutputError) as exc:
        return [*problems, f"unreadable header: {exc}"]
    if deep and not problems:
        problems += _deep_check(path, entry, fmt)
    return problems


def _deep_check(path: Path, entry: ManifestEntry, fmt: str) -> list[str]:
    import torch
    from safetensors.torch import load_file

    from hsq import quant
    from hsq.protocol import fingerprint

    if file_checksum(path) != entry.checksum:
        return ["checksum mismatch"]
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for damaged files
        return [f"unreadable tensors: {exc}"]
    problems = []
    for name in ("aux_hidden_states", "last_hidden_state"):
        if fmt == quant.FP8:
            sname = quant.scale_name(name)
            problems += [
                f"{name}: {p}" for p in quant.quantized_problems(tensors[name], tensors[sname])
            ]
        elif not bool(torch.isfinite(tensors[name]).all()):
            problems.append(f"{name} holds NaN or Inf")
    header_fp = read_header(path).metadata.get("input_fingerprint")
    if header_fp != fingerprint(tensors["input_ids"]):
        problems.append("input_ids do not match the recorded fingerprint")
    return problems


# ---------------------------------------------------------------------------- reading
# The one reader of output files: hsq.data and `hsq export` read only through open_output,
# so a new storage format (e.g. FP8 with scales) is decoded here and nowhere else.

_TORCH_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "F8_E4M3": "float8_e4m3fn",
}


@dataclass(frozen=True)
class OutputSample:
    """One output file's tensors, mapped from the file (not copied) and metadata."""

    sample_id: str
    input_ids: Any
    """torch.int64 [T]"""
    loss_mask: Any
    """torch.int64 [T]"""
    aux_hidden_states: Any
    """[T, k*H], the aux layers concatenated in `layer_ids` order"""
    last_hidden_state: Any
    """[T, H], after the model's final norm"""
    layer_ids: list[int]
    metadata: dict[str, str]
    scales: dict[str, Any] = field(default_factory=dict)
    """Only with open_output(raw=True) on an fp8 file: `<name>_scale` float32 tensors
    ([T, k] for aux, [T, 1] for last); the hidden states are then the stored fp8 values."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def open_output(path: Path, *, raw: bool = False) -> OutputSample:
    """Map one output file and check its structure; raises OutputError if it is not one.

    The tensors are views of a private (copy-on-write) mapping: nothing is read until it
    is touched, and nothing is ever written back. Never unpickles. An fp8 file's states
    are dequantized to bf16 (a copy); `raw=True` hands back the stored fp8 values and
    their scales instead.
    """
    import torch

    from hsq import quant, stfile
    from hsq.protocol import AUX_TENSOR, LAST_TENSOR

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise OutputError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        header = stfile.read_header(fd)
        mm = stfile.map_file(fd) if header.file_size else None
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: not a readable output file: {exc}") from exc
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor
    meta = header.metadata
    if meta.get("format") != OUTPUT_FORMAT:
        raise OutputError(f"{path}: format {meta.get('format')!r}, expected {OUTPUT_FORMAT!r}")
    tensors: dict[str, Any] = {}  # every stored tensor, as stored
    for name, info in header.tensors.items():
        if info.dtype not in _TORCH_DTYPES:
            raise OutputError(f"{path}: tensor {name!r} has unknown dtype {info.dtype}")
        dtype = getattr(torch, _TORCH_DTYPES[info.dtype])
        count = info.nbytes // stfile.ITEMSIZE[info.dtype]
        flat = (
            torch.frombuffer(mm, dtype=dtype, count=count, offset=info.start)
            if count and mm is not None
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.view(info.shape)
    # The storage format (fp8 values and their scales) decoded into the logical tensors.
    tensors = quant.logical_tensors(tensors, meta, raw=raw)
    scales = {n: tensors.pop(n) for n in list(tensors) if n.endswith(quant.SCALE_SUFFIX)}
    missing = [n for n in ("input_ids", "loss_mask", AUX_TENSOR, LAST_TENSOR) if n not in tensors]
    if missing:
        raise OutputError(f"{path}: missing tensors {missing}")
    ids, mask = tensors["input_ids"], tensors["loss_mask"]
    aux, last = tensors[AUX_TENSOR], tensors[LAST_TENSOR]
    n = ids.shape[0] if ids.dim() == 1 else -1
    if (
        ids.dtype != torch.int64
        or mask.dtype != torch.int64
        or list(mask.shape) != [n]
        or aux.dim() != 2
        or last.dim() != 2
        or aux.shape[0] != n
        or last.shape[0] != n
        or aux.shape[1] % max(last.shape[1], 1) != 0
    ):
        raise OutputError(
            f"{path}: inconsistent shapes: input_ids {list(ids.shape)}, loss_mask "
            f"{list(mask.shape)}, {AUX_TENSOR} {list(aux.shape)}, {LAST_TENSOR} {list(last.shape)}"
        )
    try:
        layer_ids = [int(x) for x in jsonsafe.loads(meta.get("layer_ids", "[]"))]
    except (ValueError, TypeError) as exc:
        raise OutputError(f"{path}: bad layer_ids metadata") from exc
    return OutputSample(
        sample_id=meta.get("sample_id", ""),
        input_ids=ids,
        loss_mask=mask,
        aux_hidden_states=aux,
        last_hidden_state=last,
        layer_ids=layer_ids,
        metadata=dict(meta),
        scales=scales,
    )
