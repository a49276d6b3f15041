"""What each consumer needs of the store, as protocols: the worker takes a WorkerStore, its
claim bookkeeping a Claimer, its persist stage a DoneMarker, its committer a BatchMarker.
RunStore (hsq.runstore) and the in-memory fake (hsq/store/memory.py) both satisfy them.

Generic in the done entry's type (hsq's manifest entry; the gateway knows no file format).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from hsq.runconfig import RunConfig
from hsq.store.jobs import AnyRef, ChunkJob

E = TypeVar("E")
E_contra = TypeVar("E_contra", contravariant=True)


class Claimer(Protocol):
    """Claiming and settling chunk jobs (hsq/workers/claims.py)."""

    def claim(self, worker_id: str, timeout: float) -> ChunkJob | None: ...
    def held_job_ids(self, worker_id: str) -> list[str]: ...
    def load_held(self, worker_id: str, job_id: str) -> ChunkJob: ...
    def finish(self, worker_id: str, job: ChunkJob) -> bool: ...
    def give_back(self, worker_id: str, job: ChunkJob) -> bool: ...
    def release_wip(self, worker_id: str) -> int: ...


class BatchMarker(Protocol[E_contra]):
    """Marking durably written samples done, a batch per call (hsq/workers/commit.py)."""

    def mark_done_many(self, entries: Sequence[tuple[str, E_contra]]) -> list[bool]: ...


class DoneMarker(BatchMarker[E_contra], Protocol[E_contra]):
    """The persist stage's store (hsq/workers/persist.py): marks, the last look at done
    before a rename, and the run's pins (hsq/workers/runview.py)."""

    def done_among(self, ids: list[str]) -> set[str]: ...
    def pin_dump_identity(
        self, model_id: str, layer_ids: list[int], dump_dtype: str, hidden_size: int
    ) -> dict[str, Any]: ...


class WorkerStore(Claimer, DoneMarker[E], Protocol[E]):
    """Everything a worker does with the store (hsq/workers/)."""

    def load_config(self) -> RunConfig | None: ...
    def require_config(self) -> RunConfig: ...
    def register(self, worker_id: str, info: dict[str, Any]) -> None: ...
    def heartbeat(self, worker_id: str, info: dict[str, Any]) -> None: ...
    def unregister(self, worker_id: str) -> None: ...
    def reap(self) -> dict[str, int]: ...
    def nothing_outstanding(self) -> bool: ...
    def enqueue(
        self,
        chunks: Iterable[Sequence[AnyRef]],
        *,
        retry: bool = ...,
        attempt: int = ...,
        reason: str | None = ...,
    ) -> int: ...
    def record_crash(self, sample_id: str) -> int: ...
    def to_dead(
        self, sample_id: str, reason: str, message: str, attempts: int, worker: str | None
    ) -> None: ...
    def get_manifest(self, sample_id: str) -> E | None: ...
    def undo_done(self, sample_id: str, entry: E) -> bool: ...
