"""JSONL datasets: validation and an offset index (the O(1) read of one sample by its
offset: hsq/dataset/read.py).

One sample a line: {"id": str|int, "input_ids": [int, ...], "loss_mask": [0|1, ...]}.
The producer scans the file once and stores `id -> offset:length:crc32:num_tokens` in
Redis; a worker seeks to the offset, reads the line and checks its CRC, so a dataset edited
after enqueue is detected instead of silently read. The file must be readable at the same
path on every worker node (a shared filesystem); Redis holds about 40 bytes per sample.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from hsq import jsonsafe
from hsq.errors import DatasetError

# Sample ids become file names: keep them to a conservative, portable alphabet.
SAFE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_TOKEN_ID = 2**31 - 1
# Longest dataset line accepted (documented in docs/operations.md). Parsing a line of JSON
# ints costs ~17x its size in memory (a 42 MB line: 713 MB RSS), so 16 MiB bounds a producer
# or worker at ~300 MB per line; at ~7 bytes per token that is still ~1M tokens with a mask.
MAX_LINE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int] | None
    id_text: str = field(default="", compare=False)
    """The id as the line wrote it (`1` or `"1"`): both are the id "1", and a duplicate's
    message shows which form each line used."""


@dataclass(frozen=True)
class IndexEntry:
    offset: int
    length: int
    crc: int
    num_tokens: int

    def encode(self) -> str:
        return f"{self.offset}:{self.length}:{self.crc}:{self.num_tokens}"

    @classmethod
    def decode(cls, text: str | bytes) -> IndexEntry:
        if isinstance(text, bytes):
            text = text.decode()
        offset, length, crc, n = (int(x) for x in text.split(":"))
        return cls(offset, length, crc, n)


def check_sample_id(raw: Any) -> str:
    """Return the id as a string, or raise: ids are never trusted as paths."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise DatasetError("`id` must be a string or an integer", "bad_id")
    sid = str(raw)
    if not SAFE_ID_RE.fullmatch(sid):  # fullmatch: `$` would let a trailing "\n" through
        raise DatasetError(
            f"id {sid[:80]!r} is unsafe as a file name (allowed: {SAFE_ID_RE.pattern})",
            "unsafe_id",
        )
    return sid


def load_row(line: bytes | str) -> Any:
    """A dataset or chat line's JSON; malformed or too deeply nested for the parser is a
    DatasetError (`malformed_json`, `too_deep`), never a crash (jsonsafe)."""
    try:
        return jsonsafe.loads(line)
    except jsonsafe.TooDeepError as exc:
        raise DatasetError(str(exc), "too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"not valid JSON: {exc}", "malformed_json") from exc


def id_text(raw: Any) -> str:
    """How a line wrote its id: `1` for an integer, `'1'` for a string."""
    return repr(raw) if isinstance(raw, str) else str(raw)


def duplicate_id_error(sid: str, form: str, first_line: int, first_form: str) -> DatasetError:
    """The one message for an id met again (both scans): it names both spellings (id_text),
    since `1` and `"1"` are one id (docs/queue.md)."""
    return DatasetError(
        f"duplicate id {sid!r}: this line's id {form} and line {first_line}'s id {first_form} "
        f"are the same id (ids are compared as text); the sample of line {first_line} is kept",
        "duplicate_id",
    )


def parse_line(line: bytes, max_tokens: int | None = None) -> Sample:
    obj = load_row(line)
    if not isinstance(obj, dict):
        raise DatasetError("a line must be a JSON object", "malformed_json")
    if "id" not in obj:
        raise DatasetError("missing `id`", "bad_id")
    sid = check_sample_id(obj["id"])
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise DatasetError("`input_ids` must be a non-empty list", "empty_input_ids")
    if any(type(t) is not int or not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise DatasetError("`input_ids` must hold non-negative int32 integers", "bad_input_ids")
    if max_tokens is not None and len(ids) > max_tokens:
        raise DatasetError(f"{len(ids)} tokens, more than --max-tokens {max_tokens}", "too_long")
    mask = obj.get("loss_mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise DatasetError("`loss_mask` must be a list as long as input_ids", "bad_loss_mask")
        if any(type(m) is not int or m not in (0, 1) for m in mask):
            raise DatasetError("`loss_mask` must hold 0 or 1", "bad_loss_mask")
    return Sample(id=sid, input_ids=ids, loss_mask=mask, id_text=id_text(obj["id"]))


@dataclass(frozen=True)
class ScannedLine:
    line_no: int
    entry: IndexEntry | None
    sample_id: str | None
    error: DatasetError | None


def scan_dataset(path: Path, max_tokens: int | None = None) -> Iterator[ScannedLine]:
    """Yield every non-blank line with its index entry or its error; duplicates are errors
    (ids are compared as text: `1` and `"1"` name one file, so they are one id)."""
    seen: dict[str, tuple[int, str]] = {}
    offset = 0
    with open(path, "rb") as f:
        for line_no, (line, size) in enumerate(bounded_lines(f), start=1):
            start, offset = offset, offset + size
            if line is None:
                err = DatasetError(
                    f"line of {size} bytes, longer than the limit of {MAX_LINE_BYTES}", "too_long"
                )
                yield ScannedLine(line_no, None, None, err)
                continue
            body = line.rstrip(b"\r\n")
            if not body.strip():
                continue
            try:
                sample = parse_line(body, max_tokens)
            except DatasetError as exc:
                yield ScannedLine(line_no, None, _best_effort_id(body), exc)
                continue
            if sample.id in seen:
                first, form = seen[sample.id]
                err = duplicate_id_error(sample.id, sample.id_text, first, form)
                yield ScannedLine(line_no, None, None, err)
                continue
            seen[sample.id] = (line_no, sample.id_text)
            entry = IndexEntry(start, len(body), zlib.crc32(body), len(sample.input_ids))
            yield ScannedLine(line_no, entry, sample.id, None)


def bounded_lines(f: BinaryIO, limit: int | None = None) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size in bytes); None instead of a line longer than `limit` (default
    MAX_LINE_BYTES), which is skipped in pieces without ever being held in memory."""
    limit = MAX_LINE_BYTES if limit is None else limit
    while line := f.readline(limit + 1):
        if line.endswith(b"\n") or len(line) <= limit:
            yield line, len(line)
            continue
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = f.readline(2**20)
            size += len(line)
        yield None, size


def _best_effort_id(body: bytes) -> str | None:
    try:
        obj = load_row(body)
        return check_sample_id(obj["id"]) if isinstance(obj, dict) and "id" in obj else None
    except DatasetError:
        return None
