"""Training outputs: one safetensors file per sample, written durably, checked on demand.

    <out>/<run>/<shard>/<sample_id>.safetensors     shard = first 2 hex of sha256(id)

Tensors: input_ids int64 [T], loss_mask int64 [T], aux_hidden_states [T, k*H],
last_hidden_state [T, H] (post-norm), and in runs enqueued with --prenorm
last_hidden_state_prenorm [T, H] (the final layer before the norm); with the run's store
dtype fp8-e4m3 the states are float8_e4m3fn plus float32 `*_scale` tensors (hsq/quant.py).
Metadata: format, sample_id, run, layer_ids, layer_convention, model_id, num_tokens,
input_fingerprint, store_dtype.
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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hsq import jsonsafe
from hsq.dataset import Sample, check_sample_id
from hsq.errors import CorruptDumpError, DatasetError, NonFiniteDumpError, OutputError

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


# ---------------------------------------------------------------------------- manifest codec
# Done entries are stored compactly in Redis (half the memory of the JSON): the path is always
# output_relpath(id), so it is not stored; "crc32:" and the default dtype are implied.
# Readers get the JSON back (manifest_json); an entry of an older hsq is JSON already.
# The store holds entries through this codec (hsq.store.DoneCodec) and knows no file format.
_COMPACT = "m1"


def encode_manifest(sample_id: str, e: ManifestEntry) -> str:
    """A done entry as stored: `m1|tokens|bytes|checksum|worker|time|attempt|dtype`."""
    if e.path != output_relpath(sample_id) or "|" in e.worker + e.checksum + e.store_dtype:
        return e.to_json()  # not the usual shape: stored as it is
    crc = e.checksum.removeprefix("crc32:")
    if ":" in crc:
        crc = e.checksum  # another kind of checksum, kept whole
    dtype = "" if e.store_dtype == "bf16" else e.store_dtype
    when = f"{e.time:.1f}"
    return f"{_COMPACT}|{e.num_tokens}|{e.bytes}|{crc}|{e.worker}|{when}|{e.attempt}|{dtype}"


def manifest_json(sample_id: str, raw: builtins.bytes | str) -> builtins.bytes:
    """A stored done entry as the manifest JSON readers check (untrusted either way: what
    does not decode is handed back as it is, and refused by whoever checks it)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if not data.startswith(b"m1|"):
        return data
    try:
        _, tokens, nbytes, crc, worker, when, attempt, dtype = data.decode().split("|")
        entry = ManifestEntry(
            path=output_relpath(sample_id),
            num_tokens=int(tokens),
            bytes=int(nbytes),
            checksum=crc if ":" in crc else f"crc32:{crc}",
            worker=worker,
            time=float(when),
            attempt=int(attempt),
            store_dtype=dtype or "bf16",
        )
    except (ValueError, UnicodeDecodeError, DatasetError):
        return data
    return entry.to_json().encode()


class ManifestCodec:
    """hsq.store.DoneCodec[ManifestEntry]: how the store keeps manifest entries."""

    def encode(self, sample_id: str, entry: ManifestEntry) -> str:
        return encode_manifest(sample_id, entry)

    def totals(self, entry: ManifestEntry) -> tuple[int, int]:
        return entry.num_tokens, entry.bytes

    def decode(self, sample_id: str, raw: builtins.bytes) -> ManifestEntry | None:
        try:
            return ManifestEntry.from_json(manifest_json(sample_id, raw))
        except (ValueError, TypeError):  # Redis is untrusted: a damaged entry is no entry
            return None

    def as_json(self, sample_id: str, raw: builtins.bytes) -> builtins.bytes:
        return manifest_json(sample_id, raw)


