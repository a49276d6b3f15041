"""The worker daemon: one per inference server, owning a private dump dir.

Stages (each in its own module):
  claim    (main thread)  chunk jobs from Redis into the ChunkBook (hsq/workers/chunks.py)
  send     (2K threads)   read the sample, send it with a fresh rid, get the dump the
                          dispatcher matched to that rid, check its meta
                          (hsq/workers/send/extract.py)
  persist  (N threads)    validate tensors, write durably, mark done (hsq/workers/persist/stage.py);
                          with --persist-procs N the CPU work runs in N child processes
                          (persist_procs.py), the rename's decision and the marks stay here
  ack      (main thread)  every stage reports Events on one queue; the failure policy
                          (hsq/workers/policy.py) turns an exception into retry, dead letter or
                          hand back; a chunk finishes when all its samples are settled

This module is the main thread's loop: claim, send, take the stages' events. What it does
with them lives with its collaborators: in-flight accounting (inflight.py), outcome
application (outcomes.py), pauses (pauses.py), run watching (runwatch.py), the record in
Redis (heartbeat.py) and --audit-fraction (audit_fraction.py); they announce what they did
as Notices that metrics and the tally of counts listen to (notices.py).

A worker keeps up to K requests at the server (``--inflight``) and up to K answered ones
waiting for their dumps (inflight.py). Anything that is not the
sample's fault (server down, dataset unreadable, disk full, Redis unreachable) pauses the
worker: it stops sending, lets in-flight work settle, hands the unsettled chunks back
untouched and waits or backs off. A run that was purged or re-created drops in-flight work
without marking anything and is re-read.
"""

from __future__ import annotations

import os
import queue
import resource
import signal
import socket
import threading
import time
from typing import Any

import structlog

from hsq.errors import RunChangedError, StoreError
from hsq.outputs.manifest import ManifestEntry
from hsq.store import HEARTBEAT_TTL_S, WorkerStore, new_worker_id
from hsq.workers.audit_fraction import WorkerAudit
from hsq.workers.chunks import ChunkBook, WorkItem
from hsq.workers.claims import Claims
from hsq.workers.events import Event, EventKind
from hsq.workers.heartbeat import Heartbeat
from hsq.workers.inflight import InFlight
from hsq.workers.metrics import WorkerMetrics
from hsq.workers.notices import Notices, OutputDirMoved, StateChanged, Tally
from hsq.workers.outcomes import Outcomes
from hsq.workers.pauses import Pauses
from hsq.workers.persist.procs import default_procs
from hsq.workers.persist.stage import Lease, PersistStage
from hsq.workers.policy import STORE_DOWN, STORE_DOWN_OR_RUN_CHANGED, Pause
from hsq.workers.rate import RateWindow
from hsq.workers.readiness import check_engine, require_hook
from hsq.workers.runview import RunView
from hsq.workers.runwatch import RunWatch
from hsq.workers.send.client import ServerClient, make_client
from hsq.workers.send.dispatch import Dispatcher
from hsq.workers.send.extract import SendStage
from hsq.workers.settings import WorkerSettings
from hsq.workers.spool import SpoolGate
from hsq.workers.startup import HeldDumpDir, Started, startup
from hsq.workers.state import StateCell, WorkerState

log = structlog.get_logger("hsq.worker")


