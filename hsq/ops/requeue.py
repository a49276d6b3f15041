"""`hsq requeue`: put failed, chosen or lost samples back in the queue (idempotent)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hsq.dataset.jsonl import IndexEntry
from hsq.errors import HsqError
from hsq.ops.status import partition
from hsq.runstore import RunStore
from hsq.store import chunked

UNKNOWN_ID = "unknown sample id"


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
    ids: list[str] = field(default_factory=list)
    """The ids requeued (or, with --dry-run, that would be)."""

    def skip(self, why: str, sid: str) -> None:
        self.skipped.setdefault(why, []).append(sid)


def known_reasons() -> set[str]:
    """The failure reasons hsq records in a dead letter: each error class's `reason`
    (hsq/errors.py and its subclasses elsewhere, e.g. the client's server_crash) and the
    ones hsq/workers/policy.py:classify names itself. Dataset reasons (bad_row, ...) are
    instance values: they count as known once a run's dead letter holds them."""
    import hsq.workers.send.client  # noqa: F401  (its error classes join the tree)
    from hsq.errors import HsqError
    from hsq.workers.policy import POLICY_REASONS

    found: set[str] = set(POLICY_REASONS)
    todo: list[type] = [HsqError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        reason = cls.__dict__.get("reason")
        if isinstance(reason, str):
            found.add(reason)
    return found


def check_reason(store: RunStore, reason: str) -> None:
    """A --reason hsq never records and this run's dead letter does not hold is a typo:
    ConfigError naming the valid ones (a known reason with no entries selects nothing)."""
    present = store.ledger.dead_reasons()
    if reason in present or reason in known_reasons():
        return
    here = ", ".join(f"{r} ({n})" for r, n in sorted(present.items())) or "none"
    raise UnknownSelection(
        f"no such failure reason {reason!r}. In run {store.run}'s dead letter: {here}. "
        f"Every reason hsq records: {', '.join(sorted(known_reasons()))}"
    )


class UnknownSelection(HsqError):
    """`hsq requeue` was asked for a reason or sample id that does not exist (exit 1)."""


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
    if reason:
        check_reason(store, reason)
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
    index = store.config_index.get_index(ids)
    done = store.done_among(ids)
    # Reading every job is O(queue); only ids that may be queued need it.
    outstanding = store.outstanding_samples() if set(ids) - res.unqueued else {}
    todo: list[tuple[str, IndexEntry]] = []
    for sid in ids:
        if sid not in index:
            res.skip(UNKNOWN_ID, sid)
        elif sid in done:
            res.skip("already done (use `hsq verify --requeue` to redo a bad file)", sid)
        elif sid in outstanding:
            res.skip("already queued or in progress", sid)
        else:
            todo.append((sid, index[sid]))
    res.enqueued = len(todo)
    res.ids = [sid for sid, _ in todo]
    if dry_run or not todo:
        return
    cfg = store.require_config()
    # One transaction per batch queues the samples and takes them out of the dead letter.
    store.enqueue(chunked(todo, cfg.chunk_size), clear_failures=True)
    store.lifecycle.forget_lost(sum(1 for sid, _ in todo if sid in res.missing))
