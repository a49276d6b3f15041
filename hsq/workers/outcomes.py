"""Outcome application: what becomes of a sample, and of its chunk, once a stage reported.

The failure policy (hsq/workers/policy.py) is pure: it turns an exception into a Decision.
This applies it, on the main thread: a retry job or the dead letter in Redis, a chunk
handed back and a pause, a run change noted, a 5xx hold; a chunk finishes once all its
samples are settled, and after a pause or at exit the unfinished ones go back. Every
sample ends done, retried, dead or handed back; nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from hsq.outputs.manifest import ManifestEntry
from hsq.store import ChunkJob, WorkerStore
from hsq.workers.chunks import ChunkBook, OpenChunk, WorkItem
from hsq.workers.claims import Claims
from hsq.workers.notices import ChunkHandedBack, Notices, SampleDone, SampleFailed
from hsq.workers.pauses import Pauses
from hsq.workers.policy import Kind, Outcome, Pause, classify, decide
from hsq.workers.runwatch import RunWatch

log = structlog.get_logger("hsq.worker")


@dataclass(eq=False)
class Outcomes:
    store: WorkerStore[ManifestEntry]
    claims: Claims
    book: ChunkBook
    worker_id: str
    max_server_crashes: int
    pauses: Pauses
    watch: RunWatch
    notices: Notices

    def done(self, item: WorkItem) -> None:
        self.notices.emit(SampleDone(item))
        self.pauses.server_ok()
        self.settled(item)

    def failed(self, item: WorkItem, exc: BaseException, max_attempts: int) -> None:
        sid = item.sample_id
        failure = classify(exc)
        crashes = 0
        if failure.kind is Kind.SERVER_FAIL:
            crashes = self.store.record_crash(sid)
        d = decide(failure, item.attempt, max_attempts, crashes, self.max_server_crashes)
        msg = failure.message
        if d.outcome is Outcome.RUN_CHANGED:
            self.watch.note_changed(msg)
            return
        if d.outcome is Outcome.HAND_BACK:
            assert d.pause is not None
            self.book.hand_back(item)
            log.warning("sample_handed_back", sample=sid, reason=d.reason, error=msg)
            self.pauses.pause(d.pause, msg)
            return
        dead = d.outcome is Outcome.DEAD
        if dead:
            self.store.to_dead(sid, d.reason, msg, d.attempts, self.worker_id)
            log.error("sample_dead", sample=sid, reason=d.reason, attempts=d.attempts, error=msg)
        else:
            self.store.enqueue([[item.ref]], retry=True, attempt=d.attempts, reason=d.reason)
            self.store.release_spool(sid)  # no file: a streamed run's reservation goes
            log.warning("sample_retry", sample=sid, reason=d.reason, attempt=d.attempts, error=msg)
            if d.pause is Pause.SERVER_ERRORS:  # a 5xx: give the server a moment
                self.pauses.server_error()
        self.notices.emit(SampleFailed(item, d.reason, dead))
        self.settled(item, routed=True)

    def settled(self, item: WorkItem, routed: bool = False) -> None:
        """``item`` is done, or (``routed``) retried or dead: finish its chunk if complete."""
        chunk = self.book.resolve(item, routed)
        if chunk is not None:
            self.finish(chunk.job)

    def finish(self, job: ChunkJob) -> None:
        self.book.pop(job.job_id)
        if not self.claims.finish(job):
            log.warning("chunk_not_ours_anymore", job=job.job_id)

    def close_chunks(self, why: str, *, drop: bool) -> None:
        """In-flight work has settled: finish each complete chunk, give the rest back.
        ``drop``: Redis is unreachable or the run changed; forget them all (our release_wip
        or heartbeat brings the jobs back, or they are gone with the run)."""
        chunks = self.book.clear()
        if drop:
            return
        for chunk in chunks:
            if chunk.complete and not chunk.hand_back:
                self.claims.finish(chunk.job)
            else:
                self._hand_back(chunk, why)

    def _hand_back(self, chunk: OpenChunk, why: str) -> None:
        job = chunk.job
        if not chunk.routed:
            self.claims.give_back(job)  # untouched, to the front of its queue
        else:
            # Some samples already went to a retry job or the dead letter: queue the rest
            # as a new job, so none of them is done twice or both dead and done.
            rest = [ref for ref in job.samples if ref[0] not in chunk.routed]
            if rest:
                self.store.enqueue([rest], attempt=job.attempt, reason=job.reason)
            self.claims.finish(job)
        self.notices.emit(ChunkHandedBack(job.job_id, len(job.samples) - len(chunk.routed)))
        log.info("job_handed_back", job=job.job_id, why=why, routed=len(chunk.routed))
