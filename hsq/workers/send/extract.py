"""The send/match stage: read a sample, send it with a fresh rid, get its dump by rid.

Runs on a pool of 2K threads (``--inflight`` K): up to K requests at the server and up to
K answered ones waiting for their dumps (hsq/workers/inflight.py); the dispatcher matches
their dumps. A validated dump is handed to the persist
stage, whose bounded queue blocks this thread when it is full: backpressure reaches the
server instead of memory growing.

A request that fails on a reused keep-alive connection before any answer byte came
(StaleConnection: the server closed the idle connection as the request went out) is sent
again once, on a fresh connection, under a new rid, and charged to nothing. The first try
may still have reached the server and may still cause a dump, so its rid is given up
(the dispatcher discards that dump as late): dumps are attributed by their rid alone
(hsq/workers/send/ridmatch.py) and checked against it (check_meta), and the new rid is
one the dispatcher never saw (it refuses a rid used before), so the first try's dump can
never pass for the second's. If the server cannot be reached at all for the second try,
the first failure stands as what it looked like: a mid-request failure (a sample that
crashes its server is counted, whichever connection it went out on).
"""

from __future__ import annotations

import functools
import queue
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from hsq.dataset.read import read_sample
from hsq.dump.find import remove_dump
from hsq.dump.read import check_meta
from hsq.errors import CachedTokensError, WrongLengthError
from hsq.workers.chunks import WorkItem
from hsq.workers.events import Event, EventKind
from hsq.workers.metrics import WorkerMetrics
from hsq.workers.persist.stage import PersistStage, StagedSample
from hsq.workers.runview import RunView
from hsq.workers.send.client import MidRequestFailure, PrefillAnswer, ServerClient
from hsq.workers.send.dispatch import Dispatcher
from hsq.workers.send.http import ConnectFailure, StaleConnection

log = structlog.get_logger("hsq.worker")


def new_rid(sid: str, attempt: int, *, not_: str | None = None) -> str:
    """A fresh rid for one request of sample ``sid`` (never ``not_``)."""
    while True:
        rid = f"hsq-{sid}-a{attempt}-{secrets.token_hex(4)}"
        if rid != not_:
            return rid


@dataclass(eq=False)
class SendStage:
    client: ServerClient
    dispatcher: Dispatcher
    persist: PersistStage
    events: queue.Queue[Event]
    metrics: WorkerMetrics
    inflight: int

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(2 * max(1, self.inflight), thread_name_prefix="send")

    def submit(self, item: WorkItem, view: RunView) -> None:
        self._pool.submit(self._run, item, view)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self, item: WorkItem, view: RunView) -> None:
        answered = False

        def on_answer() -> None:
            nonlocal answered
            answered = True
            self.events.put(Event(item, EventKind.ANSWERED))  # the server's slot is free

        try:
            staged = self.extract(item, view, on_answer)
        except Exception as exc:  # every failure is classified by the ack stage
            self.events.put(Event(item, EventKind.FAILED, exc, from_send=True, answered=answered))
            return
        self.persist.submit(staged)  # blocks while the persist stage is full
        self.events.put(Event(item, EventKind.SENT))

    def extract(
        self, item: WorkItem, view: RunView, on_answer: Callable[[], None] | None = None
    ) -> StagedSample:
        sid, entry = item.ref
        sample = read_sample(view.dataset, sid, entry)
        n = len(sample.input_ids)
        rid = new_rid(sid, item.attempt)
        t0 = time.perf_counter()
        ticket = self.dispatcher.register(rid, n)
        try:
            try:
                answer = self.client.prefill(sample.input_ids, rid)
            except StaleConnection as stale:
                self.dispatcher.abandon(ticket)  # a dump the first try still causes is late
                first, rid = rid, new_rid(sid, item.attempt, not_=rid)
                ticket = self.dispatcher.register(rid, n)
                log.info("request_sent_again", sample=sid, rid=first, new_rid=rid, why=str(stale))
                answer = self._again(sample.input_ids, rid, stale)
            self.dispatcher.answered(rid)
            t1 = time.perf_counter()
            if on_answer is not None:
                on_answer()
            if answer.prompt_tokens != n:
                raise WrongLengthError(
                    f"server counted {answer.prompt_tokens} prompt tokens, sent {n}"
                )
            if answer.cached_tokens != 0:
                raise CachedTokensError(
                    f"server reused {answer.cached_tokens} cached tokens; disable the radix cache"
                )
            found = self.dispatcher.wait(ticket, self.client.healthy)
        except BaseException:
            self.dispatcher.abandon(ticket)
            raise
        t2 = time.perf_counter()
        try:
            check_meta(found.meta, view.expected(rid, sample))
        except BaseException:
            self.dispatcher.release(rid)
            remove_dump(found.path)
            raise
        self.metrics.observe("request", t1 - t0)
        self.metrics.observe("wait_done", t2 - t1)
        timings = {"request_ms": (t1 - t0) * 1e3, "wait_ms": (t2 - t1) * 1e3, "stage_ms": 0.0}
        return StagedSample(
            item,
            sample,
            found.path,
            found.meta,
            view,
            timings,
            confirm_single=functools.partial(self.dispatcher.confirm_single, rid),
        )

    def _again(self, input_ids: list[int], rid: str, stale: StaleConnection) -> PrefillAnswer:
        """The second and last try after ``stale``, on a fresh connection."""
        try:
            return self.client.prefill(input_ids, rid, fresh=True)
        except ConnectFailure as exc:  # the server is gone: the first try looked like it
            raise MidRequestFailure(f"{stale}; then {exc}") from exc
