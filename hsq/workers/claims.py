"""The chunk jobs this worker holds: claimed from the store and not yet finished, given back
or released. The worker's own bookkeeping (the store keeps only the wip list in Redis).

What it is for: a job in our wip list that we did not hand out is what a lost BLMOVE reply
leaves behind (redis-py retries the command, and the first move's job sits in wip unknown to
us). `claim` returns such a stray job first, so it is never stranded there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hsq.store import ChunkJob, Claimer


class Claims:
    def __init__(self, store: Claimer, worker_id: str) -> None:
        self.store = store
        self.worker_id = worker_id
        self._held: set[str] = set()  # job ids handed out and not yet finished
        self._lock = threading.RLock()

    def claim(self, timeout: float) -> ChunkJob | None:
        """A stray job of our wip list if there is one, else a newly claimed one (waiting
        up to `timeout` seconds; not at all if `timeout` <= 0)."""
        wip = self.store.held_job_ids(self.worker_id)
        with self._lock:
            strays = [j for j in wip if j not in self._held]
        if strays:
            job: ChunkJob | None = self.store.load_held(self.worker_id, strays[0])
        else:
            job = self.store.claim(self.worker_id, timeout)
        if job is not None:
            with self._lock:
                self._held.add(job.job_id)
        return job

    def finish(self, job: ChunkJob) -> bool:
        """Drop a finished job (False: it was not ours any more, a reaper took it)."""
        return self._let_go(self.store.finish, job)

    def give_back(self, job: ChunkJob) -> bool:
        """Put a job back at the front of its queue, untouched."""
        return self._let_go(self.store.give_back, job)

    def _let_go(self, op: Callable[[str, ChunkJob], bool], job: ChunkJob) -> bool:
        """`op` on a held job; held no more, whatever its answer (or error)."""
        with self._lock:
            try:
                return op(self.worker_id, job)
            finally:
                self._held.discard(job.job_id)

    def release_all(self) -> int:
        """Move every job of our wip list back to the front of the main queue."""
        with self._lock:
            n = self.store.release_wip(self.worker_id)
            self._held.clear()
            return n
