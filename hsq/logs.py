"""Logging set-up; only entry points call it (no configuration at import time).

structlog is imported here on first use, not at this module's import: hsq/cli/ imports
this module for `progress`, and `hsq --version` or any `--help` should not pay for
structlog (about a third of the CLI's start). It is imported without rich (hsq.extras): the
chain formats exceptions itself (format_exc_info, before the renderer), so neither
renderer, JSON or console, ever calls rich.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, TextIO, cast


def configure(level: str = "INFO", fmt: str = "json") -> None:
    """Structured, unbuffered logs on stderr: one JSON object (or key=value line) per event.
    `fmt` auto: key=value lines for a person at a terminal, JSON for anything else."""
    if fmt == "auto":
        fmt = "console" if _isatty(sys.stderr) else "json"
    _load_structlog()
    import structlog

    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # PrintLogger flushes every line, so logs are unbuffered even under a pipe.
        # (PrintLogger calls only write and flush: LossyWriter is a TextIO for it.)
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, LossyWriter(sys.stderr))),
        cache_logger_on_first_use=True,
    )


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


class LossyWriter:
    """A log stream whose failed write loses the line, never the process: `hsq run`'s
    workers log to files on the output disk, and a full disk (ENOSPC) must pause them
    ("output disk full"), not kill them with an exception out of a log call.

    A pipe whose reader is gone (`hsq worker ... 2>&1 | tee w.log`, then tee dies with the
    terminal's Ctrl-C) never comes back: the stream's descriptor is pointed at /dev/null
    (`mute_broken_pipe`), so no later write (this one's, a library's, the interpreter's
    last flush at exit) fails and turns a clean stop into exit 1."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lost = 0

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._lose(broken=True)
            return 0
        except OSError:
            self._lose()
            return 0

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._lose(broken=True)
        except OSError:
            self.lost += 1

    def _lose(self, *, broken: bool = False) -> None:
        self.lost += 1
        if broken:
            mute_broken_pipe(self.stream)


def mute_broken_pipe(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null (its reader is gone for good), then flush
    what its buffer kept from the failed write, to nowhere."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):  # not a real file, or closed
        return
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
    with contextlib.suppress(OSError, ValueError):
        stream.flush()


def _load_structlog() -> None:
    """Import structlog without rich (hsq.extras: no renderer of this chain calls rich)."""
    from hsq.extras import PRETTY, hidden

    with hidden(*PRETTY):
        import structlog  # noqa: F401


def progress(total: int, unit: str, desc: str, *, enabled: bool = True) -> Any:
    """A progress bar for long work, on stderr (stdout carries reports); `unit="B"` counts
    bytes (shown scaled), e.g. of a dataset being read."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        mininterval=0.5,
    )