class Worker:
    def __init__(
        self, settings: WorkerSettings, started: Started, client: ServerClient, worker_id: str
    ) -> None:
        s = self.settings = settings
        t = s.tuning
        self.id = worker_id
        self.name = s.name or self.id.rsplit(".", 1)[0]
        self.store: WorkerStore[ManifestEntry] = started.store
        self.claims = Claims(self.store, worker_id)
        self.view: RunView = started.view
        self.cleared = started.cleared
        self.client = client
        self.metrics = WorkerMetrics(s.run, self.name, self.view.out_root)
        self.tally = Tally()
        self.notices = Notices(self.metrics.on_notice, self.tally)
        self.state = StateCell(self._state_changed)
        self.rate = RateWindow(60.0)
        self._stop = threading.Event()
        self.events: queue.Queue[Event] = queue.Queue()
        self.book = ChunkBook()
        self.inflight = InFlight(t.inflight, t.max_inflight_tokens, self.notices)
        self.last_sample: str | None = None
        self._claim_after = 0.0
        self.dump_dir = HeldDumpDir(s, worker_id, started.lock)
        self.dispatcher = Dispatcher(
            s.dump_dir,
            started.staging,
            timeout_s=t.exchange.dump_timeout_s,
            on_discard=self.metrics.discarded,
        )
        lease = Lease(HEARTBEAT_TTL_S)
        self.persist = PersistStage(
            self.store,
            s.run,
            self.id,
            self.metrics,
            self.events,
            depth=t.persist_depth,
            threads=t.persist_threads,
            on_done=self.rate.add,
            lease=lease,
            direct_io=t.direct_io,
            procs=default_procs() if t.persist_procs is None else t.persist_procs,
        )
        self.send = SendStage(
            client, self.dispatcher, self.persist, self.events, self.metrics, t.inflight
        )
        self.audit = WorkerAudit(t.audit_fraction, self.send, self.store, self.notices, self.id)
        self.heartbeat = Heartbeat(
            self.store, self.claims, self.id, t.heartbeat_interval_s, self._info, lease, self._stop
        )
        self.watch = RunWatch(s.run, self.store, self._stop, self.request_stop, t.backoff_max_s)
        self.pauses = Pauses(
            s,
            self.claims,
            client.healthy,
            self.dispatcher,
            self.dump_dir,
            self._stop,
            self.state,
            self.notices,
            lambda: self.tally.counts["done"],
        )
        self.spool = SpoolGate(self.store, self.pauses)
        self.outcomes = Outcomes(
            self.store,
            self.claims,
            self.book,
            self.id,
            t.max_server_crashes,
            self.pauses,
            self.watch,
            self.notices,
        )

    def request_stop(self, *_args: object) -> None:
        """Stop at the next turn (SIGTERM, SIGINT, a changed run). It only sets the flag:
        as a signal handler it must not log, since a log write can fail (a pipe whose
        reader died) or block on the log's lock, which the interrupted main thread may hold;
        the main loop logs the stop (`stop_requested`) once it sees the flag."""
        self._stop.set()

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        # The record first: `hsq status` and `hsq run`'s view say `starting` (server
        # starting since T) while the server loads, not nothing.
        self.pauses.note_server_silent()
        self.heartbeat.start()
        try:
            # A server without an active dump hook would time every sample out: refuse now.
            marker = require_hook(
                self.settings.dump_dir, self.client.healthy, self.view.cfg, self._stop
            )
            if marker is not None:
                check_engine(marker, self.settings.api.engine)
        except BaseException:
            self._stop.set()
            self.heartbeat.end()  # no record of a worker that never started
            raise
        self.dispatcher.start()
        log.info(
            "worker_started",
            worker=self.id,
            run=self.settings.run,
            server=self.settings.server,
            dump_dir=str(self.settings.dump_dir),
            out=str(self.view.out_root),
            inflight=self.settings.tuning.inflight,
            max_inflight_tokens=self.settings.tuning.max_inflight_tokens,
            burst=self.settings.burst,
            cleared_dumps=self.cleared,
        )
        self.persist.warm(self.view.cfg.store_dtype)
        next_reap = 0.0
        try:
            self.pauses.wait_for_server()
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_reap:
                        self._reap()
                        next_reap = time.monotonic() + self.settings.tuning.reap_interval_s
                    if self._step():
                        break
                except RunChangedError as exc:
                    self.watch.note_changed(str(exc))
                except STORE_DOWN as exc:
                    self.pauses.pause(Pause.STORE_DOWN, str(exc))
                except StoreError as exc:  # e.g. an unreadable job: logged, then go on
                    log.error("store_error", error=str(exc))
                    self._stop.wait(1.0)
        finally:
            if self._stop.is_set():
                log.info("stop_requested", worker=self.id)
            self.state.set(WorkerState.STOPPING)
            self._settle(stopping=True)
            self._stop.set()
            self.send.close()
            self.persist.close()
            self.dispatcher.stop()
            self.heartbeat.end()
            self.dump_dir.release()
            self.client.close()
            counts = self.tally.counts
            log.info(
                "worker_stopped",
                worker=self.id,
                peak_rss_mb=_peak_rss_mb(),
                cpu_s=_own_cpu_s(),
                **counts,
            )
        return 2 if self.watch.refused else 0

    def _step(self) -> bool:
        """One turn of the main loop; True when a --burst worker is finished."""
        self._drain_events()
        if self.watch.changed is not None:
            self._reload_run()
            return False
        failed, broken = self.dispatcher.failed, self.dispatcher.broken
        if failed is not None and self.pauses.fatal is None:
            self.pauses.pause(Pause.INTERNAL_ERROR, failed)  # noticed while idle
        elif broken is not None and self.pauses.current is None:
            self.pauses.pause(Pause.DUMP_DIR, broken)  # noticed while idle, or before a send
        if self.pauses.current is not None:
            if self.inflight.sending:
                self._wait_event(0.05)
            else:
                self._settle()
                self.pauses.recover()
            return False
        if (held := self.pauses.held_for()) > 0:
            self._wait_event(min(0.05, held))
            return False
        if self.audit.pending:  # --audit-fraction: alone on the server (audit_fraction.py)
            if self.inflight.sending == 0:
                self.audit.run_one()
            else:
                self._wait_event(0.05)
            return False
        if self.inflight.room():
            done = self._fill()
            if done is not None:
                return done
        self._wait_event(0.05)
        return False

    def _fill(self) -> bool | None:
        """Claim and send while there is room in flight; a bool ends this turn of _step
        (True: a --burst worker is finished), None lets it wait for an event."""
        nxt = self.book.peek_tokens()
        idle = self._idle()
        if nxt is None and (idle or time.monotonic() >= self._claim_after):
            if self._claim(block=idle and not self.settings.burst):
                nxt = self.book.peek_tokens()
            else:  # an empty queue: with work in flight, look again in a while
                self._claim_after = time.monotonic() + self.settings.tuning.claim_timeout_s
        if nxt is not None and self.inflight.allows(nxt):
            if (held := self.spool.held_for()) > 0:  # a full spool: ask again in a while
                self._wait_event(held)
                return False
            item = self.book.next_item()
            assert item is not None
            if not self._admit(item):
                return False
            self._dispatch(item)
            return False
        if nxt is None and self._idle():
            self.state.set(WorkerState.IDLE)
            if self.settings.burst:
                # A streamed run: stay (and keep the server) until every output is committed,
                # so a file that fails its checks when read is extracted again.
                if self.store.nothing_outstanding() and self.store.spool_settled():
                    return True
                # Another worker still holds jobs (that may come back): wait here.
                self._claim(block=True)
            return False
        if nxt is None:
            # The queue is empty and work is in flight: wait for it to settle.
            self._wait_event(max(0.0, self._claim_after - time.monotonic()))
            return False
        return None

    def _idle(self) -> bool:
        return self.inflight.total == 0 and not self.book.chunks

    def _claim(self, block: bool) -> bool:
        # With nothing in flight, blocks up to --claim-timeout on an empty queue. With work
        # in flight it does not wait: its events (and, at a burst's end, the exit) would.
        job = self.claims.claim(self.settings.tuning.claim_timeout_s if block else 0)
        if job is None:
            return False
        done = self.store.done_among([sid for sid, _ in job.samples])
        chunk = self.book.add(job, done)
        if chunk.complete:
            self.outcomes.finish(job)
        self.state.set(WorkerState.WORKING)
        return True

    def _admit(self, item: WorkItem) -> bool:
        """A streamed run's byte reservation (hsq/workers/spool.py); not sent: it goes back
        first in its chunk."""
        try:
            admitted = self.spool.admit(item, self.view)
        except BaseException:
            self.book.put_back(item)
            raise
        if not admitted:
            self.book.put_back(item)
        return admitted

    def _dispatch(self, item: WorkItem) -> None:
        self.inflight.dispatched(item)
        self.last_sample = item.sample_id
        self.send.submit(item, self.view)

    # ------------------------------------------------------------------ ack stage
    def _wait_event(self, timeout: float) -> None:
        try:
            ev = self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return
        self._on_event(ev)
        self._drain_events()

    def _drain_events(self) -> None:
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            self._on_event(ev)

    def _on_event(self, ev: Event) -> None:
        self.inflight.account(ev)
        if self.watch.changed is not None:
            return  # the run changed: in-flight work is dropped, nothing is marked
        if ev.kind is EventKind.DONE:
            self.outcomes.done(ev.item)
            self.audit.offer(ev.item, self.view)
        elif ev.kind is EventKind.FAILED:
            assert ev.exc is not None
            self.outcomes.failed(ev.item, ev.exc, self.view.cfg.max_attempts)

    def _settle(self, *, stopping: bool = False) -> None:
        """Let in-flight work finish and report, then give back every chunk not finished."""
        while self.inflight.sending:
            self._wait_event(0.1)
        self.persist.drain()
        try:
            self._drain_events()
            drop = self.pauses.current is Pause.STORE_DOWN or self.watch.changed is not None
            self.outcomes.close_chunks("stopping" if stopping else self.pauses.why(), drop=drop)
        except STORE_DOWN_OR_RUN_CHANGED as exc:
            # Our heartbeat or release_wip brings the jobs back; nothing was marked wrongly.
            log.error("settle_failed", error=str(exc))
            self.book.clear()

    # ------------------------------------------------------------------ run changes
    def _reap(self) -> None:
        for wid, n in self.store.reap().items():
            log.warning("recovered_dead_worker_jobs", dead_worker=wid, jobs=n)
        self.watch.check(self.view.cfg)

    def _reload_run(self) -> None:
        """The run was purged or re-created: stop, drop in-flight work, re-read it."""
        log.error(
            "run_changed",
            run=self.settings.run,
            reason=self.watch.changed,
            dropping_in_flight=self.inflight.sending,
        )
        self.state.set(WorkerState.BACKING_OFF)
        self._settle()
        self.audit.clear()  # audits of the old run's files: nothing to compare any more
        view = self.watch.reload(self.view)
        if view is None:
            return  # stopping, or refused
        self.view = view
        self.notices.emit(OutputDirMoved(view.out_root))
        self.state.set(WorkerState.WORKING)

    def _state_changed(self, state: WorkerState) -> None:
        self.notices.emit(StateChanged(state))
        self.heartbeat.poke()  # `hsq status` and `hsq run`'s view see it now

    def _info(self) -> dict[str, Any]:
        """The worker's record in Redis (`hsq status`): its keys are stable."""
        samples_s, tokens_s = self.rate.rates()
        discarded = self.dispatcher.discarded
        return {
            "samples_per_s": round(samples_s, 3),
            "tokens_per_s": round(tokens_s, 1),
            "name": self.name,
            "server": self.settings.server,
            "state": self.state.current.value,
            "last_sample": self.last_sample or "",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ts": time.time(),
            "inflight": self.settings.tuning.inflight,
            "in_flight_now": self.inflight.total,
            "peak_inflight_tokens": self.inflight.peak_tokens,
            "rss_mb": _peak_rss_mb(),
            "dumps_discarded": sum(discarded.values()),
            "dumps_discarded_by_why": discarded,
            "heartbeat_interval_s": self.settings.tuning.heartbeat_interval_s,
            "spool_paused_s": round(self.spool.paused_total(), 1),
            **self.pauses.cause(),
            **self.tally.counts,
            **self.audit.counts,
        }


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _own_cpu_s() -> float:
    """CPU seconds of the worker's own interpreter (its persist processes not included):
    what --persist-procs leaves on the one process."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return round(ru.ru_utime + ru.ru_stime, 3)


def run_worker(settings: WorkerSettings) -> int:
    worker_id = new_worker_id(settings.name)
    started = startup(settings, worker_id)
    client = make_client(
        settings.api.engine,
        settings.server,
        request_timeout=settings.tuning.exchange.request_timeout_s,
        model=settings.api.served_model,
    )
    worker = Worker(settings, started, client, worker_id)
    if settings.metrics_port is not None:
        worker.metrics.serve(settings.metrics_port, settings.tuning.metrics_host)
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    return worker.run()
