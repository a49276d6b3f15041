"""What the send and persist stages report to the ack stage (the main thread), in order
of arrival on one queue. No shared flags: every outcome is one of these objects."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hsq.workers.chunks import WorkItem


class EventKind(enum.Enum):
    ANSWERED = "answered"
    """The server answered the sample's request: its slot on the server is free, while
    the send stage still waits for the dump and hands it on."""
    SENT = "sent"
    """The send stage handed the sample to the persist stage: its send slot is free."""
    DONE = "done"
    """The persist stage wrote the output and marked the sample done."""
    FAILED = "failed"
    """A stage raised; ``exc`` goes through workers.policy."""


@dataclass(frozen=True)
class Event:
    item: WorkItem
    kind: EventKind
    exc: BaseException | None = None
    from_send: bool = False
    """FAILED in the send stage: frees a send slot as well."""
    answered: bool = False
    """A FAILED from the send stage that came after its ANSWERED (its server slot is
    already free)."""
