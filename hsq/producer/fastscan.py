"""The producer's fast dataset scan: batches of index entries, validated at C speed.

`hsq.dataset.jsonl.scan_dataset` validates a line by json.loads and Python loops over its tokens
(~60 us for a 450-byte line). Almost every line of a real dataset has one shape:
`{"id": ..., "input_ids": [...], "loss_mask": [...]}`, any spacing. For those, msgspec (a
compiled JSON decoder) decodes the line into a typed record whose ranges it checks in C
(tokens non-negative int32, mask 0/1, at least one token), which proves the line valid at
~4 us. Every line that does not fit that shape (another key, a float, a token out of range,
more tokens than --max-tokens, a mask of another length, an unsafe id) goes through
`hsq.dataset.jsonl.parse_line`, so the outcome for every line is parse_line's: the fast path only
ever accepts lines parse_line accepts, with the same id and token count (tests/test_scale.py
checks that on crafted and randomly damaged lines). Blank lines, over-long lines and
duplicate ids are handled as scan_dataset does.

Entries come out encoded ("offset:length:crc32:num_tokens", IndexEntry.encode's format), in
batches, so neither a list of every line nor an object per line is ever built; what stays is
the id -> first line map duplicate detection needs (~110 bytes an id).

The file is cut into pieces of PIECE_BYTES; a piece holds the lines that start in its byte
range and is scanned on its own (`scan_piece`, line numbers counted from the piece's first
line). A large file's pieces are scanned by a pool of processes, a few pieces ahead of the
caller, so the scan runs beside the caller's Redis writes on another core; pieces are taken
in file order, and line numbers, duplicates and the first line of every id are settled here,
in the caller's process, exactly as one sequential pass would (tests/test_scale.py compares
both with `hsq.dataset.jsonl.scan_dataset`).
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import msgspec

from hsq.dataset import jsonl as dataset
from hsq.dataset.fastline import decode_line
from hsq.dataset.jsonl import SAFE_ID_RE, duplicate_id_error, parse_line
from hsq.dataset.jsonl import _best_effort_id as _best_effort_id  # the id scan_dataset records
from hsq.errors import DatasetError
from hsq.store.connection import pack

Bad = tuple[str, DatasetError, str | None]
Packed = bytes
"""A Redis command packed as RESP (hsq.store.connection.pack)."""


_ID_LIMIT = 10**128  # an integer id of more digits is unsafe (SAFE_ID_RE: 128 characters)


FastCount = tuple[str, int, bool]
"""(id, token count, whether the id is written as a JSON integer) of a valid line."""


def _fast_count(line: bytes, max_tokens: int | None) -> FastCount | None:
    """(id, token count, whether the id is a JSON integer) if the line is certainly valid;
    None if parse_line must decide. msgspec agrees with json.loads on what it accepts here
    (a repeated key: the last wins in both; escapes in keys and strings; no NaN, no floats
    for ints, UTF-8 checked), and anything it refuses is parse_line's to judge."""
    try:
        row = decode_line(line)
    except msgspec.MsgspecError:
        return None
    n = len(row.input_ids)
    if (max_tokens is not None and n > max_tokens) or (
        row.loss_mask is not None and len(row.loss_mask) != n
    ):
        return None
    sid = row.id
    if isinstance(sid, int):  # (never a bool: msgspec refuses one for an int)
        # Digits only once in range, so safe; str() of a huge int would raise.
        return (str(sid), n, True) if 0 <= sid < _ID_LIMIT else None
    return (sid, n, False) if SAFE_ID_RE.fullmatch(sid) else None


@dataclass
class ScanBatch:
    """One batch of a scan: valid samples (id, encoded index entry), their tokens, and the
    invalid lines met on the way (key `line:<n>`, the error, the id if one could be read)."""

    valid: list[tuple[str, str]] = field(default_factory=list)
    tokens: int = 0
    bad: list[Bad] = field(default_factory=list)
    lines: int = 0
    bytes: int = 0
    packed_index: Packed | None = None
    """`valid`'s index HSET, packed by the scanning process (scan_batches' index_key), or
    None: the caller writes `valid` itself."""


