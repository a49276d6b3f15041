"""A streamed run's spool and stream: byte reservations before dispatch, the consumer
groups' reads, commits, removals and rejections (docs/training.md, "Train while
extracting").

Publishing is not here: the done mark's script (ledger.py, scripts.MARK_DONE_MANY) adds
the stream entry in the same step, so a sample is published iff it is done. Every write is
fenced on the run's generation, like the worker's.

    reserve         a worker, before it sends a sample: atomically against the budget
    read            a consumer: new entries (">") or its own pending ones after an id
    commit          a consumer, once its checkpoint is durable: XACK what it covers; an
                    entry every group committed puts its sample in the removal set
    removals/removed  whoever removes the files (the committing consumer, `hsq run`)
    reject          a consumer whose file failed its checks: un-mark, dead-letter, release
    skip            a consumer that met a stale entry (its sample was re-done since)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hsq.errors import StoreError
from hsq.keys import rq_queue_key
from hsq.store import scripts
from hsq.store.connection import Client, text, translate_public
from hsq.store.fence import Fence

COMMIT_BATCH = 500
"""Pending entries one COMMIT script call acks at most (then it is called again)."""


@dataclass(frozen=True)
class Delivery:
    """One stream entry as read by a consumer: its id, the sample, and the done entry it
    published (as stored: the consumer compares it with the done hash and decodes it)."""

    entry_id: str
    sample_id: str
    stored: bytes


@dataclass(frozen=True)
class GroupInfo:
    name: str
    delivered: int
    """Entries the group has read (its `entries-read`)."""
    pending: int
    """Read and not committed yet."""
    lag: int | None
    """Entries published and not read by the group yet (None: Redis cannot say)."""
    oldest_pending_s: float
    """Age of the oldest pending entry (0 when none)."""

    @property
    def committed(self) -> int:
        return self.delivered - self.pending


@translate_public
class Spool:
    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self.client = fence.client
        self.keys = fence.keys
        reg = self.client.register_script
        self._reserve = reg(scripts.RESERVE)
        self._commit = reg(scripts.COMMIT)
        self._removed = reg(scripts.RELEASE_REMOVED)
        self._reject = reg(scripts.REJECT)

    # ------------------------------------------------------------------ producers
    def ensure_groups(self, groups: list[str]) -> None:
        """Create the run's consumer groups from the stream's start (idempotent)."""
        create_groups(self.client, self.keys.ready, groups)

    def reserve(self, sample_id: str, nbytes: int | None) -> bool:
        """Reserve a sample's output bytes (None: size not known yet, the whole budget);
        False when the spool is full. A run without a stream always says True."""
        k = self.keys
        n = -1 if nbytes is None else nbytes
        return bool(self.fence.count(self._reserve, [k.spool, k.stats], [sample_id, n]))

    # ------------------------------------------------------------------ consumers
    def read(
        self, group: str, consumer: str, count: int, block_ms: int | None, after: str | None
    ) -> list[Delivery]:
        """New entries for this consumer (`after` None), or its own pending ones after the
        entry id `after` ("0": all of them), in id order."""
        reply: Any = self.client.xreadgroup(
            group,
            consumer,
            {self.keys.ready: ">" if after is None else after},
            count=count,
            block=None if after is not None else block_ms,
        )
        out: list[Delivery] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                fields = {text(f): v for f, v in (fields or {}).items()}
                sid, stored = fields.get("id"), fields.get("m")
                if sid is None or stored is None:
                    raise StoreError(f"stream entry {text(entry_id)} lacks its sample")
                sv = stored if isinstance(stored, bytes) else str(stored).encode()
                out.append(Delivery(text(entry_id), text(sid), sv))
        return out

    def commit(self, group: str, consumer: str, last_id: str, groups: int, keep: bool) -> int:
        """Commit the consumer's pending entries up to `last_id` (idempotent); the entries
        acked by this call."""
        k = self.keys
        keys = [k.ready, k.acks, k.spool_gc, k.spool, k.stats]
        n = 0
        while True:
            args = [group, consumer, last_id, groups, int(keep), COMMIT_BATCH]
            acked, seen = self.fence.call(self._commit, keys, args)
            n += int(acked)
            if int(seen) < COMMIT_BATCH:
                return n

    def skip(self, group: str, entry_id: str) -> None:
        """Ack a stale entry (its sample was re-done and published again) without
        counting it as committed."""
        self.client.xack(self.keys.ready, group, entry_id)

    def reject(
        self,
        group: str,
        d: Delivery,
        totals: tuple[int, int],
        dead_json: str,
        reason: str,
    ) -> bool:
        """A delivered file failed its checks: un-mark, dead-letter and release it, if the
        entry is still the sample's done mark (False: stale, only acked)."""
        k = self.keys
        keys = [k.ready, k.done, k.stats, k.dead, k.dead_reasons, k.acks, k.spool]
        args = [group, d.entry_id, d.sample_id, d.stored, *totals, dead_json, reason]
        return bool(self.fence.count(self._reject, keys, args))

    def stored_done(self, sample_id: str) -> bytes | None:
        """The sample's done entry as stored now (None: not done)."""
        raw = self.client.hget(self.keys.done, sample_id)
        return None if raw is None else raw if isinstance(raw, bytes) else str(raw).encode()

    # ------------------------------------------------------------------ removal
    def removals(self, limit: int = 1000) -> list[str]:
        """Samples every group committed whose file is still to be removed."""
        members: Any = self.client.srandmember(self.keys.spool_gc, limit)
        return [text(x) for x in members or []]

    def removed(self, sample_id: str) -> bool:
        """The sample's file is gone: release its reservation (once; False if done before)."""
        k = self.keys
        keys = [k.spool_gc, k.spool, k.stats, k.consumed]
        return bool(self.fence.count(self._removed, keys, [sample_id]))

    # ------------------------------------------------------------------ reading the state
    def spool_bytes(self) -> int:
        return int(self.client.hget(self.keys.stats, "spool_bytes") or 0)

    def reserved(self) -> dict[str, int]:
        """sample id -> reserved bytes (O(spool): tests and repair)."""
        return {text(k): int(v) for k, v in self.client.hgetall(self.keys.spool).items()}

    def groups(self) -> list[GroupInfo]:
        """Each consumer group's delivered, pending and lag, and its oldest pending age."""
        try:
            infos: list[dict[str, Any]] = self.client.xinfo_groups(self.keys.ready)
        except Exception as exc:
            if "no such key" in str(exc).lower():
                return []
            raise
        out = []
        now_ms = time.time() * 1000
        for info in infos:
            name = text(info["name"])
            pending = int(info.get("pending") or 0)
            age = 0.0
            if pending:
                summary = self.client.xpending(self.keys.ready, name)
                low = summary.get("min")
                if low:
                    age = max(0.0, (now_ms - int(text(low).split("-")[0])) / 1000)
            read = info.get("entries-read")
            lag = info.get("lag")
            out.append(
                GroupInfo(
                    name,
                    int(read) if read is not None else 0,
                    pending,
                    None if lag is None else int(lag),
                    round(age, 1),
                )
            )
        return out

    def settled(self) -> bool:
        """Nothing reserved: every output published was committed by every group and
        removed (or, keep_after_commit, committed); True for a run without a stream."""
        return self.spool_bytes() <= 0 and not self.client.scard(self.keys.spool_gc)

    def published(self) -> int:
        return int(self.client.xlen(self.keys.ready))

    def extraction_finished(self) -> bool:
        """Every sample of the run is done or dead: the enqueue finished and no job is
        queued or held (a done sample is published in its mark's step, so the stream then
        holds every done one)."""
        stats = self.client.hgetall(self.keys.stats)
        st = {text(a): b for a, b in stats.items()}
        if "total_samples" not in st or "enqueuing" in st:
            return False
        p = self.client.pipeline(transaction=False)
        p.llen(rq_queue_key(self.keys.main_queue))
        p.llen(rq_queue_key(self.keys.retry_queue))
        p.smembers(self.keys.workers)
        main, retry, wids = p.execute()
        if main or retry:
            return False
        p = self.client.pipeline(transaction=False)
        for w in wids:
            p.llen(self.keys.wip(text(w)))
        return not any(p.execute())


def create_groups(client: Client, stream: str, groups: list[str]) -> None:
    """XGROUP CREATE ... 0 MKSTREAM for each group: it reads the stream from its start, so
    a group made after the first publish still gets every entry. Idempotent."""
    for group in groups:
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except Exception as exc:  # a group that exists already is what we want
            if "BUSYGROUP" not in str(exc):
                raise
