"""The persist stage: validate a staged dump's tensors, write the output durably, mark done.

Bounded: `submit` blocks when `depth` samples wait, so memory and staging space stay
bounded (depth + threads samples) whatever the queue length or dataset size; several
threads overlap one sample's fsync with another's copy and checks (all of it releases the
GIL). With `procs` > 0 each thread drives a persist process (hsq/workers/persist/procs.py)
that does the sample's CPU work (hsq/workers/persist/work.py) outside this interpreter; the
decision before the rename and the done marks stay here. Each sample ends as exactly one
Event (DONE or FAILED with the exception) on the ack stage's queue; nothing is decided or
dropped here.

The stage owns the write engine its threads share (hsq.stfile.engine: write threads and
staging buffers, O_DIRECT per --direct-io) and ends it in close().
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta
from hsq.outputs import publish
from hsq.outputs.format import output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.states import FP8
from hsq.stfile.engine import WriteEngine
from hsq.store import DoneMarker
from hsq.workers.chunks import WorkItem
from hsq.workers.events import Event, EventKind
from hsq.workers.metrics import WorkerMetrics
from hsq.workers.persist.commit import Committer
from hsq.workers.persist.procs import PersistProcs
from hsq.workers.persist.work import WriteJob, write_staged
from hsq.workers.runview import RunView

log = structlog.get_logger("hsq.worker.persist")


class _DoneElsewhere(Exception):
    """The sample was marked done by another worker while this one wrote it."""


class Lease:
    """Whether this worker has held its jobs without a break since it started: its
    heartbeats were sent at most half the heartbeat TTL apart, and the last one recently.

    While that holds no reaper can have taken its jobs, so no other worker is redoing its
    samples. After any longer gap (SIGSTOP, a network partition, a long pause) one may
    have: from then on every sample looks up its done mark right before its rename (one
    Redis read; the same check every sample makes when no Lease is given)."""

    def __init__(self, ttl_s: float) -> None:
        self.limit = ttl_s / 2
        self._last: float | None = None
        self._broken = False

    def renewed(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` (time.monotonic()) succeeded."""
        if self._last is not None and sent_at - self._last > self.limit:
            self._broken = True  # set before _last moves: a reader never sees one alone
        self._last = sent_at

    def held(self) -> bool:
        last = self._last
        return not self._broken and last is not None and time.monotonic() - last < self.limit


@dataclass
class StagedSample:
    item: WorkItem
    sample: Sample
    staged: Path
    meta: DumpMeta
    """Already checked against the request (rid, fingerprint, count) and the pins."""
    view: RunView
    timings: dict[str, float] = field(default_factory=dict)
    confirm_single: Callable[[], None] | None = None
    """Raises MultipleDumpsError if a second dump carrying the rid came meanwhile (the
    dispatcher's last look); called before anything is pinned or written."""


