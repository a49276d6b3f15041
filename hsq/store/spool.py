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
    removals/removed_many  whoever removes the files (the committing consumer, `hsq run`)
    reject          a consumer whose file failed its checks: un-mark, dead-letter, release
    skip            a consumer that met a stale entry (its sample was re-done since)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from hsq import jsonsafe
from hsq.errors import StoreError
from hsq.store import scripts
from hsq.store.connection import Client, text, translate_public
from hsq.store.fence import Aggregate, Fence
from hsq.store.queue import JobQueue

COMMIT_BATCH = 500
"""Pending entries one COMMIT script call acks at most (then it is called again)."""


CONSUMER_CLIENT = "hsq-consumer"
"""What a stream consumer's connections are named by (CLIENT SETNAME, `consumer_client`):
`hsq run` keeps its Redis up while one of its run is attached after everything is
committed, so a consumer can read the end of the stream and make its last (empty) commit
before the Redis goes away."""


def consumer_client(run: str) -> str:
    """A consumer's connection name: of its run, so that consumers of other runs on a
    shared Redis never hold this one's `hsq run` (run names have no space or colon)."""
    return f"{CONSUMER_CLIENT}:{run}"


REJECT_REASON = "output_corrupt"
"""The dead-letter reason of a streamed file that failed its checks when a consumer read
it: the consumer queues it again (hsq.runstore.finish_rejects when it was killed first)."""


