"""RunStore: the Redis gateway (hsq.store) bound to hsq's manifest codec (hsq.outputs), the
one object the commands, the producer and the worker's start-up open on a run.

Here, not in hsq.store, because the gateway imports no file format (tests/test_layers.py);
this module is where the two meet. A unit test of a worker's logic uses the in-memory fake,
hsq.store.MemoryStore[ManifestEntry], instead.
"""

from __future__ import annotations

import time
from pathlib import Path

from hsq.outputs.format import remove_output
from hsq.outputs.manifest import MANIFEST_CODEC, ManifestEntry
from hsq.store import Client, Store
from hsq.store.spool import REJECT_REASON


class RunStore(Store[ManifestEntry]):
    def __init__(self, client: Client, run: str) -> None:
        super().__init__(client, run, MANIFEST_CODEC)


def remove_committed(store: RunStore, run_dir: Path) -> int:
    """A streamed run's files every consumer group committed: removed (under `run_dir`,
    following no link) and their reservations released. Idempotent: a crash between the
    two is finished by the next call, from any consumer or `hsq run`. Returns files done."""
    n = 0
    while sids := store.spool.removals():
        # Each file is unlinked before its release (never bytes released for a file still
        # there); the releases of a batch share one round trip.
        for sid in sids:
            remove_output(run_dir, sid)
        n += store.spool.removed_many(sids)
    return n


REJECTED_BY = "consumer:"
"""How a consumer's reject names itself in the dead entry's `worker` (then its group)."""
REJECT_GRACE_S = 5.0
"""A consumer requeues its reject within milliseconds; one older than this was left by a
consumer killed in between, and whoever looks next finishes it."""


def requeue_rejected(store: RunStore, sample_id: str) -> bool:
    """Queue a rejected sample again (retry queue), leaving the dead letter in the same
    transaction; False if it is no longer there (another consumer or `hsq run` did it)."""
    index = store.config_index.get_index([sample_id])
    _, done, dead = store.config_index.presence([sample_id])
    if sample_id not in index or done[0] or not dead[0]:
        return False
    ref = (sample_id, index[sample_id])
    store.enqueue([[ref]], retry=True, reason=REJECT_REASON, clear_failures=True)
    return True


def unfinished_rejects(store: RunStore) -> list[tuple[str, float]]:
    """Samples a consumer dead-lettered as corrupt and has not queued again yet, with the
    time of the reject (O(1) when there is none: the reason's count)."""
    if not store.ledger.dead_reasons().get(REJECT_REASON):
        return []
    return [
        (sid, float(e.get("time") or 0))
        for sid, e in store.dead_entries().items()
        if e.get("reason") == REJECT_REASON and str(e.get("worker") or "").startswith(REJECTED_BY)
    ]


def finish_rejects(store: RunStore, run_dir: Path, grace_s: float = REJECT_GRACE_S) -> int:
    """Finish what a consumer killed between its reject (one script: un-marked, dead-
    lettered, released) and its requeue left: the corrupt file removed, the sample queued
    again, so nothing the stream promised to extract again stays dead. Idempotent; any
    consumer and `hsq run`'s pass call it. Returns the samples queued again."""
    n = 0
    now = time.time()
    for sid, at in unfinished_rejects(store):
        if now - at < grace_s:
            continue  # its consumer is probably queueing it right now
        _, done, dead = store.config_index.presence([sid])
        if done[0] or not dead[0]:
            continue  # queued again meanwhile
        remove_output(run_dir, sid)
        n += requeue_rejected(store, sid)
    return n