MANIFEST_CODEC = ManifestCodec()


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
    *,
    prenorm: bool = False,
    stats: dict[str, float] | None = None,
    before_rename: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """Write a sample's training file durably from a dump whose header was checked;
    (bytes, checksum "xxh3:<hex>").

    One pass over the dump's bytes, read with pread into buffers of the writer's own (never
    the dump's mapping): bf16 states are checked for NaN/Inf, checksummed and written from
    those very bytes; fp8 states are quantized from them (the quantizer refuses NaN/Inf).
    So a dump rewritten while it is copied cannot put unchecked bytes on disk (issue 23).
    NonFiniteDumpError or CorruptDumpError for a bad dump, OutputError when the disk
    refuses. `stats` gathers seconds per step; `before_rename` runs after the fsync, right
    before the file takes its name, and may raise to leave nothing behind.
    An fp8-e4m3 dump (the server quantized it) goes the same way as bf16: its values and
    scales are checked and copied as they are. `prenorm`: the run stores
    last_hidden_state_prenorm (a dump that has it in a run that does not: left out).
    """
    from hsq import quant, stfile
    from hsq.errors import MetaMismatchError
    from hsq.protocol import FP8, LAYER_CONVENTION, scale_name, state_tensors

    n = len(sample.input_ids)
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    if prenorm and not meta.prenorm:
        raise MetaMismatchError("the run stores the pre-norm final state; the dump has none")
    states = state_tensors(len(meta.layer_ids), prenorm)
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
    entries: list[tuple[str, str, list[int], int]] = [
        ("input_ids", "I64", [n], 8 * n),
        ("loss_mask", "I64", [n], 8 * n),
    ]
    sources: list[stfile.Source] = [_int64_bytes(sample.input_ids), _int64_bytes(mask)]
    if meta.encoding == FP8:
        if store_dtype != quant.FP8:  # check_meta refuses it first; never store a mix
            raise MetaMismatchError(f"an {FP8} dump cannot be stored as {store_dtype}")
        copied = [x for name, _ in states for x in (name, scale_name(name))]
    elif store_dtype == quant.FP8:
        copied = []
        for name, groups in states:
            info = dump.header.tensors[name]
            q, scales = _fp8_sources(dump.fd, info, groups, stats)
            sname = quant.scale_name(name)
            entries += [
                (name, quant.FP8_CODE, list(info.shape), q.nbytes),
                (sname, "F32", [info.shape[0], groups], scales.nbytes),
            ]
            sources += [q, scales]
    else:
        copied = [name for name, _ in states]
    for name in copied:
        info = dump.header.tensors[name]
        entries.append((info.name, info.dtype, info.shape, info.nbytes))
        sources.append(stfile.Range(dump.fd, info.start, info.nbytes, info.dtype, info.name))
    header = stfile.build_header(entries, metadata)
    try:
        return write_durably(
            path,
            lambda fd: stfile.write(fd, header, sources, stats=stats),
            stats=stats,
            before_rename=before_rename,
        )
    except stfile.NonFiniteError as exc:
        raise NonFiniteDumpError(f"dump {exc}") from exc
    except stfile.SourceError as exc:
        raise CorruptDumpError(f"dump tensors: {exc}") from exc


_fp8_work = threading.local()


def _fp8_sources(
    fd: int, info: Any, groups: int, stats: dict[str, float] | None
) -> tuple[Any, Any]:
    """The fp8 values of one dump tensor, quantized a chunk of tokens at a time from bytes
    read once into reused buffers, and their scales (filled on the way, written after)."""
    import torch

    from hsq import quant, stfile

    t, d = info.shape
    item = stfile.ITEMSIZE[info.dtype]
    dtype = stfile.torch_dtype(info.dtype)
    scales = torch.empty((t, groups), dtype=torch.float32)
    rows = quant.CHUNK_TOKENS

    def buffers() -> tuple[Any, Any, Any]:
        # Per thread, grown to the widest tensor seen: [rows, D] raw, float32 and fp8.
        have = getattr(_fp8_work, "bufs", None)
        if have is None or have[1].numel() < rows * d or have[0].numel() < rows * d * item:
            have = (
                torch.empty(rows * d * max(item, 2), dtype=torch.uint8),
                torch.empty(rows * d, dtype=torch.float32),
                torch.empty(rows * d, dtype=torch.float8_e4m3fn),
            )
            _fp8_work.bufs = have
        return have

    def make() -> Iterator[memoryview]:
        raw, work, q = buffers()
        for lo in range(0, t, rows):
            hi = min(t, lo + rows)
            nbytes = (hi - lo) * d * item
            view = memoryview(raw.numpy())[:nbytes]
            t0 = time.perf_counter()
            _pread_exact(fd, view, info.start + lo * d * item)
            t1 = time.perf_counter()
            x = raw[:nbytes].view(dtype).view(hi - lo, d)
            qc = q[: (hi - lo) * d].view(hi - lo, d)
            quant.quantize_into(x, groups, qc, scales[lo:hi], work)
            if stats is not None:
                stats["read_s"] = stats.get("read_s", 0.0) + t1 - t0
                stats["quantize_s"] = stats.get("quantize_s", 0.0) + time.perf_counter() - t1
            yield memoryview(qc.view(torch.uint8).numpy()).cast("B")

    def scale_bytes() -> Iterator[memoryview]:
        yield stfile.tensor_bytes(scales)

    return stfile.Produced(make, t * d), stfile.Produced(scale_bytes, 4 * t * groups)


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    from hsq import stfile

    while view:
        try:
            got = os.preadv(fd, [view], offset)
        except OSError as exc:
            raise stfile.SourceError(f"cannot read the source: {exc}") from exc
        if got == 0:
            raise stfile.SourceError("source file ended early")
        view, offset = view[got:], offset + got