class SampleOverBudget(Exception):
    """The sample alone is larger than the spool's budget: it can never be reserved until
    the budget is raised (`hsq enqueue --spool-budget` on the run)."""

    def __init__(self, budget: int, needed: int) -> None:
        super().__init__(f"a sample of {needed} bytes is above the spool budget of {budget}")
        self.budget = budget
        self.needed = needed


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
class Spool(Aggregate):
    def __init__(self, fence: Fence, queue: JobQueue) -> None:
        super().__init__(fence)
        self.queue = queue
        reg = self.client.register_script
        self._reserve = reg(scripts.RESERVE)
        self._commit = reg(scripts.COMMIT)
        self._removed = reg(scripts.RELEASE_REMOVED)
        self._reject = reg(scripts.REJECT)
        self._set_budget = reg(scripts.SET_BUDGET)
        self._release_undone = reg(scripts.RELEASE_UNDONE)

    # ------------------------------------------------------------------ producers
    def ensure_groups(self, groups: list[str]) -> None:
        """Create the run's consumer groups from the stream's start (idempotent)."""
        create_groups(self.client, self.keys.ready, groups)

    def reserve(self, sample_id: str, nbytes: int | None) -> bool:
        """Reserve a sample's output bytes (None: size not known yet, the whole budget);
        False when the spool is full. A run without a stream always says True. Raises
        SampleOverBudget when the sample alone is larger than the budget."""
        k = self.keys
        n = -1 if nbytes is None else nbytes
        got = self.fence.count(self._reserve, [k.spool, k.stats], [sample_id, n])
        if got < 0:
            raise SampleOverBudget(-got - 1, n)
        return bool(got)

    def release(self, sample_id: str) -> int:
        """A sample leaves the worker without a file (sent to the retry queue): its
        reservation is released unless it is done. The bytes released."""
        k = self.keys
        return self.fence.count(self._release_undone, [k.spool, k.stats, k.done], [sample_id])

    def release_all(self, sample_ids: list[str]) -> int:
        """Samples whose jobs went back to the queue (a worker stopped or was reaped): each
        one's reservation released unless it is done; a streamed run's only. The next
        claim reserves again. The bytes released."""
        if not sample_ids or not self.recorded()[0]:
            return 0
        return sum(self.release(sid) for sid in sample_ids)

    def set_budget(self, budget: int) -> None:
        """A new byte budget for a streamed run (raised so a sample larger than the old one
        fits, or lowered); read by every reservation from now on."""
        self.fence.call(self._set_budget, [], [budget])

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
        return self.stored_done_many([sample_id])[0]

    def stored_done_many(self, sample_ids: list[str]) -> list[bytes | None]:
        """Each sample's done entry as stored now (None: not done): one HMGET for a read's
        entries, not a round trip per item."""
        if not sample_ids:
            return []
        raws: Any = self.client.hmget(self.keys.done, sample_ids)
        return [None if r is None else r if isinstance(r, bytes) else str(r).encode() for r in raws]

    # ------------------------------------------------------------------ removal
    def removals(self, limit: int = 1000) -> list[str]:
        """Samples every group committed whose file is still to be removed."""
        members: Any = self.client.srandmember(self.keys.spool_gc, limit)
        return [text(x) for x in members or []]

    def removed_many(self, sample_ids: list[str]) -> int:
        """The samples' files are gone: release their reservations (once each), in one
        round trip; how many were released by this call (not before)."""
        if not sample_ids:
            return 0
        k = self.keys
        keys = [k.spool_gc, k.spool, k.stats, k.consumed]
        return sum(map(int, self.fence.call_many(self._removed, keys, [[s] for s in sample_ids])))

    def consumed_of(self, ids: list[str]) -> list[bool]:
        """For each id: its file was removed by design (every group committed it: in the
        consumed set, or in the removal set while its removal finishes)."""
        if not ids:
            return []
        p = self.client.pipeline(transaction=False)
        p.smismember(self.keys.consumed, ids)
        p.smismember(self.keys.spool_gc, ids)
        a, b = p.execute()
        return [bool(x) or bool(y) for x, y in zip(a, b, strict=True)]

    def consumers(self, group: str) -> dict[str, int]:
        """The group's consumers with entries pending to them: name -> pending."""
        infos = _xinfo(lambda: self.client.xinfo_consumers(self.keys.ready, group))
        return {text(i["name"]): int(i.get("pending") or 0) for i in infos if i.get("pending")}

    def note_consumer(self, group: str, rank: int, stats: dict[str, float]) -> None:
        """A trainer's data wait, as of its last commit (one HSET)."""
        record = json.dumps({**stats, "time": round(time.time(), 1)})
        self.client.hset(self.keys.consumer_stats, f"{group}/{rank}", record)

    def consumer_waits(self) -> dict[str, dict[str, float]]:
        """group -> its trainers' data wait summed over ranks: wait_s, elapsed_s, share."""
        out: dict[str, dict[str, float]] = {}
        for k, v in self.client.hgetall(self.keys.consumer_stats).items():
            group = text(k).rpartition("/")[0]
            try:
                rec: Any = jsonsafe.loads(v) if len(v) < 4096 else {}
                wait, elapsed = float(rec["wait_s"]), float(rec["elapsed_s"])
            except (ValueError, TypeError, KeyError):
                continue  # Redis is untrusted: an unreadable record is skipped
            g = out.setdefault(group, {"wait_s": 0.0, "elapsed_s": 0.0, "wait_share": 0.0})
            g["wait_s"] += wait
            g["elapsed_s"] += elapsed
            g["wait_share"] = g["wait_s"] / g["elapsed_s"] if g["elapsed_s"] > 0 else 0.0
        return out

    # ------------------------------------------------------------------ reading the state
    def spool_bytes(self) -> int:
        return int(self.client.hget(self.keys.stats, "spool_bytes") or 0)

    def reserved(self) -> dict[str, int]:
        """sample id -> reserved bytes (O(spool): tests and repair)."""
        return {text(k): int(v) for k, v in self.client.hgetall(self.keys.spool).items()}

    def groups(self) -> list[GroupInfo]:
        """Each consumer group's delivered, pending and lag, and its oldest pending age."""
        infos = _xinfo(lambda: self.client.xinfo_groups(self.keys.ready))
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
        removed (or, keep_after_commit, committed), and no consumer's reject is waiting
        to be queued again; True for a run without a stream."""
        p = self.client.pipeline(transaction=False)
        p.hget(self.keys.stats, "spool_bytes")
        p.scard(self.keys.spool_gc)
        p.hget(self.keys.dead_reasons, REJECT_REASON)  # a reject still to be queued again
        used, gc, rejects = p.execute()
        return int(used or 0) <= 0 and not gc and not int(rejects or 0)

    def attached(self) -> int:
        """This run's stream consumers connected to its Redis now (their connections'
        name)."""
        name = consumer_client(self.run)
        clients: Any = self.client.client_list(_type="normal")
        return sum(1 for c in clients or [] if c.get("name") == name)

    def published(self) -> int:
        return int(self.client.xlen(self.keys.ready))

    def recorded(self) -> tuple[int, bool]:
        """The run's budget as recorded (0: no stream, or no run) and keep_after_commit:
        read without loading the config (which would adopt its generation)."""
        raw = self.client.hmget(self.keys.config, ["spool_budget", "keep_after_commit"])
        try:
            budget = jsonsafe.loads(raw[0]) if raw[0] is not None else 0
            keep = jsonsafe.loads(raw[1]) if raw[1] is not None else False
        except ValueError:
            return 0, False  # Redis is untrusted: an unreadable record reads as no stream
        ok = isinstance(budget, int) and not isinstance(budget, bool)
        return (budget if ok and budget > 0 else 0), keep is True

    def consumed(self) -> int:
        """Samples whose file was removed after every group committed it."""
        return int(self.client.scard(self.keys.consumed))

    def extraction_finished(self) -> bool:
        """Every sample of the run is done or dead: the enqueue finished and no job is
        queued or held (a done sample is published in its mark's step, so the stream then
        holds every done one)."""
        stats = self.client.hgetall(self.keys.stats)
        st = {text(a): b for a, b in stats.items()}
        if "total_samples" not in st or "enqueuing" in st:
            return False
        return self.queue.nothing_outstanding()


def _xinfo(call: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """An XINFO reply; none while the stream does not exist yet (nothing published, no
    group made: Redis answers "no such key")."""
    try:
        return call()
    except redis.exceptions.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return []
        raise


def create_groups(client: Client, stream: str, groups: list[str]) -> None:
    """XGROUP CREATE ... 0 MKSTREAM for each group: it reads the stream from its start, so
    a group made after the first publish still gets every entry. Idempotent."""
    for group in groups:
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except Exception as exc:  # a group that exists already is what we want
            if "BUSYGROUP" not in str(exc):
                raise