class PersistStage:
    def __init__(
        self,
        store: DoneMarker[ManifestEntry],
        run: str,
        worker_id: str,
        metrics: WorkerMetrics,
        events: queue.Queue[Event],
        *,
        depth: int = 2,
        threads: int = 1,
        on_done: Callable[[int], None] | None = None,
        lease: Lease | None = None,
        direct_io: bool = True,
        procs: int = 0,
    ) -> None:
        self.store = store
        self.run = run
        self.worker_id = worker_id
        self.metrics = metrics
        self.events = events
        self._on_done = on_done
        self._lease = lease
        self._queue: queue.Queue[StagedSample | None] = queue.Queue(maxsize=max(1, depth))
        self.engine = WriteEngine(direct_io=direct_io)
        # Written samples are marked done in batches; it posts their DONE events.
        self.committer = Committer(store, events, worker_id)
        self.procs: PersistProcs | None = None
        if procs > 0:  # one thread per process: it waits on its child, GIL released
            ncpu = os.cpu_count() or 1
            self.procs = PersistProcs(
                procs, direct_io=direct_io, torch_threads=max(1, ncpu // procs)
            )
            threads = procs
        self._threads = [
            threading.Thread(target=self._loop, name=f"persist-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def warm(self, store_dtype: str) -> None:
        """Import what the copy path needs off the hot path now: numpy (the NaN checks)
        and, for an fp8 run, torch (a second or more, holding the GIL), giving each persist
        thread's torch ops an equal share of the cores, so N threads quantizing at once do
        not oversubscribe the machine."""

        def load() -> None:
            import numpy  # noqa: F401

            if store_dtype != FP8 or self.procs is not None:
                return  # persist processes set their own torch threads
            import torch

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(self._threads)))

        threading.Thread(target=load, name="fp8-warm", daemon=True).start()
        if self.procs is not None:
            self.procs.warm(store_dtype)

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
        self.engine.close()  # nothing writes any more
        if self.procs is not None:
            self.procs.close()
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
        except _DoneElsewhere:
            return Event(item.item, EventKind.DONE)  # settled: someone else's file stands
        except Exception as exc:  # classified by the ack stage: retried, dead or handed back
            return Event(item.item, EventKind.FAILED, exc)
        finally:
            shutil.rmtree(item.staged, ignore_errors=True)
        return None

    def _persist(self, item: StagedSample) -> None:
        sid = item.item.sample_id
        t0 = time.perf_counter()
        stats: dict[str, float] = {}

        def before_rename() -> None:
            # The dump's every value has passed by now: only a fully valid dump pins the
            # run's model, layers, dtype and hidden size (a bad first dump once pinned its model and
            # failed every later sample), and one that disagrees
            # with them leaves no file.
            item.view.confirm(item.meta, self.store)
            # A worker that was stopped (SIGSTOP, a partition, a long pause) past its
            # heartbeat must not replace the file of a sample another worker redid and
            # marked done meanwhile: look right before the rename,
            # unless the lease shows no one can have taken the sample.
            # Past a break, the sample's job must still be ours too: once a reaper took it,
            # this worker never renames (nor marks: commit.py) for it again.
            held = self._lease is not None and self._lease.held()
            if not held and (
                item.item.job_id not in self.store.held_job_ids(self.worker_id)
                or self.store.done_among([sid])
            ):
                raise _DoneElsewhere(sid)

        if item.confirm_single is not None:
            item.confirm_single()  # a second dump for the rid fails the attempt
        t1 = time.perf_counter()
        self.metrics.observe("validate", t1 - t0)
        rel = output_relpath(sid)
        out = item.view.out_root / rel
        cfg = item.view.cfg
        store_dtype = cfg.store_dtype
        try:
            if self.procs is not None:
                job = WriteJob.of(
                    out, item.sample, item.meta, item.staged, self.run, store_dtype, cfg.prenorm
                )
                nbytes, checksum = self.procs.write(job, before_rename, stats)
            else:
                nbytes, checksum = write_staged(
                    out,
                    item.sample,
                    item.meta,
                    item.staged,
                    self.run,
                    store_dtype,
                    engine=self.engine,
                    prenorm=cfg.prenorm,
                    stats=stats,
                    before_rename=before_rename,
                )
        except _DoneElsewhere:
            log.warning("sample_done_elsewhere", sample=sid, attempt=item.item.attempt)
            raise
        entry = ManifestEntry(
            path=rel,
            num_tokens=len(item.sample.input_ids),
            bytes=nbytes,
            checksum=checksum,
            worker=self.worker_id,
            time=time.time(),
            attempt=item.item.attempt,
            store_dtype=store_dtype,
        )
        t2 = time.perf_counter()
        self.metrics.observe("persist", t2 - t1)
        self._log_publish(sid, item.item.attempt, stats)
        steps = {k.removesuffix("_s") + "_ms": round(v * 1e3, 2) for k, v in stats.items()}

        def marked(newly: bool) -> None:
            # Called by the committer once the batch holding this sample is marked done.
            t3 = time.perf_counter()
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
                persist_ms=round((t3 - t0) * 1e3, 2),
                validate_ms=round((t1 - t0) * 1e3, 2),
                mark_ms=round((t3 - t2) * 1e3, 2),
                **steps,
                **{k: round(v, 2) for k, v in item.timings.items()},
            )

        self.committer.add(item.item, entry, marked)

    @staticmethod
    def _log_publish(sid: str, attempt: int, stats: dict[str, float]) -> None:
        """What the publish met at the sample's name (hsq.outputs.publish), taken out of
        the step timings: another writer's valid file adopted (marked with its checksum),
        an invalid file replaced, another's file displaced by a third."""
        seen = {k: int(stats.pop(k)) for k in publish.EVENTS if k in stats}
        if seen:
            log.warning("sample_name_taken", sample=sid, attempt=attempt, **seen)
