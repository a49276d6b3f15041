"""All of hsq's Redis traffic. Keys come from hsq.keys, jobs are RQ jobs.

Nothing else imports redis or rq (the test harness that starts redis-server aside), and the
gateway imports no file format: a done entry is stored through a codec (hsq.outputs' manifest
codec; hsq.runstore.RunStore binds the two). Every public method turns Redis errors into hsq
errors: StoreUnavailableError (unreachable or timing out: transient) or StoreError; a write
to a run that was purged or re-created since this store read its config raises
RunChangedError.

By aggregate, each in its module, sharing one Fence (fence.py) per store:

    connection.py  connect() (TLS files from the URL), Redis errors as hsq errors
    scripts.py     the Lua scripts
    config.py      ConfigIndex: the run's config and pins, the dataset index
    counters.py    Stats, Counters, RunStats (the stats hash, typed): the O(1) counters
                   status reads, recounting them
    queue.py       JobQueue: enqueue, claim, finish, give back, reap
    ledger.py      Ledger: done (through a DoneCodec), dead letter, crash counts
    workers.py     WorkerRegistry: registration and heartbeats
    lifecycle.py   Lifecycle: the enqueue lock, begin/end enqueue, lost samples, purge
    spool.py       Spool: a streamed run's byte reservations, consumer groups, commits
    facade.py      Store: all of them in one object
    roles.py       what each consumer needs (WorkerStore, Claimer, DoneMarker, BatchMarker,
                   StatsKeeper)
    memory.py      MemoryStore: an in-memory fake of the worker's roles, for unit tests
"""

from __future__ import annotations

from hsq.keys import HEARTBEAT_TTL_S
from hsq.store.config import ConfigIndex
from hsq.store.connection import Client, RunListing, connect, list_runs, redis_calls, scan_runs
from hsq.store.counters import Counters, RunStats, Stats
from hsq.store.facade import Store
from hsq.store.fence import Fence
from hsq.store.jobs import AnyRef, ChunkJob, SampleRef, chunked, job_size
from hsq.store.ledger import DoneCodec, Ledger
from hsq.store.lifecycle import Lifecycle
from hsq.store.memory import MemoryRun, MemoryStore
from hsq.store.queue import JobQueue
from hsq.store.roles import BatchMarker, Claimer, DoneMarker, StatsKeeper, WorkerStore
from hsq.store.spool import (
    CONSUMER_CLIENT,
    Delivery,
    GroupInfo,
    SampleOverBudget,
    Spool,
    consumer_client,
)
from hsq.store.workers import WorkerRegistry, new_worker_id

__all__ = [
    "CONSUMER_CLIENT",
    "HEARTBEAT_TTL_S",
    "AnyRef",
    "BatchMarker",
    "ChunkJob",
    "Claimer",
    "Client",
    "ConfigIndex",
    "Counters",
    "Delivery",
    "DoneCodec",
    "DoneMarker",
    "Fence",
    "GroupInfo",
    "JobQueue",
    "Ledger",
    "Lifecycle",
    "MemoryRun",
    "MemoryStore",
    "RunListing",
    "RunStats",
    "SampleOverBudget",
    "SampleRef",
    "Spool",
    "Stats",
    "StatsKeeper",
    "Store",
    "WorkerRegistry",
    "WorkerStore",
    "chunked",
    "connect",
    "consumer_client",
    "job_size",
    "list_runs",
    "new_worker_id",
    "redis_calls",
    "scan_runs",
]
