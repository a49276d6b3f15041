"""The worker's record in Redis: registered at start, renewed every --heartbeat-interval
(while it is fresh no reaper takes the worker's jobs; the Lease knows whether it stayed
fresh without a break) and at once when the worker's state changes (`poke`: a run's live
view would otherwise show `starting` for up to an interval while samples are done),
removed at exit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from hsq.outputs.manifest import ManifestEntry
from hsq.store import WorkerStore
from hsq.workers.claims import Claims
from hsq.workers.persist.stage import Lease
from hsq.workers.policy import STORE_TROUBLE

log = structlog.get_logger("hsq.worker")


@dataclass(eq=False)
class Heartbeat:
    store: WorkerStore[ManifestEntry]
    claims: Claims
    worker_id: str
    interval_s: float
    info: Callable[[], dict[str, Any]]
    lease: Lease
    stop: threading.Event

    def __post_init__(self) -> None:
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Register, then renew in a thread of its own until ``stop`` is set."""
        sent = time.monotonic()
        self.store.register(self.worker_id, self.info())
        self.lease.renewed(sent)
        self._thread.start()

    def poke(self) -> None:
        """Renew now (from any thread): the record then shows a state change at once."""
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self.stop.is_set():
                return
            try:
                sent = time.monotonic()
                self.store.heartbeat(self.worker_id, self.info())
                self.lease.renewed(sent)
            except STORE_TROUBLE as exc:
                log.warning("heartbeat_failed", error=str(exc))

    def end(self) -> None:
        """After ``stop``: release what is still held and remove the record."""
        self._wake.set()  # the loop sees ``stop`` now, not an interval later
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            n = self.claims.release_all()  # normally 0: all finished or given back
            if n:
                log.warning("released_jobs_at_exit", jobs=n)
            self.store.unregister(self.worker_id)
        except STORE_TROUBLE as exc:
            # Our heartbeat expires and another worker's reaper takes our jobs back.
            log.error("unregister_failed", error=str(exc))
