"""`hsq tokenize`: a chat JSONL file to the producer's `{id, input_ids, loss_mask}` JSONL.

Every core tokenizes (a process pool, each process with its own tokenizer); the output
keeps the input's order, so the same file and tokenizer give the same bytes. Rows that
cannot be used are written to a rejects file with their reason, and `hsq enqueue` puts
them in the run's dead letter: one row never stops the file (a line that is not JSON, is
nested too deeply, or makes the tokenizer or template raise anything is rejected). The
output is written to a temp name and renamed, so a killed run leaves no half file under
the final name.

Memory is bounded whatever the file: lines are read at most MAX_LINE bytes at a time (a
longer one is skipped in pieces, never held), a batch holds at most BATCH rows and
BATCH_BYTES, at most four batches per process are in flight, and each row tokenizes only
the head of its text that its token limit needs (hsq.producer.chat).
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from hsq import fsio, logs
from hsq.dataset.jsonl import bounded_lines, load_row
from hsq.errors import DatasetError
from hsq.producer.chat import ChatTokenizer, Markers, infer_markers, load_tokenizer
from hsq.producer.settings import TokenizeSettings

if TYPE_CHECKING:
    from hsq.producer.report import Rejected

log = structlog.get_logger("hsq.tokenize")

MAX_LINE = 64 * 2**20
BATCH = 256
BATCH_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Reject:
    line: int
    id: str | None
    reason: str
    message: str

    @property
    def key(self) -> str:
        # "line:" keys are dataset errors to `hsq requeue`: fixed in the data, not retried.
        return f"line:chat:{self.line}"

    def to_json(self) -> str:
        return json.dumps(
            {"line": self.line, "id": self.id, "reason": self.reason, "message": self.message}
        )

    def dead_letter(self) -> Rejected:
        """The row as `enqueue_run` dead-letters it, beside the dataset's invalid lines."""
        return self.key, DatasetError(self.message, self.reason), self.id

    @classmethod
    def from_json(cls, text: str) -> Reject:
        obj = json.loads(text)
        return cls(int(obj["line"]), obj.get("id"), str(obj["reason"]), str(obj["message"]))


@dataclass
class TokenizeReport:
    rows: int = 0
    written: int = 0
    tokens: int = 0
    truncated: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def lines_out(self) -> list[str]:
        bad = sum(self.rejected.values())
        why = ", ".join(f"{r}: {n}" for r, n in self.rejected.most_common())
        rate = self.rows / self.seconds if self.seconds else 0.0
        return [
            f"rows            {self.rows}",
            f"tokenized       {self.written} ({self.tokens} tokens, {self.truncated} truncated)",
            f"rejected        {bad}" + (f" ({why})" if bad else ""),
            f"time            {self.seconds:.1f} s ({rate:.0f} rows/s)",
        ]


def rejects_path(output: Path) -> Path:
    return output.with_name(output.name + ".rejects.jsonl")


def tokens_path(chats: Path) -> Path:
    """Where `hsq enqueue --tokenizer` writes a chat file's tokens unless told: beside it."""
    return chats.with_name(chats.name.removesuffix(".jsonl") + ".tokens.jsonl")


def build(settings: TokenizeSettings) -> ChatTokenizer:
    tok = load_tokenizer(settings.tokenizer, settings.template)
    if settings.assistant_header and settings.end_of_turn:
        markers = Markers(settings.assistant_header, settings.end_of_turn)
    else:
        inferred = infer_markers(tok)
        markers = Markers(
            settings.assistant_header or inferred.assistant_header,
            settings.end_of_turn or inferred.end_of_turn,
        )
    return ChatTokenizer(tok, markers, settings.options)


_worker: ChatTokenizer | None = None


def _init(settings: TokenizeSettings) -> None:
    global _worker
    # One process per core already; the Rust tokenizer's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = build(settings)


def _best_id(row: Any) -> str | None:
    rid = row.get("id") if isinstance(row, dict) else None
    return str(rid)[:200] if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


@dataclass(frozen=True)
class Row:
    """A tokenized row: its output line and what the report and the id check need."""

    line_no: int
    line: str
    id: str
    tokens: int
    truncated: bool
    id_given: str | None
    """The id as the row wrote it (`1` or `'1'`); None when derived from the content."""


Result = Row | Reject


def tokenize_line(chat: ChatTokenizer, line_no: int, body: bytes | None) -> Result:
    """One row; every failure is a Reject with a reason, never an exception (a row that
    makes the tokenizer or its template raise anything must not stop the file)."""
    row: Any = None
    try:
        if body is None:
            raise DatasetError(f"line longer than {MAX_LINE} bytes", "too_long")
        row = load_row(body)
        t = chat(row)
        given = row.get("id") if isinstance(row, dict) else None
        id_given = (
            None if given is None else (repr(given) if isinstance(given, str) else str(given))
        )
        return Row(line_no, t.to_json(), t.id, len(t.input_ids), t.truncated, id_given)
    except DatasetError as exc:
        return Reject(line_no, _best_id(row), exc.reason, str(exc))
    except Exception as exc:  # a tokenizer or template bug on one row: reject it, go on
        log.warning("tokenize_row_failed", line=line_no, error=f"{type(exc).__name__}: {exc}")
        msg = f"tokenizing failed: {type(exc).__name__}: {str(exc)[:500]}"
        return Reject(line_no, _best_id(row), "tokenize_error", msg)


