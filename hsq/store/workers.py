"""The run's workers: registration and heartbeats (a hash that expires: liveness)."""

from __future__ import annotations

import json
import secrets
import socket
from typing import Any

from hsq.keys import HEARTBEAT_TTL_S
from hsq.store import scripts
from hsq.store.connection import text, translate_public
from hsq.store.fence import Aggregate, Fence


@translate_public
class WorkerRegistry(Aggregate):
    def __init__(self, fence: Fence) -> None:
        super().__init__(fence)
        self._heartbeat = self.client.register_script(scripts.HEARTBEAT)

    def register(self, worker_id: str, info: dict[str, Any]) -> None:
        self.heartbeat(worker_id, info)

    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> None:
        # SADD again: re-join if a reaper wrongly took us for dead. Fenced: a worker of a
        # purged run must not bring its keys back.
        flat = [x for kv in _flat(info).items() for x in kv]
        self.fence.call(
            self._heartbeat,
            [self.keys.workers, self.keys.worker(worker_id)],
            [worker_id, HEARTBEAT_TTL_S, *flat],
        )

    def unregister(self, worker_id: str) -> None:
        p = self.client.pipeline()
        p.delete(self.keys.worker(worker_id))
        p.srem(self.keys.workers, worker_id)
        p.execute()

    def worker_ids(self) -> list[str]:
        return sorted(text(w) for w in self.client.smembers(self.keys.workers))

    def worker_info(self, worker_id: str) -> dict[str, str]:
        raw = self.client.hgetall(self.keys.worker(worker_id))
        return {text(k): text(v) for k, v in raw.items()}

    def workers_info(self) -> dict[str, dict[str, str]]:
        """Every registered worker's heartbeat hash ({} once expired), in one round trip."""
        wids = self.worker_ids()
        p = self.client.pipeline(transaction=False)
        for wid in wids:
            p.hgetall(self.keys.worker(wid))
        return {
            wid: {text(a): text(b) for a, b in raw.items()}
            for wid, raw in zip(wids, p.execute(), strict=True)
        }


def new_worker_id(name: str | None) -> str:
    base = name or socket.gethostname().split(".")[0]
    return f"{base}.{secrets.token_hex(3)}"


def _flat(info: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
