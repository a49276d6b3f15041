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
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hsq.dataset import MAX_LINE_BYTES, duplicate_id_error, parse_line
from hsq.dataset import _best_effort_id as _best_effort_id  # the id scan_dataset records
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


def scan_batches(
    path: Path, max_tokens: int | None = None, *, batch: int = 5000, seen: dict[str, int]
) -> Iterator[ScanBatch]:
    """Scan a JSONL dataset in batches of `batch` valid samples. `seen` (id -> line of its
    first occurrence) is filled as the scan goes; ids met again are `duplicate_id`."""
    out = ScanBatch()
    offset = 0
    line_no = 0
    numeric: dict[str, str] = {}  # ids first written as a JSON integer (their spelling)
    crc32 = zlib.crc32
    fast = _fast_count
    with open(path, "rb") as f:
        readline = f.readline
        while line := readline(MAX_LINE_BYTES + 1):
            line_no += 1
            size = len(line)
            start, offset = offset, offset + size
            out.lines += 1
            out.bytes += size
            if not line.endswith(b"\n") and size > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):  # skipped in pieces, never held
                    line = readline(2**20)
                    offset += len(line)
                    out.bytes += len(line)
                err = DatasetError(
                    f"line of {offset - start} bytes, longer than the limit of {MAX_LINE_BYTES}",
                    "too_long",
                )
                out.bad.append((f"line:{line_no}", err, None))
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
                    out.bad.append((f"line:{line_no}", exc, _best_effort_id(body)))
                    continue
                got = (sample.id, len(sample.input_ids))
            sid, n = got
            first = seen.setdefault(sid, line_no)
            if first != line_no:
                # Both spellings, as scan_dataset says it (issue 33 D14).
                first_form = numeric.get(sid, repr(sid))
                err = duplicate_id_error(sid, _id_form(body, sid), first, first_form)
                out.bad.append((f"line:{line_no}", err, None))
                continue
            if sid.isdigit() and _id_form(body, sid) == sid:  # only digits can be a number
                numeric[sid] = sid
            out.valid.append((sid, f"{start}:{len(body)}:{crc32(body)}:{n}"))
            out.tokens += n
            if len(out.valid) >= batch:
                yield out
                out = ScanBatch()
    yield out
