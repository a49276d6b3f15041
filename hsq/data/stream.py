"""Train while extracting: a torch IterableDataset over a streamed run's consumer group.

    ds = StreamingHiddenStateDataset("kimi-v1", redis_url_file=".../.hsq/redis-url")
    ds.load_state_dict(saved_state)            # optional, after a restart, before iterating
    for item in StreamingDataLoader(ds, batch_size=None, num_workers=4): ...
    state = ds.state_dict()                    # JSON: save it inside the checkpoint
    ds.commit(state)                           # once that checkpoint is durable

Items are HiddenStateDataset's (hsq.data.files.item_of), read by hsq.outputs.check.read_checked:
opened under the run's output directory following no link, size, checksum, sample id,
token count and structure as the manifest entry records them.

Exactly once relative to the restored checkpoint. Each reading process is one Redis
consumer of the group, named by (rank, DataLoader worker); XREADGROUP hands each entry to
one consumer, in id order, and keeps it pending until committed. The state is the last
entry id each consumer handed to the trainer. `commit(state)` acks every pending entry up
to those ids (idempotent); `load_state_dict(state)` commits the same, and each consumer
then first re-reads its own pending entries after its id, in order (the ones the lost
process delivered after the checkpoint), then new ones. So a kill -9 anywhere replays
exactly what the restored checkpoint had not seen.

What the trainer received: with num_workers=0 the dataset's own iterator hands each item
to the trainer and records it. With DataLoader worker processes items are made and
prefetched in other processes, so only StreamingDataLoader (a DataLoader subclass) is
accepted: its collate marks each item with its consumer and entry id, and its iterator
records them in the main process as it yields each batch (a plain DataLoader with
workers is refused in words: it would count prefetched items as trained). Items it hands
over one by one (batch_size=None, no collate_fn) cross from a worker as the checked file's
name and identity (CheckedFile), not as tensors: the trainer's process maps the file again
(torch would copy each tensor into new shared memory and pass each by a socket handshake).

A file that fails its checks is rejected: its done mark is taken back, it goes to the
dead letter with the reason (released from the spool), its file is removed and it is
queued again (retry queue, leaving the dead letter); its new extraction is published as a
new entry and delivered later. An entry whose sample was re-done since (its stored entry
is no longer the done mark) is stale: acked, skipped, never trained.

A restart with another number of DataLoader workers or ranks: consumers of the old
layout that still hold pending entries (XINFO CONSUMERS) are adopted, each by one live
consumer (by a hash of its name): it re-reads the old consumer's pending entries after the
state's position for it, in order, under the old name, before its own. So each is
delivered again exactly once, in order per old consumer, and commits ack it there.

Iteration ends when the run's extraction is finished (every sample done or dead, and no
consumer's reject left unqueued) and the group has nothing more for this consumer. Ranks
end independently (docs/training.md).

The trainer's data wait (seconds blocked in the iterator's next: Redis and file reads, or
the DataLoader's queue) is measured where the trainer waits: `wait_stats()`, and written
with each commit to the run's consumer-stats hash (the live view's `consumer wait`).
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import structlog
import torch
from torch.utils.data import IterableDataset, get_worker_info

from hsq.data.files import item_of
from hsq.data.reads import READ_THREADS, Ahead, Checked, CheckedFile, Reads, read_ahead
from hsq.errors import ConfigError, OutputError, StoreUnavailableError
from hsq.outputs.check import read_checked
from hsq.outputs.format import remove_output
from hsq.outputs.manifest import MANIFEST_CODEC
from hsq.redisurl import read_url_file
from hsq.runconfig import DEFAULT_GROUP, RunConfig
from hsq.runstore import (
    REJECTED_BY,
    RunStore,
    finish_rejects,
    remove_committed,
    requeue_rejected,
    unfinished_rejects,
)
from hsq.states import FP8
from hsq.store import Delivery, connect, consumer_client
from hsq.store.ledger import dead_entry
from hsq.store.spool import REJECT_REASON

log = structlog.get_logger("hsq.data.stream")

STATE_VERSION = 1
POSITION = "_hsq_stream_position"
"""The key StreamingDataLoader's workers put on each item (taken off before it is yielded)."""
READ_BATCH = 8
"""Entries one XREADGROUP takes (and one HMGET checks against the done marks) for a
trainer that is the group's only reader: a round trip per 8 items, not per item."""
SHARED_READ_BATCH = 2
"""The same where several read the group (DataLoader workers, ranks): few, so that one
(the first worker started, say) does not take entries the others could be handing over."""
MAX_BACKOFF_S = 5.0