def file_checksum(path: Path, algo: str | None = None) -> str:
    """The file's checksum as a manifest records it: "xxh3:<hex>" (or with `algo`, e.g.
    the algorithm an older entry names: "crc32")."""
    from hsq import stfile

    digest = stfile.Digest(algo or stfile.CHECKSUM)
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    return digest.text


def checksum_matches(path: Path, recorded: str) -> bool:
    """Whether the file has the checksum a manifest recorded, in whichever algorithm the
    record names (xxh3 now, crc32 for files written before); False for an unknown one."""
    from hsq import stfile

    try:
        algo = stfile.checksum_algo(recorded)
    except stfile.FormatError:
        return False
    return file_checksum(path, algo) == recorded


T = TypeVar("T")


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
FOREIGN_TEMP_AGE_S = 600.0
"""A temp file from another host this old has no live writer: one sample writes in seconds."""


def write_durably(
    path: Path,
    fill: Callable[[int], T],
    *,
    stats: dict[str, float] | None = None,
    before_rename: Callable[[], None] | None = None,
) -> T:
    """`fill(fd)` a temp file in the same directory, fsync, rename, fsync the directory;
    OutputError when the disk refuses (full, read-only, ...), leaving no temp behind.
    `before_rename()` runs last before the rename and may raise (nothing is renamed then);
    `stats` gets the seconds of the two fsyncs (fsync_s) and of before_rename (check_s).

    The temp is named after its writer (host, pid), so whoever writes the same output next
    can remove what a killed writer left (`_sweep_dead_temps`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            result = fill(fd)
            t0 = time.perf_counter()
            os.fsync(fd)
            t1 = time.perf_counter()
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        t2 = time.perf_counter()
        os.rename(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        if stats is not None:
            stats["fsync_s"] = stats.get("fsync_s", 0.0) + t1 - t0 + time.perf_counter() - t2
            stats["check_s"] = stats.get("check_s", 0.0) + t2 - t1
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
    prenorm: bool = False,
) -> list[str]:
    """Problems with one output file (empty list: fine). Deep reads every byte.

    `store_dtype` is the run's storage format: a file in another format is a problem (a
    run holds one format, so readers never meet a mix). `prenorm`: the run stores the
    pre-norm final state, so a file without it is a problem."""
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
        names = ["input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"]
        if prenorm or quant.PRENORM in header.tensors:
            names.append(quant.PRENORM)
        for name in names:
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

    if not checksum_matches(path, entry.checksum):
        return ["checksum mismatch"]
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for damaged files
        return [f"unreadable tensors: {exc}"]
    problems = []
    for name in ("aux_hidden_states", "last_hidden_state", quant.PRENORM):
        if name not in tensors:
            continue  # the header check reported a missing required tensor already
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
    last_hidden_state_prenorm: Any = None
    """[T, H], the final layer *before* the model's final norm; None unless the run was
    enqueued with --prenorm (vLLM speculators trains on it)."""

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
    prenorm = tensors.get(quant.PRENORM)
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
        or (prenorm is not None and list(prenorm.shape) != list(last.shape))
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
        last_hidden_state_prenorm=prenorm,
    )