@dataclass
class Piece:
    """What scanning one byte range found, line numbers counted from 1 at its first line.
    Plain values only (it crosses a process boundary): `bad` holds (line, message, reason,
    id) and `line_nos` the line of each valid sample (`ids`)."""

    ids: list[str] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)
    """The encoded index entry of each valid sample (flat lists: cheaper to pickle)."""
    line_nos: list[int] = field(default_factory=list)
    tokens: int = 0
    bad: list[tuple[int, str, str, str | None]] = field(default_factory=list)
    lines: int = 0
    """Dataset lines (blank lines are none)."""
    physical: int = 0
    """Every line that starts in the range, blank ones too: the next piece's line base."""
    bytes: int = 0
    numeric: list[int] = field(default_factory=list)
    """Indices (into `ids`) of the samples whose id the line wrote as a JSON integer: only
    digit-only ids can be, and the duplicate message names each spelling (not "duplicate id '1'" for
    a 1 and a "1")."""
    packed: list[Packed] = field(default_factory=list)
    """HSET commands of the index entries, `batch` samples each (scan_piece's index_key)."""


PIECE_BYTES = 8 * 2**20
"""Bytes of the file one piece covers (~16,000 lines of 500 bytes)."""
PARALLEL_FROM = 64 * 2**20
"""Files this large or larger are scanned by a pool of processes (smaller: in process)."""


def scan_piece(
    path: Path,
    start: int,
    end: int,
    max_tokens: int | None,
    limit: int | None = None,
    index_key: str | None = None,
    batch: int = 5000,
) -> Piece:
    """Scan the lines that start in [start, end). A line that began before `start` is the
    previous piece's, and is skipped here; the last line is read to its end wherever that is.
    `index_key`: also pack the HSETs of the entries into that hash, `batch` a command (here,
    beside the caller, so its process only sends them)."""
    limit = dataset.MAX_LINE_BYTES if limit is None else limit  # read now: tests lower it
    out = Piece()
    with open(path, "rb") as f:
        offset = start
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":  # inside a line: skip to the next line's start
                while (part := f.readline(2**20)) and not part.endswith(b"\n"):
                    offset += len(part)
                offset += len(part)
        first = offset
        # The whole lines of the range in one read, split in C; the last line (the one that
        # runs on past `end`, or ends the file without a newline) line by line below.
        whole = f.read(end - offset).split(b"\n") if offset < end else [b""]
        rest = whole.pop()  # the start of the last line, or b"" if the range ends at one's end
        line_no = _scan_lines(out, whole, offset, 0, max_tokens, limit)
        offset += sum(map(len, whole)) + len(whole)
        f.seek(offset)
        readline = f.readline
        while rest and offset < end and (line := readline(limit + 1)):
            line_no += 1
            size = len(line)
            at, offset = offset, offset + size
            if not line.endswith(b"\n") and size > limit:
                while line and not line.endswith(b"\n"):  # skipped in pieces, never held
                    line = readline(2**20)
                    offset += len(line)
                out.lines += 1
                msg = f"line of {offset - at} bytes, longer than the limit of {limit}"
                out.bad.append((line_no, msg, "too_long", None))
                continue
            _scan_lines(out, [line.rstrip(b"\r\n")], at, line_no - 1, max_tokens, limit)
        out.physical = line_no
        out.bytes = offset - first
    if index_key is not None:
        for i in range(0, len(out.ids), batch):
            pairs = chain.from_iterable(
                zip(out.ids[i : i + batch], out.entries[i : i + batch], strict=True)
            )
            out.packed.append(pack("HSET", index_key, *pairs))
    return out


def _scan_lines(
    out: Piece, lines: list[bytes], at: int, line_no: int, max_tokens: int | None, limit: int
) -> int:
    """Judge `lines` (without their newline; the first starts at byte `at`, after line
    `line_no`) into `out`; returns the last line's number. The hot loop: locals only."""
    crc32, fast = zlib.crc32, _fast_count
    ids, entries, line_nos, numeric = out.ids, out.entries, out.line_nos, out.numeric
    bad = out.bad
    tokens = blank = 0
    for line in lines:
        line_no += 1
        size = len(line)
        body = line.rstrip(b"\r") if line.endswith(b"\r") else line
        if size > limit:  # (a whole line's length counts its newline)
            msg = f"line of {size + 1} bytes, longer than the limit of {limit}"
            bad.append((line_no, msg, "too_long", None))
        elif (got := fast(body, max_tokens)) is not None or (
            got := _slow(out, body, line_no, max_tokens)
        ):
            sid, n, is_number = got
            if is_number:  # the id written as a JSON integer (id_text: `1`, not `'1'`)
                numeric.append(len(ids))
            ids.append(sid)
            entries.append(f"{at}:{len(body)}:{crc32(body)}:{n}")
            line_nos.append(line_no)
            tokens += n
        elif not body.strip():
            blank += 1  # blank lines are not dataset lines
        at += size + 1
    out.tokens += tokens
    out.lines += len(lines) - blank
    return line_no


