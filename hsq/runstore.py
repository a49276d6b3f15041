"""RunStore: the Redis gateway (hsq.store) bound to hsq's manifest codec (hsq.outputs), the
one object the commands, the producer and the worker's start-up open on a run.

Here, not in hsq.store, because the gateway imports no file format (tests/test_layers.py);
this module is where the two meet. A unit test of a worker's logic uses the in-memory fake,
hsq.store.MemoryStore[ManifestEntry], instead.
"""

from __future__ import annotations

from hsq.outputs.manifest import MANIFEST_CODEC, ManifestEntry
from hsq.store import Client, Store


class RunStore(Store[ManifestEntry]):
    def __init__(self, client: Client, run: str) -> None:
        super().__init__(client, run, MANIFEST_CODEC)
