"""In-flight accounting: how much of the worker's work is between send and settled.

A sample is *sending* from its dispatch until the send stage reports it (SENT: handed to
the persist stage; or FAILED there), then *persisting* until the persist stage reports
it (DONE or FAILED). ``--inflight`` caps the samples sending, ``--max-inflight-tokens``
their tokens; the heartbeat shows the sum and the peak of tokens.
"""

from __future__ import annotations

from hsq.workers.chunks import WorkItem
from hsq.workers.events import Event, EventKind
from hsq.workers.notices import InFlightChanged, Notices


class InFlight:
    def __init__(self, max_tokens: int | None, notices: Notices) -> None:
        self.max_tokens = max_tokens
        self._notices = notices
        self.sending = 0
        self.sending_tokens = 0
        self.persisting = 0
        self.peak_tokens = 0

    @property
    def total(self) -> int:
        return self.sending + self.persisting

    def allows(self, tokens: int) -> bool:
        """Whether a sample of ``tokens`` may be sent now, by the token budget."""
        if self.max_tokens is None or self.sending == 0:
            return True  # one sample larger than the budget still goes, alone
        return self.sending_tokens + tokens <= self.max_tokens

    def dispatched(self, item: WorkItem) -> None:
        self.sending += 1
        self.sending_tokens += item.tokens
        self.peak_tokens = max(self.peak_tokens, self.sending_tokens)
        self._announce()

    def account(self, ev: Event) -> None:
        """A stage reported on ``ev.item``: move it along (every event, always first)."""
        if ev.kind is EventKind.SENT or ev.from_send:
            self.sending -= 1
            self.sending_tokens -= ev.item.tokens
        if ev.kind is EventKind.SENT:
            self.persisting += 1
        elif not ev.from_send:
            self.persisting -= 1
        self._announce()

    def _announce(self) -> None:
        self._notices.emit(InFlightChanged(self.total, self.sending_tokens))
