"""The ack stage's book of claimed chunks: which samples are still open in each.

Pure bookkeeping, used from the main thread only. A chunk finishes when every one of its
samples is resolved (done, retried as a job of its own, or dead); a chunk with a sample
that was handed back (server down, disk full...) is given back whole, untouched.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hsq.store import ChunkJob, SampleRef


@dataclass
class OpenChunk:
    job: ChunkJob
    todo: deque[SampleRef]
    """Samples not sent yet."""
    open: set[str] = field(default_factory=set)
    """Samples sent and not resolved yet."""
    hand_back: bool = False
    routed: set[str] = field(default_factory=set)
    """Samples settled by a retry job of their own or the dead letter: a chunk given back
    must not bring them again."""

    @property
    def complete(self) -> bool:
        return not self.todo and not self.open


@dataclass(frozen=True)
class WorkItem:
    ref: SampleRef
    attempt: int
    job_id: str

    @property
    def sample_id(self) -> str:
        return self.ref[0]

    @property
    def tokens(self) -> int:
        return self.ref[1].num_tokens


class ChunkBook:
    def __init__(self) -> None:
        self.chunks: dict[str, OpenChunk] = {}

    def add(self, job: ChunkJob, done: set[str]) -> OpenChunk:
        chunk = OpenChunk(job, deque(r for r in job.samples if r[0] not in done))
        self.chunks[job.job_id] = chunk
        return chunk

    def next_item(self) -> WorkItem | None:
        for chunk in self.chunks.values():
            if chunk.todo and not chunk.hand_back:
                ref = chunk.todo.popleft()
                chunk.open.add(ref[0])
                return WorkItem(ref, chunk.job.attempt, chunk.job.job_id)
        return None

    def put_back(self, item: WorkItem) -> None:
        """Undo next_item: the sample was not sent (a full spool); it goes first again."""
        chunk = self.chunks.get(item.job_id)
        if chunk is not None:
            chunk.open.discard(item.sample_id)
            chunk.todo.appendleft(item.ref)

    def peek_tokens(self) -> int | None:
        for chunk in self.chunks.values():
            if chunk.todo and not chunk.hand_back:
                return chunk.todo[0][1].num_tokens
        return None

    def resolve(self, item: WorkItem, routed: bool = False) -> OpenChunk | None:
        """The sample is settled (``routed``: retried or dead, not done); returns its chunk
        if that is now complete."""
        chunk = self.chunks.get(item.job_id)
        if chunk is None:
            return None
        chunk.open.discard(item.sample_id)
        if routed:
            chunk.routed.add(item.sample_id)
        return chunk if chunk.complete and not chunk.hand_back else None

    def hand_back(self, item: WorkItem) -> None:
        chunk = self.chunks.get(item.job_id)
        if chunk is not None:
            chunk.open.discard(item.sample_id)
            chunk.hand_back = True

    def pop(self, job_id: str) -> OpenChunk | None:
        return self.chunks.pop(job_id, None)

    def clear(self) -> list[OpenChunk]:
        out = list(self.chunks.values())
        self.chunks.clear()
        return out
