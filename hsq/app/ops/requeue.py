"""`hsq requeue`: put failed, chosen or lost samples back in the queue (idempotent)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hsq.app.ops.status import partition
from hsq.dataset import IndexEntry
from hsq.runstore import RunStore
from hsq.store import chunked


@dataclass
class RequeueResult:
    selected: int = 0
    enqueued: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)
    unqueued: set[str] = field(default_factory=set)
    """Selected ids known to be in no queue (dead-letter entries: a requeue takes them out
    of the dead letter in the transaction that queues them; missing ones): requeue need not
    read every job to skip queued ones."""
    missing: set[str] = field(default_factory=set)
    """Selected ids that were missing (their requeue lowers the run's lost count)."""

    def skip(self, why: str, sid: str) -> None:
        self.skipped.setdefault(why, []).append(sid)


def select_for_requeue(
    store: RunStore,
    *,
    failed: bool = False,
    reason: str | None = None,
    samples: Iterable[str] = (),
    missing: bool = False,
) -> tuple[list[str], RequeueResult]:
    res = RequeueResult()
    chosen: list[str] = []
    if failed or reason:
        for key, entry in store.dead_entries().items():
            if reason and entry.get("reason") != reason:
                continue
            if key.startswith("line:"):
                res.skip("invalid dataset line: fix it and run `hsq enqueue` again", key)
                continue
            chosen.append(key)
            res.unqueued.add(key)
    chosen += list(samples)
    if missing:
        index, outstanding, done, dead, _ = partition(store)
        res.missing = index - done - dead - set(outstanding)
        res.unqueued |= res.missing
        chosen += sorted(res.missing)
    res.selected = len(chosen)
    return list(dict.fromkeys(chosen)), res


def requeue(store: RunStore, ids: list[str], res: RequeueResult, *, dry_run: bool) -> None:
    """Enqueue the given samples afresh (attempt 0), skipping unknown, done and queued ones."""
    index = store.get_index(ids)
    done = store.done_among(ids)
    # Reading every job is O(queue); only ids that may be queued need it.
    outstanding = store.outstanding_samples() if set(ids) - res.unqueued else {}
    todo: list[tuple[str, IndexEntry]] = []
    for sid in ids:
        if sid not in index:
            res.skip("unknown sample id", sid)
        elif sid in done:
            res.skip("already done (use `hsq verify --requeue` to redo a bad file)", sid)
        elif sid in outstanding:
            res.skip("already queued or in progress", sid)
        else:
            todo.append((sid, index[sid]))
    res.enqueued = len(todo)
    if dry_run or not todo:
        return
    cfg = store.require_config()
    # One transaction per batch queues the samples and takes them out of the dead letter.
    store.enqueue(chunked(todo, cfg.chunk_size), clear_failures=True)
    store.forget_lost(sum(1 for sid, _ in todo if sid in res.missing))
