"""Pauses: the worker stops sending for a while because of something outside the sample.

The failure policy (hsq/workers/policy.py) names the cause (:class:`Pause`); the main loop
lets in-flight work settle and hands the unfinished chunks back, then :meth:`Pauses.recover`
does what the cause asks: wait for the server, take the dump dir again, release the jobs
once Redis is back, or back off. Two causes stop the worker instead, once its work is
back: a dump hook that is not live (HookInactiveError, exit 2) and a bug in the worker
outside any one sample (InternalError, exit 1). A 5xx answer does not pause: it holds the
next send back for a growing while (:meth:`Pauses.server_error`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from hsq.errors import HookInactiveError, HsqError, InternalError
from hsq.workers.claims import Claims
from hsq.workers.notices import Notices, ServerHealth
from hsq.workers.policy import STORE_DOWN, Pause, backoff
from hsq.workers.send.dispatch import Dispatcher
from hsq.workers.settings import WorkerSettings
from hsq.workers.startup import HeldDumpDir
from hsq.workers.state import StateCell, WorkerState

log = structlog.get_logger("hsq.worker")

# Causes that stop the worker once its work is handed back, and what it raises.
FATAL: dict[Pause, type[HsqError]] = {
    Pause.HOOK_INACTIVE: HookInactiveError,
    Pause.INTERNAL_ERROR: InternalError,
}


NO_CAUSE: dict[str, object] = {"cause": "", "cause_message": "", "cause_since": ""}


class Pauses:
    def __init__(
        self,
        settings: WorkerSettings,
        claims: Claims,
        healthy: Callable[[], bool],
        dispatcher: Dispatcher,
        dump_dir: HeldDumpDir,
        stop: threading.Event,
        state: StateCell,
        notices: Notices,
        done: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.claims = claims
        self.healthy = healthy
        self.dispatcher = dispatcher
        self.dump_dir = dump_dir
        self._stop = stop
        self._state = state
        self._notices = notices
        self._done = done
        self.current: Pause | None = None
        self.fatal: HsqError | None = None
        """Raised by :meth:`recover` once in-flight work has settled."""
        self._count = 0
        self._hold_until = 0.0
        self._server_errors = 0
        self.answered = False
        """The server answered /health once: from then on silence is `server_down`."""
        self._cause: tuple[Pause, str, float, int] | None = None
        """The last cause (pause, message, since, samples done then), until a sample is done
        after it: the worker's record shows it (`hsq status`), across the short stretches
        of WORKING between two tries that meet the same full disk or dead server."""

    def note(self, pause: Pause, why: str) -> None:
        """Record the cause (kept with its first time while the same one repeats)."""
        old, done = self._cause, self._done()
        again = old is not None and old[0] is pause and done <= old[3]  # no sample since
        self._cause = (pause, why[:500], old[2] if again and old else time.time(), done)

    def note_server_silent(self) -> None:
        """The server does not answer: `server_starting` until it answered once, then
        `server_down` (shown as "server unreachable since T")."""
        server = self.settings.server
        if self.answered:
            self.note(Pause.SERVER_DOWN, f"{server} does not answer /health")
        else:
            self.note(Pause.SERVER_STARTING, f"{server} has not answered yet")

    def cause(self) -> dict[str, object]:
        """The worker record's fields for the cause, empty when there is none (no cause, or
        a sample was done after it): every renewal writes all three, since the record is
        updated field by field and a field left out would keep a cause that has passed
        ("server unreachable" long after the server came back). Read by the heartbeat
        thread; the tuple is swapped whole."""
        c = self._cause
        if c is None:
            return dict(NO_CAUSE)
        pause, why, since, seen = c
        if self.current is None and self._done() > seen:
            return dict(NO_CAUSE)
        return {"cause": pause.value, "cause_message": why, "cause_since": round(since, 1)}

    def pause(self, pause: Pause, why: str) -> None:
        self.note(pause, why)
        if pause is Pause.STORE_DOWN:
            log.error("redis_unavailable", error=why)
        if pause in FATAL and self.fatal is None:
            self.fatal = FATAL[pause](why)
        if self.current is None or pause is Pause.STORE_DOWN:
            if self.current is None:
                log.warning("pausing", cause=pause.value, error=why)
            self.current = pause
        self._state.set(
            WorkerState.SERVER_DOWN if pause is Pause.SERVER_DOWN else WorkerState.BACKING_OFF
        )

    def why(self) -> str:
        return self.current.value if self.current is not None else "unknown"

    # -------------------------------------------------------------- 5xx answers
    def server_error(self) -> None:
        """A 5xx answer: give the server a moment (longer after each in a row)."""
        self._server_errors += 1
        self._hold_until = time.monotonic() + backoff(
            self._server_errors, cap=self.settings.tuning.backoff_max_s
        )

    def server_ok(self) -> None:
        self._server_errors = 0

    def held_for(self) -> float:
        """Seconds before the next send may go (0: now)."""
        return max(0.0, self._hold_until - time.monotonic())

    # -------------------------------------------------------------- recovery
    def recover(self) -> None:
        """In-flight work has settled and unfinished chunks are back: deal with the cause."""
        pause = self.current
        assert pause is not None
        if self.fatal is not None:
            if isinstance(self.fatal, InternalError):
                log.critical(
                    "internal_error_stopping", worker=self.claims.worker_id, error=str(self.fatal)
                )
            raise self.fatal  # every chunk was handed back: nothing was charged to a sample
        self._count += 1
        if pause is Pause.DUMP_DIR:
            self._retake_dump_dir()
        elif pause is Pause.SERVER_DOWN:
            self.wait_for_server()
        elif pause is Pause.STORE_DOWN:
            self._release_when_store_back()
        else:
            delay = backoff(self._count, base=1.0, cap=self.settings.tuning.backoff_max_s)
            log.error("paused_backing_off", cause=pause.value, retry_in_s=delay)
            self._stop.wait(delay)
        self.current = None
        if self._state.current is not WorkerState.SERVER_DOWN:
            self._state.set(WorkerState.WORKING)

    def wait_for_server(self) -> None:
        delay = 0.25
        was_down = False
        while not self._stop.is_set() and not self.healthy():
            if not was_down:
                self.note_server_silent()
            was_down = True
            self._state.set(WorkerState.SERVER_DOWN if self.answered else WorkerState.STARTING)
            self._notices.emit(ServerHealth(False))
            log.warning(
                "waiting_for_server", server=self.settings.server, retry_in_s=round(delay, 2)
            )
            self._stop.wait(delay)
            delay = min(delay * 2, self.settings.tuning.backoff_max_s)
        if self._stop.is_set():
            return
        if was_down and self.answered:
            # A restarted server starts its counter again and may have left partial dumps.
            n = self.dispatcher.clear()
            log.info("server_back", cleared_dumps=n)
        self.answered = True
        c = self._cause  # the server answers: its silence is no longer why the worker waits
        if c is not None and c[0] in (Pause.SERVER_DOWN, Pause.SERVER_STARTING):
            self._cause = None
        self._state.set(WorkerState.WORKING)
        self._notices.emit(ServerHealth(True))

    def _retake_dump_dir(self) -> None:
        """The dump dir was removed, re-created or swapped under us: every chunk was handed
        back; take the directory at that path again with the start-up checks (create it if
        missing) and go on. A path that fails those checks now stops the worker (exit 2)."""
        why = self.dispatcher.broken
        staging, cleared = self.dump_dir.retake()
        self.dispatcher.retake(staging)
        log.warning(
            "dump_dir_taken_again",
            dump_dir=str(self.settings.dump_dir),
            cleared_dumps=cleared,
            was=why,
        )

    def _release_when_store_back(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                released = self.claims.release_all()
                log.info("released_jobs_after_redis_error", jobs=released)
                return
            except STORE_DOWN as exc:
                n += 1
                log.error("redis_unavailable", error=str(exc))
                self._stop.wait(backoff(n, cap=self.settings.tuning.backoff_max_s))
