"""The producer's fast dataset scan: batches of index entries, validated at C speed.

`hsq.dataset.scan_dataset` validates a line by json.loads and Python loops over its tokens
(~60 us for a 450-byte line). Almost every line of a real dataset has one shape:
`{"id": ..., "input_ids": [...], "loss_mask": [...]}` as json.dumps writes it. For those, a
few C-level operations (one regex over character classes, `translate`, `count`) prove the line
valid without building its lists. Every line that does not fit that shape exactly, and every
doubtful one (a token of ten digits, a leading zero, more tokens than --max-tokens), goes
through `hsq.dataset.parse_line`, so the outcome for every line is parse_line's: the fast path
only ever accepts lines parse_line accepts (tests/test_scale.py checks that on crafted
lines). Blank lines, over-long lines and duplicate ids are handled as scan_dataset does.

Entries come out encoded ("offset:length:crc32:num_tokens", IndexEntry.encode's format), in
batches, so neither a list of every line nor an object per line is ever built; what stays is
the id -> first line map duplicate detection needs (~110 bytes an id).

The file is cut into pieces of PIECE_BYTES; a piece holds the lines that start in its byte
range and is scanned on its own (`scan_piece`, line numbers counted from the piece's first
line). A large file's pieces are scanned by a pool of processes, a few pieces ahead of the
caller, so the scan runs beside the caller's Redis writes on another core; pieces are taken
in file order, and line numbers, duplicates and the first line of every id are settled here,
in the caller's process, exactly as one sequential pass would (tests/test_scale.py compares
both with `hsq.dataset.scan_dataset`).
"""

from __future__ import annotations

import os
import re
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hsq import dataset
from hsq.dataset import _best_effort_id as _best_effort_id  # the id scan_dataset records
from hsq.dataset import duplicate_id_error, parse_line
from hsq.errors import DatasetError

Bad = tuple[str, DatasetError, str | None]

# The one shape taken fast; the spans are checked further below. An id is a JSON string of
# the safe alphabet (no escapes possible) or a JSON integer, whose decimal form is safe too.
_SHAPE = re.compile(
    rb'\{"id": ?(?:"([A-Za-z0-9][A-Za-z0-9._-]{0,127})"|(0|[1-9][0-9]{0,127})),'
    rb' ?"input_ids": ?\[([0-9][0-9, ]*)\]'
    rb'(?:, ?"loss_mask": ?\[([01][01, ]*)\])?\}'
)
# A token with a leading zero (not JSON); searched only where a "0" starts a token.
_LEADING_ZERO = re.compile(rb"(?:^|[ ,])0[0-9]")
_DIGITS = b"0123456789"
_AS_D = bytes.maketrans(_DIGITS, b"d" * 10)  # every digit as "d": ten in a row = too long


def _fast_count(line: bytes, max_tokens: int | None) -> tuple[str, int] | None:
    """(id, token count) if the line is certainly valid; None if parse_line must decide."""
    m = _SHAPE.fullmatch(line)
    if m is None:
        return None
    ids = m.group(3)
    n = ids.count(b",") + 1
    if max_tokens is not None and n > max_tokens:
        return None
    # Only digits and n-1 separators, each exactly `sep` (every comma starts one, and they
    # hold every non-digit), no empty token, a digit at either end.
    sep = b", " if b" " in ids else b","
    if (
        ids[-1] not in _DIGITS
        or ids.count(sep) != n - 1
        or ids.translate(None, _DIGITS) != sep * (n - 1)
        or sep + b"," in ids
        or b"dddddddddd" in ids.translate(_AS_D)  # ten digits: maybe over int32
    ):
        return None
    if (ids[0] == 48 or sep + b"0" in ids) and _LEADING_ZERO.search(ids):  # 48: b"0"
        return None
    mask = m.group(4)
    if mask is not None:
        msep = b", " if b" " in mask else b","
        # n one-character tokens of 0/1 at every (1 + len(sep))-th place, and between them
        # nothing but the separators.
        if (
            len(mask) != n + len(msep) * (n - 1)
            or mask[:: 1 + len(msep)].translate(None, b"01")
            or mask.translate(None, b"01") != msep * (n - 1)
        ):
            return None
    sid = m.group(1) if m.group(1) is not None else m.group(2)
    return sid.decode(), n


_ID_START = re.compile(rb'\{"id": ?(?:(")|(?=[0-9]))')


def _id_form(body: bytes, sid: str) -> str:
    """How a valid line wrote its id, as scan_dataset's message names it (id_text): `1` for
    an integer, `'1'` for a string. Only for the duplicate message and digit-only ids."""
    m = _ID_START.match(body)
    if m is None or body.count(b'"id"') != 1:  # off the usual shape: ask the parser
        return parse_line(body).id_text
    return repr(sid) if m.group(1) else sid


