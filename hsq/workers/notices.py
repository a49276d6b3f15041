"""What the worker's main thread announces, for whoever listens: metrics, and the tally of
counts the worker's record in Redis carries (`hsq status`).

The stages report to the main thread on the event queue (hsq/workers/events.py); the main
thread and its collaborators (in-flight accounting, outcome application, pauses, run
watching) announce what they did as Notices. Listeners are called on the main thread, in
order, and do nothing but count: a listener never changes what the worker does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hsq.workers.chunks import WorkItem
from hsq.workers.state import WorkerState


@dataclass(frozen=True)
class StateChanged:
    state: WorkerState


@dataclass(frozen=True)
class InFlightChanged:
    samples: int
    """Sent and not settled yet (on the server, waiting for their dump, or persisting)."""
    tokens: int
    """Tokens of the requests on the server."""


@dataclass(frozen=True)
class SampleDone:
    item: WorkItem


@dataclass(frozen=True)
class SampleFailed:
    """Retried as a job of its own, or (``dead``) in the dead letter."""

    item: WorkItem
    reason: str
    dead: bool


@dataclass(frozen=True)
class AuditRejected:
    """--audit-fraction found a done sample's states to be another input's: un-done and
    dead-lettered (counted by the audit, not as one of the worker's dead samples)."""

    sample_id: str
    reason: str


@dataclass(frozen=True)
class ChunkHandedBack:
    job_id: str
    samples: int
    """Its samples that go back to a queue (not those already retried or dead)."""


@dataclass(frozen=True)
class ServerHealth:
    up: bool


@dataclass(frozen=True)
class OutputDirMoved:
    """The run was re-created with another output dir."""

    path: Path


Notice = (
    StateChanged
    | InFlightChanged
    | SampleDone
    | SampleFailed
    | AuditRejected
    | ChunkHandedBack
    | ServerHealth
    | OutputDirMoved
)
Listener = Callable[[Notice], None]


class Notices:
    def __init__(self, *listeners: Listener) -> None:
        self._listeners = list(listeners)

    def emit(self, notice: Notice) -> None:
        for listener in self._listeners:
            listener(notice)


class Tally:
    """The counts in the worker's record (heartbeat): samples done, retried and dead, tokens
    done, chunks handed back. Written on the main thread, read by the heartbeat."""

    def __init__(self) -> None:
        self.counts = {"done": 0, "retried": 0, "dead": 0, "tokens": 0, "handed_back": 0}

    def __call__(self, notice: Notice) -> None:
        c = self.counts
        if isinstance(notice, SampleDone):
            c["done"] += 1
            c["tokens"] += notice.item.tokens
        elif isinstance(notice, SampleFailed):
            c["dead" if notice.dead else "retried"] += 1
        elif isinstance(notice, ChunkHandedBack):
            c["handed_back"] += 1