def _slow(out: Piece, body: bytes, line_no: int, max_tokens: int | None) -> FastCount | None:
    """parse_line's verdict on a line the fast path did not take: the sample, or None (the
    line went to `out.bad`, or is blank)."""
    if not body.strip():
        return None
    try:
        sample = parse_line(body, max_tokens)
    except DatasetError as exc:
        out.bad.append((line_no, str(exc), exc.reason, _best_effort_id(body)))
        return None
    return sample.id, len(sample.input_ids), sample.id_text == sample.id


def _ranges(size: int, piece: int) -> Iterator[tuple[int, int]]:
    for start in range(0, max(size, 1), piece):
        yield start, min(start + piece, size)


def _pieces(
    path: Path,
    max_tokens: int | None,
    piece: int,
    procs: int | None,
    index_key: str | None,
    batch: int,
) -> Iterator[Piece]:
    """Every piece of the file, in file order: in process, or by a pool a few pieces ahead."""
    size = path.stat().st_size
    n = procs if procs is not None else (os.cpu_count() or 1)
    if n <= 1 or (procs is None and size < PARALLEL_FROM):
        for start, end in _ranges(size, piece):
            yield scan_piece(path, start, end, max_tokens, None, index_key, batch)
        return
    with ProcessPoolExecutor(n) as pool:
        ahead: deque[Future[Piece]] = deque()
        for start, end in _ranges(size, piece):
            task = (path, start, end, max_tokens, None, index_key, batch)
            ahead.append(pool.submit(scan_piece, *task))
            if len(ahead) > 2 * n:  # bounded: memory holds a few pieces, never the file
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def scan_batches(
    path: Path,
    max_tokens: int | None = None,
    *,
    batch: int = 5000,
    seen: dict[str, int],
    procs: int | None = None,
    piece: int = PIECE_BYTES,
    index_key: str | None = None,
) -> Iterator[ScanBatch]:
    """Scan a JSONL dataset in batches of at most `batch` valid samples. `seen` (id -> line
    of its first occurrence) is filled as the scan goes; ids met again are `duplicate_id`.
    `procs`: scanning processes (default: the CPUs, for files of PARALLEL_FROM bytes or more;
    1: in process). `index_key`: each batch of a piece without duplicates comes with its
    index HSET into that hash packed (ScanBatch.packed_index)."""
    base = 0  # lines before the piece
    numeric: set[str] = set()  # ids whose first line wrote them as a JSON integer
    for p in _pieces(path, max_tokens, piece, procs, index_key, batch):
        packed: list[Packed] | None = p.packed if index_key is not None else None
        out = ScanBatch(lines=p.lines, bytes=p.bytes)
        out.bad = [(f"line:{base + n}", DatasetError(msg, why), sid) for n, msg, why, sid in p.bad]
        firsts = dict(zip(p.ids, map(base.__add__, p.line_nos), strict=True))
        if len(firsts) == len(p.ids) and seen.keys().isdisjoint(firsts):
            # No duplicate: every id is new (the usual case, settled at C speed).
            seen.update(firsts)
            valid, out.tokens = list(zip(p.ids, p.entries, strict=True)), p.tokens
            numeric.update(p.ids[i] for i in p.numeric)
        else:
            valid = _drop_duplicates(p, base, seen, out, numeric)
            packed = None  # made for every id of the piece: the duplicates' too
        base += p.physical
        if out.bad:  # keep the lines in file order: bad ones before the next batch
            out.bad.sort(key=lambda b: int(b[0][5:]))
        for i in range(0, max(len(valid), 1), batch):
            part = out if i == 0 else ScanBatch()  # the first carries the piece's counts
            part.valid = valid[i : i + batch]
            if packed and part.valid:
                part.packed_index = packed[i // batch]
            yield part


def _drop_duplicates(
    p: Piece, base: int, seen: dict[str, int], out: ScanBatch, numeric: set[str]
) -> list[tuple[str, str]]:
    """The piece's valid samples less the ids met before (each a `duplicate_id`, its message
    naming both spellings as scan_dataset's does)."""
    valid: list[tuple[str, str]] = []
    as_number = set(p.numeric)
    for i, (sid, entry, n) in enumerate(zip(p.ids, p.entries, p.line_nos, strict=True)):
        line_no = base + n
        first = seen.setdefault(sid, line_no)
        if first != line_no:
            form = sid if i in as_number else repr(sid)
            first_form = sid if sid in numeric else repr(sid)
            err = duplicate_id_error(sid, form, first, first_form)
            out.bad.append((f"line:{line_no}", err, None))
            continue
        if i in as_number:
            numeric.add(sid)
        valid.append((sid, entry))
        out.tokens += int(entry.rpartition(":")[2])
    return valid
