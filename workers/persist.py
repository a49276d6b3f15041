"""The persist stage: a bounded, single-thread pipeline step behind the request loop.

The request loop moves a validated dump out of the dump dir into staging and submits it
here; while a persist thread checks and durably writes sample N, the server already
prefills sample N+1. `submit` blocks when `depth` samples wait, so memory and staging space
stay bounded (depth + threads samples) whatever the queue length or dataset size.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from hsq.dataset import Sample
from hsq.protocol import DumpMeta
from hsq.store import ChunkJob, SampleRef

log = structlog.get_logger("hsq.worker.persist")


class ChunkTracker:
    """Counts a chunk's samples still in the persist stage; says when the chunk is finished."""

    def __init__(self, job: ChunkJob) -> None:
        self.job = job
        self._pending = 0
        self._closed = False
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._pending += 1

    def one_done(self) -> bool:
        with self._lock:
            self._pending -= 1
            return self._closed and self._pending == 0

    def close(self) -> bool:
        """No more samples will be added; True if nothing is pending (finish it now)."""
        with self._lock:
            self._closed = True
            return self._pending == 0


@dataclass
class StagedSample:
    ref: SampleRef
    sample: Sample
    staged: Path
    meta: DumpMeta
    """Already checked against the request (rid, fingerprint, count, layers, model)."""
    attempt: int
    tracker: ChunkTracker
    timings: dict[str, float] = field(default_factory=dict)


class Persister:
    def __init__(
        self, handle: Callable[[StagedSample], None], depth: int = 2, threads: int = 1
    ) -> None:
        self._handle = handle
        self._queue: queue.Queue[StagedSample | None] = queue.Queue(maxsize=max(1, depth))
        # Several threads overlap one sample's fsync with another's copy and checks; all of
        # that work releases the GIL.
        self._threads = [
            threading.Thread(target=self._run, name=f"persist-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, item: StagedSample) -> None:
        self._queue.put(item)

    def drain(self) -> None:
        """Wait until every submitted sample has been handled."""
        self._queue.join()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._handle(item)
            except Exception:  # the handler routes expected errors; never kill the stage
                log.exception("persist_handler_crashed")
            finally:
                self._queue.task_done()
