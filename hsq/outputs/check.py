"""Checking a written output file against its manifest entry (`hsq verify`, adopt)."""

from __future__ import annotations

import errno
import functools
import mmap
import os
from pathlib import Path

from hsq import jsonsafe, quant
from hsq.dump.format import fingerprint
from hsq.errors import OutputError
from hsq.outputs.format import (
    IDS_TENSOR,
    OUTPUT_HEADER,
    REQUIRED_TENSORS,
    OutputSample,
    open_beneath,
    open_output_fd,
    output_relpath,
)
from hsq.outputs.manifest import ManifestEntry
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR, PRENORM_TENSOR, scale_name
from hsq.stfile.arrays import BITS_ONLY, open_tensors
from hsq.stfile.header import FormatError, Header, map_file
from hsq.stfile.header import read_header as read_fd_header
from hsq.stfile.integrity import CHECKSUM, Digest, all_finite, checksum_algo


def file_checksum(path: Path, algo: str | None = None) -> str:
    """The file's checksum as a manifest records it: "xxh3:<hex>" (or with `algo`, e.g.
    the algorithm an older entry names: "crc32")."""
    digest = Digest(algo or CHECKSUM)
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    return digest.text


def checksum_matches(path: Path, recorded: str) -> bool:
    """Whether the file has the checksum a manifest recorded, in whichever algorithm the
    record names (xxh3 now, crc32 for files written before); False for an unknown one."""
    try:
        algo = checksum_algo(recorded)
    except FormatError:
        return False
    return file_checksum(path, algo) == recorded


FileIdentity = tuple[int, int, int, int]
"""A file as fstat knows it: device, inode, size, modification time (ns)."""


def read_checked(
    run_dir: Path,
    sample_id: str,
    entry: ManifestEntry,
    *,
    raw: bool = False,
    checked: FileIdentity | None = None,
) -> tuple[OutputSample, FileIdentity]:
    """A done sample's file read as its manifest entry says it is: opened under `run_dir`
    following no link, its size and checksum as recorded, then open_output's structure
    checks, its sample id and token count; with the file's identity. OutputError (in
    words) if any fails.

    `checked`: the identity this read returned to another process that checksummed the
    file just now (a DataLoader worker, for the trainer's process): if the file opened is
    still that one (same device, inode, size and modification time: outputs are written
    whole and renamed into place, never changed in place) its bytes are not read again for
    the checksum; any other file is checksummed here."""
    shard, name = output_relpath(sample_id).split("/")
    path = run_dir / shard / name
    try:
        fd = open_beneath(run_dir, shard, name, os.O_RDONLY)
    except OSError as exc:
        raise OutputError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size != entry.bytes:
            raise OutputError(f"{path}: {st.st_size} bytes, the manifest records {entry.bytes}")
        mm = None if ident == checked else _checksummed(fd, path, entry)
        fd2 = os.dup(fd)
    finally:
        os.close(fd)
    out = open_output_fd(fd2, path, raw, mm)
    if out.sample_id != sample_id:
        raise OutputError(f"{path} holds {out.sample_id!r}, not {sample_id!r}")
    if out.num_tokens != entry.num_tokens:
        raise OutputError(f"{path}: {out.num_tokens} tokens, the manifest records "
                          f"{entry.num_tokens}")  # fmt: skip
    return out, ident


def _checksummed(fd: int, path: Path, entry: ManifestEntry) -> mmap.mmap | None:
    """The file mapped once and checksummed in place; its tensors are then views of this
    same mapping (no pread copy into fresh buffers, then faults on a second mapping), so
    they are exactly the bytes the checksum covered. None for an empty file."""
    try:
        digest = Digest(checksum_algo(entry.checksum))
    except FormatError as exc:
        raise OutputError(f"{path}: {exc}") from exc
    mm = map_file(fd) if entry.bytes else None
    if mm is not None:
        mm.madvise(mmap.MADV_WILLNEED)  # read ahead: the checksum reads every page
        with memoryview(mm) as view:
            digest.update(view)
    if digest.text != entry.checksum:
        raise OutputError(f"{path}: checksum {digest.text}, the manifest records "
                          f"{entry.checksum}")  # fmt: skip
    return mm


