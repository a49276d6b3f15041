"""The dispatcher: one thread that polls the dump dir for every in-flight rid.

Request threads register a rid before they send it, say when the answer came, and wait
on a ticket; the dispatcher runs :class:`hsq.protocol.RidMatcher` a few hundred times a
second while something is in flight (once a second when idle, to clear dumps nobody asked
for), hands each decided dump to its ticket and counts what it discards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from hsq.errors import NoDumpError, ServerUnavailableError
from hsq.protocol import FoundDump, Match, RidMatcher, clear_dump_dir, remove_dump

log = structlog.get_logger("hsq.worker.dispatch")

# Polls back off from 1 ms to this while nothing lands: a dump usually lands within
# milliseconds of its answer, and every millisecond between the two is idle GPU time.
MAX_POLL_S = 0.005
IDLE_POLL_S = 1.0


class Ticket:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._event = threading.Event()
        self.match: Match | None = None

    def _set(self, match: Match) -> None:
        self.match = match
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


class Dispatcher:
    def __init__(
        self,
        dump_dir: Path,
        staging: Path,
        *,
        timeout_s: float,
        on_discard: Callable[[str], None] | None = None,
    ) -> None:
        self.dump_dir = dump_dir
        self.timeout_s = timeout_s
        self._matcher = RidMatcher(dump_dir, staging, timeout_s=timeout_s)
        self._tickets: dict[str, Ticket] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._on_discard = on_discard
        self._thread = threading.Thread(target=self._run, name="dispatcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    @property
    def discarded(self) -> dict[str, int]:
        with self._cond:
            return dict(self._matcher.discarded)

    def register(self, rid: str, num_tokens: int) -> Ticket:
        """Call before sending: a dump may land before the answer does."""
        ticket = Ticket(rid)
        with self._cond:
            self._matcher.add(rid, num_tokens, time.monotonic())
            self._tickets[rid] = ticket
            self._cond.notify_all()
        return ticket

    def answered(self, rid: str) -> None:
        with self._cond:
            self._matcher.answered(rid, time.monotonic())

    def abandon(self, rid: str) -> None:
        """The request failed: a dump that still comes for it is discarded as late."""
        with self._cond:
            self._matcher.abandon(rid)
            self._tickets.pop(rid, None)

    def clear(self) -> int:
        """Remove every dump (the server restarted); only while nothing is in flight."""
        with self._cond:
            if self._tickets:
                raise RuntimeError("clear() with requests in flight")
            return clear_dump_dir(self.dump_dir)

    def wait(self, ticket: Ticket, server_alive: Callable[[], bool]) -> FoundDump:
        """The ticket's dump (already moved to staging), or the matcher's error.

        While waiting the server is asked now and then whether it is alive: a server that
        died after answering never writes the dump, and that is not the sample's fault.
        """
        hard_deadline = time.monotonic() + self.timeout_s + 30.0  # if the poller stalls
        while not ticket.wait(1.0):
            if not server_alive():
                self.abandon(ticket.rid)
                raise ServerUnavailableError("the server went away before the dump was complete")
            if time.monotonic() > hard_deadline:
                self.abandon(ticket.rid)
                raise NoDumpError(f"no decision on rid {ticket.rid!r}: the dump poller stalled")
        match = ticket.match
        assert match is not None
        if match.error is not None:
            raise match.error
        assert match.dump is not None
        return match.dump

    def _run(self) -> None:
        delay = 0.001
        while True:
            with self._cond:
                if self._stop:
                    return
                if not self._tickets:
                    self._cond.wait(IDLE_POLL_S)  # woken by register()
                    if self._stop:
                        return
                busy = bool(self._tickets)
                try:
                    decided, dropped = self._matcher.poll(time.monotonic())
                except Exception as exc:  # the dump dir is ours; log and keep polling
                    log.error("dump_scan_failed", error=f"{type(exc).__name__}: {exc}")
                    decided, dropped = [], []
                tickets = [(self._tickets.pop(m.rid, None), m) for m in decided]
            self._deliver(tickets, dropped)
            if decided or dropped:
                delay = 0.001
            elif busy:
                delay = min(delay * 1.5, MAX_POLL_S)
            if busy:
                time.sleep(delay)

    def _deliver(
        self, tickets: list[tuple[Ticket | None, Match]], dropped: list[tuple[str, Path, str]]
    ) -> None:
        for why, path, rid in dropped:
            log.warning("dump_discarded", why=why, dump=path.name, rid=rid[:200])
            if self._on_discard is not None:
                self._on_discard(why)
        for ticket, match in tickets:
            if ticket is not None:
                ticket._set(match)
            elif match.dump is not None:  # abandoned meanwhile: nobody will take it
                remove_dump(match.dump.path)
