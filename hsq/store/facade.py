"""RunStore's shape: one object composed of the aggregates (`config_index`, `counters`,
`queue`, `ledger`, `workers`, `lifecycle`). A caller reaches an aggregate's method through
the aggregate (`store.lifecycle.purge()`), except for the methods rebound below: those the
worker's roles name (hsq/store/roles.py, which the in-memory MemoryStore satisfies too),
and a few every reader uses (counts, listings of a hash, the manifest pages).

The object holds no logic: each rebound method is its aggregate's own (bound), so a
method has one home and one signature, and a reader goes straight to it.

Generic in the done entry's type: hsq.runstore.RunStore binds it to the manifest entry
(the gateway itself knows no file format).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from hsq.store.config import ConfigIndex
from hsq.store.connection import Client
from hsq.store.counters import Stats
from hsq.store.fence import Fence
from hsq.store.ledger import DoneCodec, Ledger
from hsq.store.lifecycle import Lifecycle
from hsq.store.queue import JobQueue
from hsq.store.spool import Spool
from hsq.store.workers import WorkerRegistry

E = TypeVar("E")


class Store(Generic[E]):
    def __init__(self, client: Client, run: str, codec: DoneCodec[E]) -> None:
        self.fence = Fence(client, run)
        self.client = client
        self.run = run
        self.keys = self.fence.keys
        self.config_index = ConfigIndex(self.fence)
        self.counters = Stats(self.fence)
        self.workers = WorkerRegistry(self.fence)
        self.queue = JobQueue(self.fence, self.workers)
        self.ledger: Ledger[E] = Ledger(self.fence, codec)
        self.lifecycle = Lifecycle(self.fence, self.queue, self.workers)
        self.spool = Spool(self.fence, self.queue)
        self.queue.on_released = self.spool.release_all
        config_index = self.config_index  # the run's config and the dataset index
        self.load_config = config_index.load_config
        self.require_config = config_index.require_config
        self.create_config = config_index.create_config
        self.pin_dump_identity = config_index.pin_dump_identity
        self.iter_hash_keys = config_index.iter_hash_keys
        self.count = config_index.count
        counters = self.counters  # the O(1) counters
        self.set_totals = counters.set_totals
        self.stats = counters.stats
        self.counts = counters.counts
        self.snapshot = counters.snapshot
        self.recount_queues = counters.recount_queues
        # the lost samples are the stats record's too (roles.StatsKeeper)
        self.set_lost = self.lifecycle.set_lost
        self.forget_lost = self.lifecycle.forget_lost
        queue = self.queue  # the queues and the wip lists
        self.enqueue = queue.enqueue
        self.claim = queue.claim
        self.held_job_ids = queue.held_job_ids
        self.load_held = queue.load_held
        self.finish = queue.finish
        self.give_back = queue.give_back
        self.release_wip = queue.release_wip
        self.reap = queue.reap
        self.queue_lengths = queue.queue_lengths
        self.nothing_outstanding = queue.nothing_outstanding
        self.outstanding_samples = queue.outstanding_samples
        ledger = self.ledger  # done, dead, crashes
        self.done_among = ledger.done_among
        self.mark_done = ledger.mark_done
        self.mark_done_many = ledger.mark_done_many
        self.mark_held_done = ledger.mark_held_done
        self.undo_done = ledger.undo_done
        self.get_manifest = ledger.get_manifest
        self.iter_manifest = ledger.iter_manifest
        self.to_dead = ledger.to_dead
        self.dead_entries = ledger.dead_entries
        self.delete_fields = ledger.delete_fields
        self.record_crash = ledger.record_crash
        self.reserve_spool = self.spool.reserve  # a streamed run's byte budget (spool.py)
        self.release_spool = self.spool.release
        self.spool_settled = self.spool.settled
        workers = self.workers  # registration, heartbeats
        self.register = workers.register
        self.heartbeat = workers.heartbeat
        self.unregister = workers.unregister
