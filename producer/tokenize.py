"""`hsq tokenize`: a chat JSONL file to the producer's `{id, input_ids, loss_mask}` JSONL.

Every core tokenizes (a process pool, each process with its own tokenizer); the output
keeps the input's order, so the same file and tokenizer give the same bytes. Rows that
cannot be used are written to a rejects file with their reason, and `hsq enqueue` puts
them in the run's dead letter. The output is written to a temp name and renamed, so a
killed run leaves no half file under the final name.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hsq import logs
from hsq.chat import ChatOptions, ChatTokenizer, Markers, infer_markers, load_tokenizer
from hsq.errors import DatasetError

log = structlog.get_logger("hsq.tokenize")

MAX_LINE = 64 * 2**20
BATCH = 256


@dataclass(frozen=True)
class TokenizeSettings:
    tokenizer: str
    template: str | None = None
    assistant_header: str | None = None
    end_of_turn: str | None = None
    options: ChatOptions = field(default_factory=ChatOptions)
    jobs: int | None = None


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
    return str(rid)[:200] if isinstance(rid, (str, int)) else None


Result = tuple[str, int, bool] | Reject
"""(output line, tokens, truncated) or the reason the row was rejected."""


def tokenize_line(chat: ChatTokenizer, line_no: int, body: bytes) -> Result:
    row: Any = None
    try:
        if len(body) > MAX_LINE:
            raise DatasetError(f"line longer than {MAX_LINE} bytes", "bad_row")
        row = json.loads(body)
        t = chat(row)
        return t.to_json(), len(t.input_ids), t.truncated
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return Reject(line_no, None, "malformed_json", f"not valid JSON: {exc}")
    except DatasetError as exc:
        return Reject(line_no, _best_id(row), exc.reason, str(exc))


def _work(batch: list[tuple[int, bytes]]) -> list[Result]:
    assert _worker is not None, "pool initializer did not run"
    return [tokenize_line(_worker, n, body) for n, body in batch]


def _batches(path: Path) -> Iterator[list[tuple[int, bytes]]]:
    batch: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            body = line.strip()
            if body:
                batch.append((line_no, body))
            if len(batch) >= BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


@contextlib.contextmanager
def _mapper(jobs: int, settings: TokenizeSettings, chat: ChatTokenizer) -> Iterator[Any]:
    """An ordered map over batches: in this process for one job, else a process pool."""
    global _worker
    if jobs == 1:
        _worker = chat
        try:
            yield map
        finally:
            _worker = None
        return
    # spawn: a fork of a process that already ran the Rust tokenizer can deadlock.
    with mp.get_context("spawn").Pool(jobs, initializer=_init, initargs=(settings,)) as pool:
        yield pool.imap


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
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    rtmp = rejects_path(dst).with_name(f".{rejects_path(dst).name}.{os.getpid()}.tmp")
    try:
        with (
            _mapper(jobs, settings, chat) as mapper,
            open(tmp, "w") as out,
            open(rtmp, "w") as rout,
            logs.progress(src.stat().st_size, "B", "tokenizing", enabled=progress) as bar,
        ):
            batches = _batches(src)
            sizes: list[int] = []

            def feed() -> Iterator[list[tuple[int, bytes]]]:
                for b in batches:
                    sizes.append(sum(len(x) + 1 for _, x in b))
                    yield b

            for i, results in enumerate(mapper(_work, feed())):
                for res in results:
                    report.rows += 1
                    if isinstance(res, Reject):
                        rejects.append(res)
                        rout.write(res.to_json() + "\n")
                        report.rejected[res.reason] += 1
                    else:
                        out.write(res[0] + "\n")
                        report.written += 1
                        report.tokens += res[1]
                        report.truncated += res[2]
                bar.update(sizes[i])
            out.flush()
            os.fsync(out.fileno())
            rout.flush()
            os.fsync(rout.fileno())
        os.rename(tmp, dst)
        os.rename(rtmp, rejects_path(dst))
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