def _work(batch: list[tuple[int, bytes | None]]) -> list[Result]:
    assert _worker is not None, "pool initializer did not run"
    return [tokenize_line(_worker, n, body) for n, body in batch]


def _batches(path: Path) -> Iterator[tuple[list[tuple[int, bytes | None]], int]]:
    """(rows, their bytes in the file), at most BATCH rows and about BATCH_BYTES each; a
    line over MAX_LINE comes as None, never read whole."""
    batch: list[tuple[int, bytes | None]] = []
    size = held = 0
    with open(path, "rb") as f:
        for line_no, (line, n) in enumerate(bounded_lines(f, MAX_LINE), start=1):
            size += n
            body = None if line is None else line.strip()
            if body is None or body:
                batch.append((line_no, body))
                held += len(body or b"")
            if len(batch) >= BATCH or held >= BATCH_BYTES:
                yield batch, size
                batch, size, held = [], 0, 0
    if batch or size:
        yield batch, size


def _ordered_window(
    pool: Any, items: Iterator[tuple[list[tuple[int, bytes | None]], int]], window: int
) -> Iterator[tuple[list[Result], int]]:
    """pool.imap in order, but at most `window` batches submitted and not yet consumed
    (imap reads its whole input ahead: a big file would sit in memory)."""
    pending: collections.deque[tuple[Any, int]] = collections.deque()
    for batch, size in items:
        pending.append((pool.apply_async(_work, (batch,)), size))
        if len(pending) >= window:
            res, n = pending.popleft()
            yield res.get(), n
    while pending:
        res, n = pending.popleft()
        yield res.get(), n


@contextlib.contextmanager
def _mapper(
    jobs: int, settings: TokenizeSettings, chat: ChatTokenizer
) -> Iterator[Callable[[Iterator[tuple[list[tuple[int, bytes | None]], int]]], Any]]:
    """An ordered, bounded map over batches: in this process for one job, else a pool."""
    global _worker
    if jobs == 1:
        _worker = chat
        try:
            yield lambda items: ((_work(b), n) for b, n in items)
        finally:
            _worker = None
        return
    # spawn: a fork of a process that already ran the Rust tokenizer can deadlock.
    with mp.get_context("spawn").Pool(jobs, initializer=_init, initargs=(settings,)) as pool:
        yield lambda items: _ordered_window(pool, items, 4 * jobs)


@dataclass
class _Ids:
    """Ids seen so far: the later of two rows with one id is rejected naming the first."""

    seen: dict[str, tuple[int, str | None]] = field(default_factory=dict)

    def check(self, line: int, row: Row) -> Reject | None:
        first = self.seen.get(row.id)
        if first is None:
            self.seen[row.id] = (line, row.id_given)
            return None
        other_line, other_given = first

        def how(given: str | None) -> str:
            return f"id {given}" if given is not None else "an id derived from its content"

        return Reject(
            line,
            row.id,
            "duplicate_id",
            f"duplicate id {row.id!r}: this row has {how(row.id_given)} and line {other_line} "
            f"has {how(other_given)}, the same id (ids are compared as text); line "
            f"{other_line} is kept",
        )


def tokenize_file(
    src: Path, dst: Path, settings: TokenizeSettings, *, progress: bool = True
) -> tuple[TokenizeReport, list[Reject]]:
    import time

    t0 = time.perf_counter()
    chat = build(settings)  # fail fast (tokenizer, template, markers) before any process
    # By default a process per core, but not more than one per MiB: starting a process
    # (importing transformers, loading the tokenizer) costs seconds.
    jobs = settings.jobs or min(os.cpu_count() or 1, src.stat().st_size // 2**20 + 1)
    report = TokenizeReport()
    rejects: list[Reject] = []
    ids = _Ids()
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    rtmp = rejects_path(dst).with_name(f".{rejects_path(dst).name}.{os.getpid()}.tmp")
    try:
        with (
            _mapper(jobs, settings, chat) as mapper,
            open(tmp, "w") as out,
            open(rtmp, "w") as rout,
            logs.progress(src.stat().st_size, "B", "tokenizing", enabled=progress) as bar,
        ):
            for results, size in mapper(_batches(src)):
                for res in results:
                    report.rows += 1
                    if isinstance(res, Row):
                        res = ids.check(res.line_no, res) or res
                    if isinstance(res, Reject):
                        rejects.append(res)
                        rout.write(res.to_json() + "\n")
                        report.rejected[res.reason] += 1
                    else:
                        out.write(res.line + "\n")
                        report.written += 1
                        report.tokens += res.tokens
                        report.truncated += res.truncated
                bar.update(size)
            out.flush()
            os.fsync(out.fileno())
            rout.flush()
            os.fsync(rout.fileno())
        fsio.rename_durably(tmp, dst)
        fsio.rename_durably(rtmp, rejects_path(dst))
    finally:
        tmp.unlink(missing_ok=True)
        rtmp.unlink(missing_ok=True)
    report.seconds = time.perf_counter() - t0
    log.info(
        "tokenized",
        rows=report.rows,
        written=report.written,
        rejected=sum(report.rejected.values()),
        seconds=round(report.seconds, 2),
        jobs=jobs,
    )
    return report, rejects


def read_rejects(path: Path) -> list[Reject]:
    if not path.exists():
        return []
    with open(path) as f:
        return [Reject.from_json(line) for line in f if line.strip()]
