"""The ledger: which samples are done (THE truth of "done"), the dead letter, crash counts.

A worker marks the samples it finished done in batches (`mark_done_many`: one script call
per batch, a fixed handful of commands whatever its size), each exactly once, keeping the
run's totals in step with the done hash.

A done entry is opaque here: a DoneCodec (the manifest codec, beside the output format in
hsq.outputs) turns an entry into the string stored and back, so the Redis gateway knows no
file format.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from hsq import jsonsafe
from hsq.store import scripts
from hsq.store.connection import text, translate_public
from hsq.store.fence import Aggregate, Fence

E = TypeVar("E")
MAX_MARK_BATCH = 500
"""Samples per mark_done_many script call (Lua's unpack takes a few thousand arguments)."""
MAX_DEAD_ENTRY = 64 * 1024


class DoneCodec(Protocol[E]):
    """How a done entry is stored (hsq.outputs.manifest.MANIFEST_CODEC for manifest entries)."""

    def encode(self, sample_id: str, entry: E) -> str:
        """The entry as stored in the done hash."""
        ...

    def totals(self, entry: E) -> tuple[int, int]:
        """(tokens, bytes) the run's totals move by when the sample is (un)marked."""
        ...

    def decode(self, sample_id: str, raw: bytes) -> E | None:
        """A stored entry (untrusted); None if it does not parse."""
        ...

    def as_json(self, sample_id: str, raw: bytes) -> bytes:
        """A stored entry as the JSON readers check (what does not decode, as it is)."""
        ...


@translate_public
class Ledger(Aggregate, Generic[E]):
    def __init__(self, fence: Fence, codec: DoneCodec[E]) -> None:
        super().__init__(fence)
        self.codec = codec
        reg = self.client.register_script
        self._mark_done_many = reg(scripts.MARK_DONE_MANY)
        self._undo_done = reg(scripts.UNDO_DONE)
        self._to_dead = reg(scripts.TO_DEAD)
        self._dead_remove = reg(scripts.DEAD_REMOVE)
        self._hincr = reg(scripts.HINCR)

    # ------------------------------------------------------------------ done
    def done_among(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        vals = self.client.hmget(self.keys.done, ids)
        return {sid for sid, v in zip(ids, vals, strict=True) if v is not None}

    def mark_done(self, sample_id: str, entry: E) -> bool:
        """True if this call made the sample done; False if it already was."""
        return self.mark_done_many([(sample_id, entry)])[0]

    def mark_done_many(self, entries: Sequence[tuple[str, E]]) -> list[bool]:
        """Mark samples done, each exactly once, in one script call per MAX_MARK_BATCH (the
        same fence, idempotency and totals as one mark_done each). Per sample: True if this
        call made it done. Call it only once every file is durably written."""
        res = self._mark([(sid, "", e) for sid, e in entries], None)
        return [x == 1 for x in res]

    def mark_held_done(
        self, worker_id: str, entries: Sequence[tuple[str, str, E]]
    ) -> list[bool | None]:
        """mark_done_many for a worker, per (sample id, job id, entry): only samples whose
        job is still in this worker's wip list are marked, in the same script call; None
        for the others (a reaper gave their job to another worker, which may
        have written the sample again)."""
        res = self._mark(entries, worker_id)
        return [None if x == 2 else x == 1 for x in res]

    def _mark(self, entries: Sequence[tuple[str, str, E]], worker_id: str | None) -> list[int]:
        out: list[int] = []
        k = self.keys
        wip = "" if worker_id is None else k.wip(worker_id)
        keys = [k.done, k.stats, k.dead, k.dead_reasons, wip, k.ready, k.spool]
        for i in range(0, len(entries), MAX_MARK_BATCH):
            args: list[Any] = []
            for sid, job, e in entries[i : i + MAX_MARK_BATCH]:
                args += [sid, self.codec.encode(sid, e), *self.codec.totals(e), job]
            out += [int(x) for x in self.fence.call(self._mark_done_many, keys, args)]
        return out

    def undo_done(self, sample_id: str, entry: E) -> bool:
        """Un-mark a sample (verify --requeue) and take it out of the totals, exactly once."""
        keys = [self.keys.done, self.keys.stats]
        return bool(self.fence.count(self._undo_done, keys, [sample_id, *self.codec.totals(entry)]))

    def get_manifest(self, sample_id: str) -> E | None:
        raw = self.client.hget(self.keys.done, sample_id)
        if not raw:
            return None
        return self.codec.decode(sample_id, raw.encode() if isinstance(raw, str) else raw)

    def iter_manifest(self) -> Iterator[tuple[str, E | None]]:
        """Every done sample with its entry (HSCAN: no one huge reply); None for an entry
        that does not parse (Redis is untrusted)."""
        for field, raw in self.client.hscan_iter(self.keys.done, count=1000):
            yield text(field), self.codec.decode(text(field), raw)

    def iter_done(self, *, stored: bool = False) -> Iterator[tuple[str, bytes]]:
        """(sample id, raw manifest JSON) of every done sample; entries are untrusted.
        `stored`: the value as the done hash holds it (the codec's form), for a reader
        that decodes it itself (verify: a million JSON round trips less)."""
        for field, value in self.client.hscan_iter(self.keys.done, count=1000):
            sid = text(field)
            yield sid, value if stored else self.codec.as_json(sid, value)

    def done_entries(self, ids: list[str], *, stored: bool = False) -> list[bytes | None]:
        """The raw (untrusted) manifest JSON of each id, None where it is not done
        (`stored`: as iter_done's)."""
        if not ids:
            return []
        vals = self.client.hmget(self.keys.done, ids)
        raws = [None if v is None else v.encode() if isinstance(v, str) else v for v in vals]
        if stored:
            return raws
        return [
            None if v is None else self.codec.as_json(sid, v)
            for sid, v in zip(ids, raws, strict=True)
        ]

    # ------------------------------------------------------------------ dead and crashes
    def to_dead(
        self, sample_id: str, reason: str, message: str, attempts: int, worker: str | None
    ) -> None:
        # A sample already done is not dead-lettered: done and dead stay disjoint. A dead
        # sample's spool reservation is released in the same step (it will have no file).
        k = self.keys
        self.fence.call(
            self._to_dead,
            [k.dead, k.dead_reasons, k.done, k.spool, k.stats],
            [sample_id, json.dumps(dead_entry(reason, message, attempts, worker)), reason],
        )

    def dead_reasons(self) -> dict[str, int]:
        """Dead-letter entries by reason, from the counts the scripts keep (O(reasons))."""
        raw = self.client.hgetall(self.keys.dead_reasons)
        return {text(k): int(v) for k, v in raw.items() if int(v) > 0}

    def dead_entries(self) -> dict[str, dict[str, Any]]:
        """The dead letter; an unreadable entry (Redis is untrusted) reads as reason `?`."""
        out: dict[str, dict[str, Any]] = {}
        for k, v in self.client.hgetall(self.keys.dead).items():
            entry: Any = None
            if len(v) <= MAX_DEAD_ENTRY:
                with contextlib.suppress(ValueError):
                    entry = jsonsafe.loads(v)
            if not isinstance(entry, dict) or not isinstance(entry.get("reason"), str):
                entry = {"reason": "?", "message": "unreadable dead-letter entry"}
            out[text(k)] = entry
        return out

    def delete_fields(self, key: str, fields: Iterable[str], batch: int = 5000) -> int:
        """HDEL in batches (pruning the index and the dead letter: the dead letter's through
        a script that keeps its reason counts)."""
        items = list(fields)
        n = 0
        for i in range(0, len(items), batch):
            part = items[i : i + batch]
            if key == self.keys.dead:
                n += int(self._dead_remove(keys=[key, self.keys.dead_reasons], args=part))
            else:
                n += int(self.client.hdel(key, *part))
        return n

    def record_crash(self, sample_id: str) -> int:
        return self.fence.count(self._hincr, [self.keys.crashes], [sample_id])


def dead_entry(reason: str, message: str, attempts: int, worker: str | None) -> dict[str, Any]:
    """A dead-letter entry as stored (JSON): why, the error, tries, by whom, when."""
    return {
        "reason": reason,
        "message": message[:2000],
        "attempts": attempts,
        "worker": worker,
        "time": time.time(),
    }
