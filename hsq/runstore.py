"""RunStore: the Redis gateway (hsq.store) bound to hsq's manifest codec (hsq.outputs), the
one object the commands, the producer and the worker's start-up open on a run.

Here, not in hsq.store, because the gateway imports no file format (tests/test_layers.py);
this module is where the two meet. A unit test of a worker's logic uses the in-memory fake,
hsq.store.MemoryStore[ManifestEntry], instead.
"""

from __future__ import annotations

from pathlib import Path

from hsq.outputs.format import remove_output
from hsq.outputs.manifest import MANIFEST_CODEC, ManifestEntry
from hsq.store import Client, Store


class RunStore(Store[ManifestEntry]):
    def __init__(self, client: Client, run: str) -> None:
        super().__init__(client, run, MANIFEST_CODEC)


def remove_committed(store: RunStore, run_dir: Path) -> int:
    """A streamed run's files every consumer group committed: removed (under `run_dir`,
    following no link) and their reservations released. Idempotent: a crash between the
    two is finished by the next call, from any consumer or `hsq run`. Returns files done."""
    n = 0
    while sids := store.spool.removals():
        for sid in sids:
            remove_output(run_dir, sid)
            n += store.spool.removed(sid)
    return n