class PlainDataLoaderError(ConfigError):
    """A plain DataLoader with worker processes. Its one line survives torch's re-raise in
    the trainer's process (which builds the exception again from the worker's traceback)."""

    LINE = (
        "a StreamingHiddenStateDataset in DataLoader worker processes needs "
        "hsq.data.StreamingDataLoader (a plain DataLoader would count prefetched items as "
        "trained)"
    )

    def __init__(self, *_torch_message: object) -> None:
        super().__init__(self.LINE)


def _retrying(what: str, fn: Callable[[], Any]) -> Any:
    """Redis unreachable is transient: try again (backing off), never fail the trainer."""
    delay = 0.1
    while True:
        try:
            return fn()
        except StoreUnavailableError as exc:
            log.warning("stream_redis_unavailable", doing=what, error=str(exc), retry_in_s=delay)
            time.sleep(delay)
            delay = min(MAX_BACKOFF_S, delay * 2)


def _url_of(path: Path) -> str:
    """The URL file as every hsq command reads it (mode 600, size-limited, one line); a
    missing one named with what usually removed it."""
    if not path.exists() and path.name == "redis-url" and path.parent.name == ".hsq":
        raise ConfigError(
            f"{path} does not exist: the `hsq run` that serves this run is not running (it "
            f"removes the file when it stops); `hsq run --out {path.parent.parent} "
            "--redis-only` serves the run's Redis again"
        )
    return read_url_file(path)


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class StreamingHiddenStateDataset(IterableDataset[dict[str, Any]]):
    def __init__(
        self,
        run: str,
        *,
        redis_url: str | None = None,
        redis_url_file: str | Path | None = None,
        group: str = DEFAULT_GROUP,
        rank: int | None = None,
        world_size: int | None = None,
        max_length: int | None = None,
        raw_fp8: bool = False,
        poll_s: float = 1.0,
        read_threads: int = READ_THREADS,
    ) -> None:
        if (redis_url is None) == (redis_url_file is None):
            raise ConfigError("give one of redis_url= and redis_url_file=")
        if redis_url_file is not None:
            redis_url = _url_of(Path(redis_url_file))
        assert redis_url is not None
        if rank is None or world_size is None:
            dist = torch.distributed
            on = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else dist.get_rank() if on else 0
            world_size = world_size if world_size is not None else (
                dist.get_world_size() if on else 1
            )  # fmt: skip
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not within world_size {world_size}")
        self.run = run
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.max_length = max_length
        self.raw_fp8 = raw_fp8
        self.poll_s = poll_s
        self.read_threads = max(0, read_threads)
        self._url = redis_url
        self._positions: dict[str, str] = {}
        """consumer -> the last entry id handed to the trainer (what state_dict says)."""
        self._marking = False
        """Set by StreamingDataLoader: items carry their position to the main process."""
        self._by_reference = False
        """Set by StreamingDataLoader for items it hands over unbatched and unconverted:
        its workers send a checked file's name (CheckedFile), not its tensors."""
        self._store: RunStore | None = None
        self._cfg: RunConfig | None = None
        self._ended = False
        """The stream ended for this process's trainer: Redis is held only while in use."""
        self._committed: dict[str, str] | None = None
        """The positions this handle's last commit covered (one again is a no-op)."""
        self._wait_s = 0.0
        self._items = 0
        self._t0: float | None = None
        cfg = self._config()
        if group not in cfg.groups:
            raise ConfigError(
                f"run {run!r} has no consumer group {group!r} (its groups: "
                f"{', '.join(cfg.groups) or 'none: it was not enqueued with --spool-budget'})"
            )
        _retrying("create groups", lambda: self.store.spool.ensure_groups(cfg.groups))

    # ------------------------------------------------------------------ Redis, per process
    @property
    def store(self) -> RunStore:
        if self._store is None:
            self._store = RunStore(connect(self._url, name=consumer_client(self.run)), self.run)
        return self._store

    def _config(self) -> RunConfig:
        if self._cfg is None:
            self._cfg = _retrying("read the run's config", self.store.require_config)
        return self._cfg

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # each process opens its own connection
        return state

    @property
    def run_dir(self) -> Path:
        return Path(self._config().out) / self.run

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """What the trainer has received: JSON, to save inside its checkpoint."""
        return {
            "version": STATE_VERSION,
            "run": self.run,
            "group": self.group,
            "positions": dict(sorted(self._positions.items())),
        }

    def _check_state(self, state: dict[str, Any]) -> dict[str, str]:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError("not a StreamingHiddenStateDataset state (state_dict())")
        if state.get("run") != self.run or state.get("group") != self.group:
            raise ConfigError(
                f"the state is of run {state.get('run')!r} group {state.get('group')!r}, "
                f"this dataset reads run {self.run!r} group {self.group!r}"
            )
        pos = state.get("positions")
        if not isinstance(pos, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in pos.items()
        ):
            raise ConfigError("the state's positions are unreadable")
        for v in pos.values():
            try:
                _entry_key(v)
            except ValueError:
                raise ConfigError(f"the state's position {v[:40]!r} is no entry id") from None
        return dict(pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state before iterating: what it covers is committed
        (again: idempotent) and never delivered again; the rest is delivered again."""
        positions = self._check_state(state)
        self.commit(state)
        self._positions = positions

    def commit(self, state: dict[str, Any]) -> None:
        """The checkpoint holding `state` is durable: its samples are consumed. Acks them
        in the group; a file every group committed is removed (idempotent, any time)."""
        positions = self._check_state(state)
        if positions != self._committed:  # the loop's last commit, again after it: no call
            cfg = self._config()
            spool = self.store.spool
            for consumer, last in positions.items():
                args = (self.group, consumer, last, len(cfg.groups), cfg.keep_after_commit)
                _retrying("commit", functools.partial(spool.commit, *args))
            _retrying("remove committed files", lambda: remove_committed(self.store, self.run_dir))
            _retrying("record the data wait", self._publish_wait)
            self._committed = positions
        if self._ended:
            self._release()

    def _end(self) -> None:
        """The stream ended for this process's trainer (the iterator it reads returned):
        from now on Redis is connected only while used. `hsq run` keeps its Redis while a
        consumer is attached once everything is committed, so that one can read the
        stream's end: one that has read it and keeps its dataset (saving its model, say)
        must not hold the run open."""
        self._ended = True
        self._release()

    def _release(self) -> None:
        if self._store is not None:
            self._store.client.close()
            self._store = None  # connected again (lazily) if used again

    # ------------------------------------------------------------------ data wait
    def waited(self, seconds: float, items: int = 1) -> None:
        """The trainer waited `seconds` for `items` (the loader's next, or our own)."""
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now - seconds
        self._wait_s += seconds
        self._items += items

    def wait_stats(self) -> dict[str, float]:
        """Seconds the trainer waited for data, seconds since its first item was asked
        for, their share (high: extraction is the limit), and items received."""
        elapsed = time.monotonic() - self._t0 if self._t0 is not None else 0.0
        share = self._wait_s / elapsed if elapsed > 0 else 0.0
        return {"wait_s": round(self._wait_s, 3), "elapsed_s": round(elapsed, 3),
                "wait_share": round(share, 4), "items": self._items}  # fmt: skip

    def _publish_wait(self) -> None:
        self.store.spool.note_consumer(self.group, self.rank, self.wait_stats())

    def record(self, consumer: str, entry_id: str) -> None:
        """An item of `consumer`'s `entry_id` was handed to the trainer."""
        old = self._positions.get(consumer)
        if old is None or _entry_key(entry_id) > _entry_key(old):
            self._positions[consumer] = entry_id

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        if info is not None and not self._marking:
            raise PlainDataLoaderError()
        wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
        consumer = consumer_name(self.rank, wid)
        mine = [(c, self._positions.get(c, "0")) for c in self._adopted(wid, workers)]
        mine.append((consumer, self._positions.get(consumer, "0")))
        # Views of the file (bf16, or fp8 as stored) go by reference; an fp8 file
        # dequantized is new memory made here, so it goes as tensors.
        by_ref = (
            info is not None
            and self._by_reference
            and (self.raw_fp8 or self._config().store_dtype != FP8)
        )
        asked = time.monotonic()
        batch = READ_BATCH if workers == 1 and self.world_size == 1 else SHARED_READ_BATCH
        threads = min(self.read_threads, batch)
        pool = ThreadPoolExecutor(threads, "hsq-read-ahead") if threads else None
        try:
            for owner, d, now, ahead in self._deliveries(consumer, mine, batch, pool):
                checked = self._item(d, now, ahead)
                if checked is None:
                    continue
                out, ident = checked
                if by_ref:
                    ref = CheckedFile(self.run_dir, d, ident, (owner, d.entry_id),
                                      self.max_length, self.raw_fp8)  # fmt: skip
                    yield cast(dict[str, Any], ref)  # StreamingDataLoader's to open
                    continue
                item = item_of(d.sample_id, out, self.max_length)
                if self._marking:
                    item[POSITION] = (owner, d.entry_id)
                else:
                    self.record(owner, d.entry_id)
                    self.waited(time.monotonic() - asked)
                yield item
                asked = time.monotonic()
        finally:
            if pool is not None:  # the trainer stopped early: reads not begun are dropped
                pool.shutdown(wait=True, cancel_futures=True)

    def _adopted(self, wid: int, workers: int) -> list[str]:
        """Consumers of another layout (worker count, ranks) with entries still pending:
        the ones this consumer re-reads (each old one has exactly one adopter)."""
        live = {consumer_name(r, w) for r in range(self.world_size) for w in range(workers)}
        pending = _retrying("list consumers", lambda: self.store.spool.consumers(self.group))
        me = self.rank * workers + wid
        total = self.world_size * workers
        out = sorted(c for c in pending if c not in live and zlib.crc32(c.encode()) % total == me)
        if out:
            log.info("stream_adopting", consumer=consumer_name(self.rank, wid), old=out)
        return out

    def _deliveries(
        self, consumer: str, replay: list[tuple[str, str]], batch: int, pool: Reads
    ) -> Iterator[tuple[str, Delivery, bytes | None, Ahead]]:
        """(the consumer it is pending to, entry, its sample's done entry as stored now,
        its file's read begun in `pool`): first each replayed consumer's pending entries
        after its position, in order, then new ones for `consumer`."""
        spool, group = self.store.spool, self.group
        for owner, after in replay:
            while True:
                read = functools.partial(spool.read, group, owner, batch, None, after)
                got = _retrying("read", read)
                if not got:
                    break
                yield from self._with_marks(owner, got, pool)
                after = got[-1].entry_id
        block_ms = max(1, int(self.poll_s * 1000))
        idle = False
        while True:
            # Whether the run is finished is asked only once a read came back empty (it
            # costs three round trips): a stream with entries waiting never asks.
            finished = idle and _retrying("look at the run", self._finished)
            wait = block_ms if idle and not finished else None
            got = _retrying(
                "read", functools.partial(spool.read, group, consumer, batch, wait, None)
            )
            if got:
                idle = False
                yield from self._with_marks(consumer, got, pool)
            elif finished:
                log.info("stream_ended", run=self.run, group=group, consumer=consumer)
                if get_worker_info() is None:  # a DataLoader worker's end is its process's
                    self._end()
                return
            else:
                idle = True

    def _with_marks(
        self, owner: str, got: list[Delivery], pool: Reads
    ) -> Iterator[tuple[str, Delivery, bytes | None, Ahead]]:
        ids = [d.sample_id for d in got]
        nows = _retrying("read the done marks", lambda: self.store.spool.stored_done_many(ids))
        aheads = read_ahead(pool, self.run_dir, got, nows, raw=self.raw_fp8)
        for d, now, ahead in zip(got, nows, aheads, strict=True):
            yield owner, d, now, ahead

    def _finished(self) -> bool:
        """Every sample done or dead, and no reject left dead by a killed consumer (such
        a one is queued again here once it is older than the grace)."""
        if not self.store.spool.extraction_finished():
            return False
        if not unfinished_rejects(self.store):
            return True
        finish_rejects(self.store, self.run_dir)
        return False

    def _item(self, d: Delivery, now: bytes | None, ahead: Ahead = None) -> Checked | None:
        """The delivery's file read and checked (`ahead`: that read begun in a thread), or
        None: stale (skipped: `now`, the sample's done entry as stored when it was read,
        is another) or rejected (requeued)."""
        spool = self.store.spool
        if now != d.stored:
            _retrying("skip", lambda: spool.skip(self.group, d.entry_id))
            log.info("stream_stale_entry", sample=d.sample_id, entry=d.entry_id)
            return None
        entry = MANIFEST_CODEC.decode(d.sample_id, d.stored)
        try:
            if entry is None:
                raise OutputError(f"sample {d.sample_id}: its done entry does not parse")
            if ahead is not None:
                return ahead.result()
            return read_checked(self.run_dir, d.sample_id, entry, raw=self.raw_fp8)
        except OutputError as exc:
            self._reject(d, entry, str(exc))
            return None

    def opened(self, ref: CheckedFile) -> dict[str, Any] | None:
        """The item of a file a DataLoader worker checked (in the trainer's process), or
        None: it failed its checks here (rejected and requeued, as in a worker)."""
        try:
            return ref.open()
        except OutputError as exc:
            self._reject(ref.delivery, MANIFEST_CODEC.decode(ref.sample_id, ref.delivery.stored),
                         str(exc))  # fmt: skip
            return None

    def _reject(self, d: Delivery, entry: Any, why: str) -> None:
        store = self.store
        totals = MANIFEST_CODEC.totals(entry) if entry is not None else (0, 0)
        dead = json.dumps(dead_entry(REJECT_REASON, why, 0, REJECTED_BY + self.group))
        log.error("stream_output_rejected", sample=d.sample_id, reason=REJECT_REASON, error=why)
        if not _retrying(
            "reject", lambda: store.spool.reject(self.group, d, totals, dead, REJECT_REASON)
        ):
            return  # stale meanwhile: re-done by someone else
        remove_output(self.run_dir, d.sample_id)
        if _retrying("requeue", lambda: requeue_rejected(store, d.sample_id)):
            log.info("stream_output_requeued", sample=d.sample_id)


def consumer_name(rank: int, worker: int) -> str:
    return f"rank{rank}-worker{worker}"
