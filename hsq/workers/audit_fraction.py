"""The worker's continuous audit (`hsq worker --audit-fraction F`).

A batching server can put one request's rid, fingerprint and count on another request's
states; no check on the dump's metadata sees it (docs/dump-protocol.md, What the protocol
guarantees). With --audit-fraction F, each sample this worker marks done is, with
probability F, sent again alone: the worker stops sending, waits until nothing of its own
is in flight on its server (one worker per server: nothing else is), sends the sample with
a fresh rid through its own dispatcher and dump dir (ownership unchanged: the audit's dump
is matched by rid like any other), and compares the states with the file it wrote, within
the reference tolerance (hsq/closeness/rule.py).

A mismatch (confirmed by a second fresh extraction, hsq/closeness/rule.py:confirm; a
comparison that cannot be trusted is only logged) takes the sample out of the done hash,
removes its file and dead-letters it as `audit_mismatch` (`hsq requeue --reason
audit_mismatch` after fixing the server): the stored states belong to another input. An
audit that cannot run (server down, no dump) changes nothing and is only logged. Costs:
one extra prefill per audited sample (two for a mismatch), and the server idles while the
worker drains to send it alone.
"""

from __future__ import annotations

import random
import shutil
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from hsq.closeness.rule import States, compare, compare_states, confirm, dump_states
from hsq.dump.read import read_dump
from hsq.errors import AuditMismatchError, OutputError
from hsq.outputs.format import open_output, output_relpath
from hsq.outputs.manifest import ManifestEntry
from hsq.workers.chunks import WorkItem
from hsq.workers.notices import AuditRejected, Notices
from hsq.workers.runview import RunView
from hsq.workers.send.extract import SendStage

log = structlog.get_logger("hsq.worker.audit")


class AuditStore(Protocol):
    def get_manifest(self, sample_id: str) -> ManifestEntry | None: ...

    def undo_done(self, sample_id: str, entry: ManifestEntry) -> bool: ...

    def to_dead(
        self, sample_id: str, reason: str, message: str, attempts: int, worker: str | None
    ) -> None: ...


@dataclass(eq=False)
class WorkerAudit:
    fraction: float
    send: SendStage
    store: AuditStore
    notices: Notices
    worker_id: str
    seed: int | None = None
    counts: dict[str, int] = field(
        default_factory=lambda: {"audited": 0, "audit_mismatches": 0, "audit_failures": 0},
        init=False,
    )

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._queue: deque[tuple[WorkItem, RunView]] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def offer(self, item: WorkItem, view: RunView) -> None:
        """A sample was marked done: audit it with probability `fraction`."""
        if self.fraction > 0 and self._rng.random() < self.fraction:
            self._queue.append((item, view))

    def clear(self) -> None:
        self._queue.clear()

    def run_one(self) -> None:
        """Audit the next sample; the caller has nothing in flight on the server."""
        item, view = self._queue.popleft()
        sid = item.sample_id
        try:
            stored = open_output(view.out_root / output_relpath(sid), raw=True)
            ids, fresh, architecture = self._fresh(item, view)
            verdict = compare_states(stored, ids, fresh, architecture=architecture)
            if verdict.mismatch:  # removed only once a second extraction confirms it
                _, again, _ = self._fresh(item, view)
                verdict = confirm(
                    verdict,
                    compare_states(stored, ids, again, architecture=architecture),
                    compare(fresh, again, architecture=architecture),
                )
        except Exception as exc:  # an audit that cannot run changes nothing, stops nothing
            # (the server down, no dump, the file gone meanwhile: redone, verify --requeue)
            self.counts["audit_failures"] += 1
            log.warning("audit_failed", sample=sid, error=str(exc))
            return
        if not verdict.trusted:
            self.counts["audit_failures"] += 1
            log.warning("audit_untrusted", sample=sid, detail=verdict.detail)
            return
        self.counts["audited"] += 1
        try:
            verdict.raise_for_mismatch()
        except AuditMismatchError as exc:
            self.counts["audit_mismatches"] += 1
            log.error("audit_mismatch", sample=sid, detail=verdict.detail)
            self._reject(item, view, exc)
            return
        log.info("audit_ok", sample=sid, detail=verdict.detail)

    def _fresh(self, item: WorkItem, view: RunView) -> tuple[list[int], States, str | None]:
        """One extraction of the sample alone, checked as any dump of the run."""
        staged = self.send.extract(item, view)  # a fresh rid, checked against the run
        try:
            dump = read_dump(staged.staged, view.expected(staged.meta.rid, staged.sample))
        finally:
            shutil.rmtree(staged.staged, ignore_errors=True)
        return staged.sample.input_ids, dump_states(dump), dump.meta.model.architecture

    def _reject(self, item: WorkItem, view: RunView, mismatch: AuditMismatchError) -> None:
        sid = item.sample_id
        entry = self.store.get_manifest(sid)
        if entry is None or not self.store.undo_done(sid, entry):
            return  # no longer done (redone or requeued meanwhile): nothing of ours to undo
        try:
            (view.out_root / output_relpath(sid)).unlink(missing_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot remove {sid}'s mismatched output: {exc}") from exc
        reason = mismatch.reason
        self.store.to_dead(sid, reason, str(mismatch), item.attempt + 1, self.worker_id)
        self.notices.emit(AuditRejected(sid, reason))
