"""The dispatcher: one thread that polls the dump dir for every in-flight rid.

Request threads register a rid before they send it, say when the answer came, and wait
on a ticket; the dispatcher runs :class:`hsq.workers.send.ridmatch.RidMatcher` a few hundred times a
second while something is in flight (once a second when idle, to clear dumps nobody asked
for), hands each decided dump to its ticket and counts what it discards.

It also watches the dump dir itself: if the directory (or its staging dir) is removed,
re-created or swapped for a link under the worker, or cannot be listed any more, every
waiting request fails with DumpDirError (the environment's fault: handed back, never
dead-lettered) and nothing more is read from the path until the worker has taken the
directory again (:meth:`retake`). Any other exception from the matcher is a bug: every
waiting request fails with InternalError (handed back too, the worker stops, exit 1), and
the dispatcher matches nothing more (:attr:`failed`); a request is never charged for it.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from hsq.dump.find import FoundDump, clear_dump_dir, remove_dump
from hsq.dump.ready import READY_FILE
from hsq.errors import (
    DumpDirError,
    HookInactiveError,
    InternalError,
    NoDumpError,
    ServerUnavailableError,
)
from hsq.workers.send.ridmatch import UNREMOVABLE, Match, RidMatcher

log = structlog.get_logger("hsq.worker.dispatch")

# Polls back off from 1 ms to this while nothing lands: a dump usually lands within
# milliseconds of its answer, and every millisecond between the two is idle GPU time.
MAX_POLL_S = 0.005
IDLE_POLL_S = 1.0

Identity = tuple[int, int, int, int]


def dir_identity(dump_dir: Path, staging: Path) -> Identity:
    """(device, inode) of the dump dir and of its staging dir. The dump dir is followed
    (--dump-dir may name a link the operator made), the staging dir is not."""
    d = os.stat(dump_dir)
    s = os.lstat(staging)
    if not (stat.S_ISDIR(d.st_mode) and stat.S_ISDIR(s.st_mode)):
        raise NotADirectoryError(f"{dump_dir} or {staging} is not a directory")
    return d.st_dev, d.st_ino, s.st_dev, s.st_ino


class Ticket:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._given_up = False
        self.match: Match | None = None

    def _set(self, match: Match) -> bool:
        """False if the request gave up meanwhile: the dump is then the caller's to remove."""
        with self._lock:
            if self._given_up:
                return False
            self.match = match
        self._event.set()
        return True

    def _give_up(self) -> Match | None:
        """No match is taken from now on; the one set already, if any."""
        with self._lock:
            self._given_up = True
            return self.match

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
        self.staging = staging
        self.timeout_s = timeout_s
        self._matcher = RidMatcher(dump_dir, staging, timeout_s=timeout_s)
        self._identity = dir_identity(dump_dir, staging)
        self._tickets: dict[str, Ticket] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._on_discard = on_discard
        self._discarded: dict[str, int] = {}
        self._polls = 0  # polls completed; each runs whole under _cond
        self._confirming = 0  # callers of confirm_single waiting for the next poll
        self.broken: str | None = None
        """Why the dump dir cannot be used any more (removed, replaced); None while fine."""
        self.failed: str | None = None
        """Why the matcher cannot be trusted any more (it raised: a bug); for good."""
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
        # A copy made after each poll: the heartbeat never waits on the dispatcher's lock.
        return dict(self._discarded)

    def register(self, rid: str, num_tokens: int) -> Ticket:
        """Call before sending: a dump may land before the answer does."""
        ticket = Ticket(rid)
        with self._cond:
            if self.failed is not None:
                raise InternalError(self.failed)
            if self.broken is not None:
                raise DumpDirError(self.broken)
            self._matcher.add(rid, num_tokens)
            self._tickets[rid] = ticket
            self._cond.notify_all()
        return ticket

    def answered(self, rid: str) -> None:
        with self._cond:
            self._matcher.answered(rid, time.monotonic())

    def abandon(self, ticket: Ticket) -> None:
        """The request failed: a dump that still comes for it is discarded as late, and one
        matched to it already (a server may dump a request and then fail it, e.g. close
        the connection under it) is removed, never left in staging."""
        with self._cond:
            self._matcher.abandon(ticket.rid)
            self._tickets.pop(ticket.rid, None)
        match = ticket._give_up()
        if match is not None and match.dump is not None:
            self.release(ticket.rid)
            remove_dump(match.dump.path)

    def release(self, rid: str) -> None:
        """The dump handed out for ``rid`` failed validation: it will not be used."""
        with self._cond:
            self._matcher.release(rid)

    def confirm_single(self, rid: str) -> None:
        """Before the dump handed out for ``rid`` is used: one more look at the dump dir,
        then MultipleDumpsError if a second dump carrying the rid came after the first was
        taken (docs/dump-protocol.md: two dumps for one rid fail the attempt).

        The look is the dispatcher's next poll, which every caller waiting meanwhile shares
        (a poll of its own per sample cost the worker's interpreter ~0.5 ms a sample,
        profiled). A poll runs whole under the lock, so one completed after this call
        read the count began after it. Without a live dispatcher thread it polls itself."""
        with self._cond:
            seen = self._polls
            self._confirming += 1
            self._cond.notify_all()  # an idle dispatcher polls now, not in a second
            try:
                while self._polls == seen and self._thread.is_alive() and not self._stop:
                    self._cond.wait(0.1)
            finally:
                self._confirming -= 1
            polled = self._polls != seen
        if not polled:
            self._poll_once()
        with self._cond:
            if self.failed is not None:  # its record of second dumps cannot be trusted
                raise InternalError(self.failed)
            self._matcher.confirm_single(rid)

    def clear(self) -> int:
        """Remove every dump (the server restarted); only while nothing is in flight. The
        new server has to prove its hook live again with a dump of its own."""
        with self._cond:
            if self._tickets:
                raise RuntimeError("clear() with requests in flight")
            self._matcher.reset_proof()
            if self.broken is not None:
                return 0  # not ours until taken again (which clears it)
            try:
                return clear_dump_dir(self.dump_dir)
            except OSError as exc:  # gone: the next poll says so and the worker retakes it
                log.error("dump_dir_clear_failed", error=str(exc))
                return 0

    def retake(self, staging: Path) -> None:
        """The worker took the dump dir again (after :attr:`broken`): watch it from now."""
        with self._cond:
            if self._tickets:
                raise RuntimeError("retake() with requests in flight")
            self.staging = staging
            self._matcher.retarget(staging)
            self._identity = dir_identity(self.dump_dir, staging)
            self.broken = None

    def wait(self, ticket: Ticket, server_alive: Callable[[], bool]) -> FoundDump:
        """The ticket's dump (already moved to staging), or the matcher's error.

        While waiting the server is asked now and then whether it is alive: a server that
        died after answering never writes the dump, and that is not the sample's fault.
        """
        hard_deadline = time.monotonic() + self.timeout_s + 30.0  # if the poller stalls
        while not ticket.wait(1.0):
            if not server_alive():
                self.abandon(ticket)
                raise ServerUnavailableError("the server went away before the dump was complete")
            if time.monotonic() > hard_deadline:
                self.abandon(ticket)
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
                if not self._tickets and not self._confirming:
                    self._cond.wait(IDLE_POLL_S)  # woken by register(), confirm_single()
                    if self._stop:
                        return
                busy = bool(self._tickets) or self._confirming > 0
            if self._poll_once():
                delay = 0.001
            elif busy:
                delay = min(delay * 1.5, MAX_POLL_S)
            if busy:
                time.sleep(delay)

    def _poll_once(self) -> bool:
        """One look at the dump dir; True if something was decided or discarded."""
        with self._cond:
            tickets, dropped = self._poll_locked()
            self._discarded = dict(self._matcher.discarded)
            self._polls += 1
            if self._confirming:
                self._cond.notify_all()
        self._deliver(tickets, dropped)
        return bool(tickets or dropped)

    def _poll_locked(self) -> tuple[list[tuple[Ticket | None, Match]], list[tuple[str, Path, str]]]:
        if self.broken is not None or self.failed is not None:
            return [], []  # not ours any more (until retake()), or not trusted any more
        problem = self._check_dirs()
        if problem is None:
            try:
                decided, dropped = self._matcher.poll(time.monotonic())
            except OSError as exc:  # EACCES, EIO listing it: the directory's fault
                problem = f"the dump dir {self.dump_dir} cannot be read any more: {exc}"
            except Exception as exc:  # a bug: no request is charged for it
                self.failed = (
                    f"the dump matcher failed ({type(exc).__name__}: {exc}): a bug in hsq, "
                    "not the samples'; the worker hands its work back and stops"
                )
                log.exception("dump_matcher_failed", dump_dir=str(self.dump_dir))
                return self._fail_waiting(InternalError(self.failed)), []
            else:
                decided = [self._unproven(m) for m in decided]
                return [(self._tickets.pop(m.rid, None), m) for m in decided], dropped
        self.broken = problem
        log.error("dump_dir_changed", dump_dir=str(self.dump_dir), error=problem)
        return self._fail_waiting(DumpDirError(problem)), []

    def _fail_waiting(self, err: Exception) -> list[tuple[Ticket | None, Match]]:
        """Every waiting request fails with ``err`` (each gets its own exception object)."""
        failed: list[tuple[Ticket | None, Match]] = [
            (t, Match(r, None, type(err)(str(err)))) for r, t in self._tickets.items()
        ]
        for rid in list(self._tickets):
            self._matcher.abandon(rid)
        self._tickets.clear()
        return failed

    def _check_dirs(self) -> str | None:
        try:
            now = dir_identity(self.dump_dir, self.staging)
        except OSError as exc:
            return (
                f"the dump dir {self.dump_dir} (or its staging dir) is gone or not a "
                f"directory any more: {exc.strerror or exc}"
            )
        if now != self._identity:
            return (
                f"the dump dir {self.dump_dir} was replaced while the worker ran (removed and "
                "re-created, moved, or swapped for a link)"
            )
        return None

    def _unproven(self, match: Match) -> Match:
        """A request answered without any dump, while nothing at all was ever written into
        the dump dir since the worker took it (or since its server came back): the readiness
        marker vouches for a hook that is not there (a marker left by an earlier server, or
        a server dumping elsewhere). That is not the sample's fault: HookInactiveError makes
        the worker hand the work back and exit 2, as it does without a marker."""
        if not isinstance(match.error, NoDumpError) or self._matcher.proven:
            return match
        err = HookInactiveError(
            f"the server answered request {match.rid!r} but no dump at all appeared in "
            f"{self.dump_dir} within {self.timeout_s:.0f}s, nor any since the worker took the "
            f"dump dir: the readiness marker {READY_FILE} there is not from a live dump hook "
            "(left by an earlier server, or the server dumps to another directory: check "
            "its SGLANG_HS_DUMP_DIR / --dump-dir and its log; docs/sglang.md)"
        )
        return Match(match.rid, None, err)

    def _deliver(
        self, tickets: list[tuple[Ticket | None, Match]], dropped: list[tuple[str, Path, str]]
    ) -> None:
        for why, path, rid in dropped:
            if why == UNREMOVABLE:
                log.error(
                    "dump_unremovable",
                    dump=path.name,
                    detail=rid[:200],
                    hint="remove it by hand; it is skipped from now on",
                )
            else:
                log.warning("dump_discarded", why=why, dump=path.name, rid=rid[:200])
            if self._on_discard is not None:
                self._on_discard(why)
        for ticket, match in tickets:
            if ticket is not None and ticket._set(match):
                continue
            if match.dump is not None:  # abandoned meanwhile: nobody will take it
                remove_dump(match.dump.path)
