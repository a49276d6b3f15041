"""The persist stage: validate a staged dump's tensors, write the output durably, mark done.

Bounded: `submit` blocks when `depth` samples wait, so memory and staging space stay
bounded (depth + threads samples) whatever the queue length or dataset size; several
threads overlap one sample's fsync with another's copy and checks (all of it releases the
GIL). Each sample ends as exactly one Event (DONE or FAILED with the exception) on the ack
stage's queue; nothing is decided or dropped here.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import structlog

from hsq.dataset import Sample
from hsq.outputs import ManifestEntry, output_relpath, write_output
from hsq.protocol import DumpMeta, open_dump_tensors
from hsq.workers.chunks import WorkItem
from hsq.workers.commit import Committer
from hsq.workers.events import Event, EventKind
from hsq.workers.metrics import WorkerMetrics
from hsq.workers.runview import Pinner, RunView

log = structlog.get_logger("hsq.worker.persist")


class DoneMarker(Pinner, Protocol):
    def mark_done(self, sample_id: str, entry: ManifestEntry) -> bool: ...


@dataclass
class StagedSample:
    item: WorkItem
    sample: Sample
    staged: Path
    meta: DumpMeta
    """Already checked against the request (rid, fingerprint, count) and the pins."""
    view: RunView
    timings: dict[str, float] = field(default_factory=dict)


class PersistStage:
    def __init__(
        self,
        store: DoneMarker,
        run: str,
        worker_id: str,
        metrics: WorkerMetrics,
        events: queue.Queue[Event],
        *,
        depth: int = 2,
        threads: int = 1,
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self.worker_id = worker_id
        self.metrics = metrics
        self.events = events
        self._on_done = on_done
        self._queue: queue.Queue[StagedSample | None] = queue.Queue(maxsize=max(1, depth))
        # Written samples are marked done in batches; it posts their DONE events.
        self.committer = Committer(store, events)
        self._threads = [
            threading.Thread(target=self._loop, name=f"persist-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, item: StagedSample) -> None:
        self._queue.put(item)

    def drain(self) -> None:
        """Wait until every submitted sample has been handled (and reported)."""
        self._queue.join()
        self.committer.flush()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self.committer.close()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                ev = self.handle(item)
                if ev is not None:  # a written sample's DONE comes from the committer
                    self.events.put(ev)
            finally:
                self._queue.task_done()

    def handle(self, item: StagedSample) -> Event | None:
        try:
            self._persist(item)
        except Exception as exc:  # classified by the ack stage: retried, dead or handed back
            return Event(item.item, EventKind.FAILED, exc)
        finally:
            shutil.rmtree(item.staged, ignore_errors=True)
        return None

    def _persist(self, item: StagedSample) -> None:
        sid = item.item.sample_id
        t0 = time.perf_counter()
        tensors = open_dump_tensors(item.staged, item.meta)  # header, shapes, finite
        try:
            item.view.confirm(item.meta, self.store)  # pins only a fully valid dump (D11)
            t1 = time.perf_counter()
            self.metrics.observe("validate", t1 - t0)
            rel = output_relpath(sid)
            out = item.view.out_root / rel
            store_dtype = item.view.cfg.store_dtype
            nbytes, crc = write_output(out, item.sample, item.meta, tensors, self.run, store_dtype)
        finally:
            tensors.close()
        entry = ManifestEntry(
            path=rel,
            num_tokens=len(item.sample.input_ids),
            bytes=nbytes,
            checksum=crc,
            worker=self.worker_id,
            time=time.time(),
            attempt=item.item.attempt,
            store_dtype=store_dtype,
        )
        self.metrics.observe("persist", time.perf_counter() - t1)

        def marked(newly: bool) -> None:
            self.metrics.done(entry.num_tokens, entry.bytes)
            if self._on_done is not None:
                self._on_done(entry.num_tokens)
            log.info(
                "sample_done",
                sample=sid,
                tokens=entry.num_tokens,
                bytes=entry.bytes,
                attempt=item.item.attempt,
                first=newly,
                persist_ms=round((time.perf_counter() - t0) * 1e3, 2),
                **{k: round(v, 2) for k, v in item.timings.items()},
            )

        self.committer.add(item.item, entry, marked)