@dataclass
class ScanBatch:
    """One batch of a scan: valid samples (id, encoded index entry), their tokens, and the
    invalid lines met on the way (key `line:<n>`, the error, the id if one could be read)."""

    valid: list[tuple[str, str]] = field(default_factory=list)
    tokens: int = 0
    bad: list[Bad] = field(default_factory=list)
    lines: int = 0
    bytes: int = 0


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
    digit-only ids can be, and the duplicate message names each spelling (issue 33 D14)."""


PIECE_BYTES = 8 * 2**20
"""Bytes of the file one piece covers (~16,000 lines of 500 bytes)."""
PARALLEL_FROM = 64 * 2**20
"""Files this large or larger are scanned by a pool of processes (smaller: in process)."""


def scan_piece(
    path: Path, start: int, end: int, max_tokens: int | None, limit: int | None = None
) -> Piece:
    """Scan the lines that start in [start, end). A line that began before `start` is the
    previous piece's, and is skipped here; the last line is read to its end wherever that is."""
    limit = dataset.MAX_LINE_BYTES if limit is None else limit  # read now: tests lower it
    out = Piece()
    crc32 = zlib.crc32
    fast = _fast_count
    with open(path, "rb") as f:
        offset = start
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":  # inside a line: skip to the next line's start
                while (part := f.readline(2**20)) and not part.endswith(b"\n"):
                    offset += len(part)
                offset += len(part)
        first = offset
        readline = f.readline
        line_no = 0
        while offset < end and (line := readline(limit + 1)):
            line_no += 1
            size = len(line)
            at, offset = offset, offset + size
            out.lines += 1
            if not line.endswith(b"\n") and size > limit:
                while line and not line.endswith(b"\n"):  # skipped in pieces, never held
                    line = readline(2**20)
                    offset += len(line)
                msg = f"line of {offset - at} bytes, longer than the limit of {limit}"
                out.bad.append((line_no, msg, "too_long", None))
                continue
            body = line.rstrip(b"\r\n")
            got = fast(body, max_tokens)
            if got is None:
                if not body.strip():
                    out.lines -= 1  # blank lines are not dataset lines
                    continue
                try:
                    sample = parse_line(body, max_tokens)
                except DatasetError as exc:
                    out.bad.append((line_no, str(exc), exc.reason, _best_effort_id(body)))
                    continue
                got = (sample.id, len(sample.input_ids))
            sid, n = got
            if sid.isdigit() and _id_form(body, sid) == sid:
                out.numeric.append(len(out.ids))
            out.ids.append(sid)
            out.entries.append(f"{at}:{len(body)}:{crc32(body)}:{n}")
            out.line_nos.append(line_no)
            out.tokens += n
        out.physical = line_no
        out.bytes = offset - first
    return out


def _ranges(size: int, piece: int) -> Iterator[tuple[int, int]]:
    for start in range(0, max(size, 1), piece):
        yield start, min(start + piece, size)


def _pieces(path: Path, max_tokens: int | None, piece: int, procs: int | None) -> Iterator[Piece]:
    """Every piece of the file, in file order: in process, or by a pool a few pieces ahead."""
    size = path.stat().st_size
    n = procs if procs is not None else (os.cpu_count() or 1)
    if n <= 1 or (procs is None and size < PARALLEL_FROM):
        for start, end in _ranges(size, piece):
            yield scan_piece(path, start, end, max_tokens)
        return
    with ProcessPoolExecutor(n) as pool:
        ahead: deque[Future[Piece]] = deque()
        for start, end in _ranges(size, piece):
            ahead.append(pool.submit(scan_piece, path, start, end, max_tokens))
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
) -> Iterator[ScanBatch]:
    """Scan a JSONL dataset in batches of at most `batch` valid samples. `seen` (id -> line
    of its first occurrence) is filled as the scan goes; ids met again are `duplicate_id`.
    `procs`: scanning processes (default: the CPUs, for files of PARALLEL_FROM bytes or more;
    1: in process)."""
    base = 0  # lines before the piece
    numeric: set[str] = set()  # ids whose first line wrote them as a JSON integer
    for p in _pieces(path, max_tokens, piece, procs):
        out = ScanBatch(lines=p.lines, bytes=p.bytes)
        out.bad = [(f"line:{base + n}", DatasetError(msg, why), sid) for n, msg, why, sid in p.bad]
        firsts = dict(zip(p.ids, p.line_nos, strict=True))
        if len(firsts) == len(p.ids) and seen.keys().isdisjoint(firsts):
            # No duplicate: every id is new (the usual case, settled at C speed).
            seen.update(zip(p.ids, map(base.__add__, p.line_nos), strict=True))
            valid, out.tokens = list(zip(p.ids, p.entries, strict=True)), p.tokens
            numeric.update(p.ids[i] for i in p.numeric)
        else:
            valid = _drop_duplicates(p, base, seen, out, numeric)
        base += p.physical
        if out.bad:  # keep the lines in file order: bad ones before the next batch
            out.bad.sort(key=lambda b: int(b[0][5:]))
        for i in range(0, max(len(valid), 1), batch):
            part = out if i == 0 else ScanBatch()  # the first carries the piece's counts
            part.valid = valid[i : i + batch]
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
