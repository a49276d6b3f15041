"""The worker's record is renewed at once on a state change (`Heartbeat.poke`), not only
every interval: `hsq run`'s view showed `starting` while samples were being done."""

from __future__ import annotations

import threading
from typing import Any, cast

from hsq.workers.heartbeat import Heartbeat
from hsq.workers.persist.stage import Lease


class FakeStore:
    """Records each write of the worker's record; pure logic, no Redis."""

    def __init__(self) -> None:
        self.beats: list[dict[str, Any]] = []
        self.beat = threading.Event()
        self.unregistered = False

    def register(self, worker_id: str, info: dict[str, Any]) -> None:
        assert worker_id == "w.1"
        self.beats.append(info)

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> None:
        assert worker_id == "w.1"
        self.beats.append(info)
        self.beat.set()

    def unregister(self, worker_id: str) -> None:
        self.unregistered = worker_id == "w.1"


class NoClaims:
    def release_all(self) -> int:
        return 0


def test_a_poke_renews_the_record_now_and_end_stops_without_waiting_an_interval() -> None:
    store, stop = FakeStore(), threading.Event()
    state = {"state": "starting"}
    hb = Heartbeat(
        cast(Any, store), cast(Any, NoClaims()), "w.1", 3600.0, lambda: dict(state),
        Lease(10), stop,
    )  # fmt: skip
    hb.start()
    assert store.beats == [{"state": "starting"}]
    state["state"] = "working"
    hb.poke()
    assert store.beat.wait(30), "a poke must renew before the hour-long interval"
    assert store.beats[-1] == {"state": "working"}
    stop.set()
    hb.end()
    assert store.unregistered and not hb._thread.is_alive()
