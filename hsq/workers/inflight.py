"""In-flight accounting: how much of the worker's work is between send and settled.

A sample is *at the server* from its dispatch until the server answers (ANSWERED) or the
request fails, then *staged* while the send stage waits for its dump and hands it on, until
the send stage reports it (SENT: handed to the persist stage; or FAILED there), then
*persisting* until the persist stage reports it (DONE or FAILED). *Sending* is at the
server plus staged: everything in the send stage.

``--inflight`` K caps the requests at the server, ``--max-inflight-tokens`` their tokens:
the server is kept at K requests while answered samples wait for their dumps (a request's
answer comes before its dump is matched, checked and taken by the persist stage, and a slot
held over those steps is one the server does not have; BENCHMARKS.md 8e measured the short
case after the change: bound by the output disk, not by the slots). At most K more are
staged, so dumps waiting in the dump dir stay bounded (2K + the persist stage's depth and
threads); a full persist stage still holds the staged ones and so, through them, the
server. The heartbeat shows the sum and the peak of
tokens.
"""

from __future__ import annotations

from hsq.workers.chunks import WorkItem
from hsq.workers.events import Event, EventKind
from hsq.workers.notices import InFlightChanged, Notices


class InFlight:
    def __init__(self, limit: int, max_tokens: int | None, notices: Notices) -> None:
        self.limit = limit
        self.max_tokens = max_tokens
        self._notices = notices
        self.at_server = 0
        self.at_server_tokens = 0
        self.sending = 0
        self.persisting = 0
        self.peak_tokens = 0

    @property
    def total(self) -> int:
        return self.sending + self.persisting

    def room(self) -> bool:
        """Whether another request may go to the server now, by count (K at the server,
        at most K more staged behind them)."""
        return self.at_server < self.limit and self.sending < 2 * self.limit

    def allows(self, tokens: int) -> bool:
        """Whether a sample of ``tokens`` may be sent now, by the token budget."""
        if self.max_tokens is None or self.at_server == 0:
            return True  # one sample larger than the budget still goes, alone
        return self.at_server_tokens + tokens <= self.max_tokens

    def dispatched(self, item: WorkItem) -> None:
        self.sending += 1
        self.at_server += 1
        self.at_server_tokens += item.tokens
        self.peak_tokens = max(self.peak_tokens, self.at_server_tokens)
        self._announce()

    def account(self, ev: Event) -> None:
        """A stage reported on ``ev.item``: move it along (every event, always first)."""
        if ev.kind is EventKind.ANSWERED or (ev.from_send and not ev.answered):
            self.at_server -= 1
            self.at_server_tokens -= ev.item.tokens
        if ev.kind is EventKind.ANSWERED:
            self._announce()
            return
        if ev.kind is EventKind.SENT or ev.from_send:
            self.sending -= 1
        if ev.kind is EventKind.SENT:
            self.persisting += 1
        elif not ev.from_send:
            self.persisting -= 1
        self._announce()

    def _announce(self) -> None:
        self._notices.emit(InFlightChanged(self.total, self.at_server_tokens))
