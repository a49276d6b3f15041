"""Logging set-up; only entry points call it (no configuration at import time)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: str = "INFO", fmt: str = "json") -> None:
    """Structured, unbuffered logs on stderr: one JSON object (or key=value line) per event."""
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


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
