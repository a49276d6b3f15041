"""The committer: marks samples done in Redis in batches, after their files are durable.

The persist threads write each output durably and then hand the sample here; one script
call (`RunStore.mark_done_many`) marks up to `max_batch` samples done, at the latest
`max_delay_s` after the first of them was handed over. So Redis sees a handful of commands
per batch instead of several per sample (docs/queue.md), and "done in Redis implies durable
on disk" still holds: nothing is handed over before its file is written.

Each sample still ends as exactly one Event: DONE once the call returned (the callback
first logs and counts it), or FAILED with the call's exception for every sample of the
batch (a purged run, Redis unreachable): the ack stage decides as it did for one sample.
A worker killed with samples waiting here redoes them: the redo finds each file at its
name, adopts it (hsq/outputs/publish.py: no writer replaces a file) and marks it once.

Marks are fenced by ownership: the script marks a sample only while its job
is still in this worker's wip list. A worker stopped (SIGSTOP, a partition) with written
samples waiting here, whose jobs a reaper gave to another worker meanwhile, marks none of
them when it wakes: the other worker's files and marks stand. Such a sample is settled
here without a mark (DONE on the ack stage's queue, no `sample_done` line), as one done
elsewhere; its chunk's finish then finds the job gone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from hsq.outputs.manifest import ManifestEntry
from hsq.store import BatchMarker
from hsq.workers.chunks import WorkItem
from hsq.workers.events import Event, EventKind

log = structlog.get_logger("hsq.worker.commit")

MAX_BATCH = 64
MAX_DELAY_S = 0.2
"""Lag of a done mark behind its file: at 120 samples/s a worker marks ~24 per call; a
killed worker redoes at most this much finished work."""


@dataclass
class _Pending:
    item: WorkItem
    entry: ManifestEntry
    on_marked: Callable[[bool], None]


class Committer:
    def __init__(
        self,
        store: BatchMarker[ManifestEntry],
        events: queue.Queue[Event],
        worker_id: str,
        *,
        max_batch: int = MAX_BATCH,
        max_delay_s: float = MAX_DELAY_S,
    ) -> None:
        self.store = store
        self.events = events
        self.worker_id = worker_id
        self.max_batch = max(1, max_batch)
        self.max_delay_s = max_delay_s
        self._pending: list[_Pending] = []
        self._first_at = 0.0
        self._lock = threading.Condition()
        self._flush_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="committer", daemon=True)
        self._thread.start()

    def add(self, item: WorkItem, entry: ManifestEntry, on_marked: Callable[[bool], None]) -> None:
        """Hand over a sample whose file is durably written."""
        with self._lock:
            if not self._pending:
                self._first_at = time.monotonic()
                self._lock.notify()
            self._pending.append(_Pending(item, entry, on_marked))
            full = len(self._pending) >= self.max_batch
        if full:
            self.flush()  # in the caller's thread: a slow Redis holds back the writers

    def flush(self) -> None:
        """Mark everything handed over so far (synchronous)."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if batch:
                self._commit(batch)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._pending:
                    self._lock.wait()
                if self._closed:
                    return
                wait = self._first_at + self.max_delay_s - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
            self.flush()

    def _commit(self, batch: Sequence[_Pending]) -> None:
        try:
            newly = self.store.mark_held_done(
                self.worker_id, [(p.item.sample_id, p.item.job_id, p.entry) for p in batch]
            )
        except Exception as exc:  # every sample of the batch is classified by the ack stage
            for p in batch:
                self.events.put(Event(p.item, EventKind.FAILED, exc))
            return
        for p, first in zip(batch, newly, strict=True):
            if first is None:  # our job was reaped: the other worker's mark decides
                log.warning(
                    "sample_not_marked_job_taken", sample=p.item.sample_id, job=p.item.job_id
                )
                self.events.put(Event(p.item, EventKind.DONE))
                continue
            try:
                p.on_marked(first)
            except Exception as exc:  # counting or logging failed: the sample is done anyway
                log.warning("done_callback_failed", sample=p.item.sample_id, error=str(exc))
            self.events.put(Event(p.item, EventKind.DONE))