def check_output(
    path: str | Path,
    sample_id: str,
    entry: ManifestEntry,
    *,
    deep: bool = False,
    store_dtype: str | None = None,
    prenorm: bool = False,
    follow: bool = True,
) -> list[str]:
    """Problems with one output file (empty list: fine). Deep reads every byte.

    `store_dtype` is the run's storage format: a file in another format is a problem (a
    run holds one format, so readers never meet a mix). `prenorm`: the run stores the
    pre-norm final state, so a file without it is a problem. `follow=False`: a symlink
    at `path` is not opened but raises OSError(ELOOP), for a caller that decides first
    where a link may lead (verify: one open per file instead of an lstat and an open)."""
    got = read_output_header(path, follow=follow)
    if got is None:
        return ["missing"]
    size, header = got
    problems: list[str] = []
    if size != entry.bytes:
        problems.append(f"size {size} != manifest {entry.bytes}")
    if isinstance(header, Exception):
        return [*problems, f"unreadable header: {header}"]
    try:
        fmt = header_problems(header, sample_id, entry, problems, store_dtype, prenorm)
    except (ValueError, OutputError) as exc:
        return [*problems, f"unreadable header: {exc}"]
    if deep and not problems:
        problems += _deep_check(Path(path), entry, fmt)
    return problems


def read_output_header(
    path: str | Path, *, follow: bool = True
) -> tuple[int, Header | Exception] | None:
    """The read path of a header check: the file's size and its header, or why the header
    could not be read; None when there is no file. One open, fstat and (for a header under
    16 KiB) one read: a verify of a million files does this a million times. `follow`: as
    check_output's."""
    try:
        fd = os.open(path, os.O_RDONLY if follow else os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # e.g. no read permission: the size still says something
        if not follow and exc.errno == errno.ELOOP:
            raise
        try:
            return os.stat(path).st_size, exc
        except FileNotFoundError:
            return None
    try:
        size = os.fstat(fd).st_size
        try:
            return size, read_fd_header(fd, size, OUTPUT_HEADER)
        except (OSError, ValueError, OutputError) as exc:
            return size, exc
    finally:
        os.close(fd)


def header_problems(
    header: Header,
    sample_id: str,
    entry: ManifestEntry,
    problems: list[str],
    store_dtype: str | None = None,
    prenorm: bool = False,
) -> str:
    """Append to `problems` what is wrong with a file's header against its manifest entry
    (pure: no I/O); returns the file's storage format. Raises ValueError or OutputError for
    metadata too damaged to read."""
    meta = header.metadata
    n = entry.num_tokens
    if meta.get("sample_id") != sample_id:
        problems.append(f"sample_id {meta.get('sample_id')!r} != {sample_id!r}")
    if meta.get("num_tokens") != str(n):
        problems.append(f"num_tokens {meta.get('num_tokens')} != manifest {n}")
    names = list(REQUIRED_TENSORS)
    if prenorm or PRENORM_TENSOR in header.tensors:
        names.append(PRENORM_TENSOR)
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
    text = meta.get("layer_ids", "null")
    groups = _groups_cached(text) if len(text) <= 512 else _groups(text)
    problems += quant.layout_problems(fmt, header.tensors, n, groups)
    return fmt


def _groups(layer_ids: str) -> int | None:
    """The number of aux layers a `layer_ids` metadata value names (None: not a list)."""
    ids = jsonsafe.loads(layer_ids)
    return len(ids) if isinstance(ids, list) and ids else None


_groups_cached = functools.lru_cache(maxsize=64)(_groups)
"""A run's files share one `layer_ids`: parsed once, not per file (short values only)."""


def _deep_check(path: Path, entry: ManifestEntry, fmt: str) -> list[str]:
    """Every byte: the checksum, then each hidden state's values (finite; fp8: the scale
    rules) and the ids against the recorded fingerprint. numpy only (the base install)."""
    if not checksum_matches(path, entry.checksum):
        return ["checksum mismatch"]
    try:
        f = open_tensors(path)
    except (OSError, ValueError) as exc:  # FormatError is a ValueError
        return [f"unreadable tensors: {exc}"]
    problems = []
    tensors = f.header.tensors
    for name in (AUX_TENSOR, LAST_TENSOR, PRENORM_TENSOR):
        if name not in tensors:
            continue  # the header check reported a missing required tensor already
        if fmt == FP8:
            if scale_name(name) not in tensors:
                continue  # the header's layout check reported it
            found = quant.quantized_problems(f.array(name), f.array(scale_name(name)))
            problems += [f"{name}: {p}" for p in found]
        elif not all_finite(f.buf, tensors[name]):
            problems.append(f"{name} holds NaN or Inf")
    ids = tensors.get(IDS_TENSOR)
    if ids is None or ids.dtype in BITS_ONLY:
        return [*problems, f"{IDS_TENSOR} missing or not integers"]
    header_fp = f.header.metadata.get("input_fingerprint")
    try:
        if header_fp != fingerprint(f.array(IDS_TENSOR).reshape(-1).tolist()):
            problems.append("input_ids do not match the recorded fingerprint")
    except ValueError as exc:  # ids beyond int32
        problems.append(f"input_ids: {exc}")
    return problems
