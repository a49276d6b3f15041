"""The worker daemon: one per inference server, owning a private dump dir.

Stages (each in its own module):
  claim    (main thread)  chunk jobs from Redis into the ChunkBook (hsq/workers/chunks.py)
  send     (K threads)    read the sample, send it with a fresh rid, get the dump the
                          dispatcher matched to that rid, check its meta (hsq/workers/extract.py)
  persist  (N threads)    validate tensors, write durably, mark done (hsq/workers/persist.py)
  ack      (main thread)  every stage reports Events on one queue; the failure policy
                          (hsq/workers/policy.py) turns an exception into retry, dead letter or
                          hand back; a chunk finishes when all its samples are settled

A worker keeps up to K requests in flight (``--inflight``). Anything that is not the
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

from hsq.errors import ConfigError, HookInactiveError, RunChangedError, StoreError
from hsq.outputs import ManifestEntry
from hsq.runconfig import RunConfig
from hsq.store import HEARTBEAT_TTL_S, ChunkJob, WorkerStore, new_worker_id
from hsq.workers.audit import WorkerAudit
from hsq.workers.chunks import ChunkBook, OpenChunk, WorkItem
from hsq.workers.claims import Claims
from hsq.workers.client import ServerClient
from hsq.workers.dispatch import Dispatcher
from hsq.workers.events import Event, EventKind
from hsq.workers.extract import SendStage
from hsq.workers.metrics import WorkerMetrics
from hsq.workers.persist import Lease, PersistStage
from hsq.workers.policy import (
    STORE_DOWN,
    STORE_DOWN_OR_RUN_CHANGED,
    STORE_TROUBLE,
    Kind,
    Outcome,
    Pause,
    backoff,
    classify,
    decide,
)
from hsq.workers.rate import RateWindow
from hsq.workers.readiness import require_hook
from hsq.workers.runview import RunView
from hsq.workers.settings import WorkerSettings
from hsq.workers.startup import Started, startup, take_dump_dir

log = structlog.get_logger("hsq.worker")


class Worker:
    def __init__(
        self, settings: WorkerSettings, started: Started, client: ServerClient, worker_id: str
    ) -> None:
        self.settings = settings
        self.id = worker_id
        self.name = settings.name or self.id.rsplit(".", 1)[0]
        self.store: WorkerStore[ManifestEntry] = started.store
        self.claims = Claims(self.store, worker_id)
        self.view: RunView = started.view
        self.lock = started.lock
        self.cleared = started.cleared
        self.client = client
        self.metrics = WorkerMetrics(settings.run, self.name, self.view.out_root)
        self._state = "starting"
        self.last_sample: str | None = None
        self.counts = {"done": 0, "retried": 0, "dead": 0, "tokens": 0, "handed_back": 0}
        self.rate = RateWindow(60.0)
        self._stop = threading.Event()
        self.events: queue.Queue[Event] = queue.Queue()
        self.book = ChunkBook()
        self.sending = 0
        self.sending_tokens = 0
        self.persisting = 0
        self.peak_inflight_tokens = 0
        self._pause: Pause | None = None
        self._pauses = 0
        self._fatal: HookInactiveError | None = None
        self._changed: str | None = None
        self._refused: str | None = None
        self._hold_until = 0.0
        self._server_errors = 0
        self.lease = Lease(HEARTBEAT_TTL_S)
        self._claim_after = 0.0
        self.dispatcher = Dispatcher(
            settings.dump_dir,
            started.staging,
            timeout_s=settings.dump_timeout_s,
            on_discard=self.metrics.discarded,
        )
        self.persist = PersistStage(
            self.store,
            settings.run,
            self.id,
            self.metrics,
            self.events,
            depth=settings.persist_depth,
            threads=settings.persist_threads,
            on_done=self.rate.add,
            lease=self.lease,
        )
        self.send = SendStage(
            client, self.dispatcher, self.persist, self.events, self.metrics, settings.inflight
        )
        self.audit = WorkerAudit(
            settings.audit_fraction, self.send, self.store, self.metrics, self.id
        )

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if value != self._state:
            self._state = value
            self.metrics.set_state(value)

    def request_stop(self, *_args: object) -> None:
        if not self._stop.is_set():
            log.info("stop_requested", worker=self.id)
        self._stop.set()

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        # A server without an active dump hook would time every sample out: refuse at once.
        require_hook(self.settings.dump_dir, self.client.healthy, self.view.cfg, self._stop)
        self.dispatcher.start()
        sent = time.monotonic()
        self.store.register(self.id, self._info())
        self.lease.renewed(sent)
        log.info(
            "worker_started",
            worker=self.id,
            run=self.settings.run,
            server=self.settings.server,
            dump_dir=str(self.settings.dump_dir),
            out=str(self.view.out_root),
            inflight=self.settings.inflight,
            max_inflight_tokens=self.settings.max_inflight_tokens,
            burst=self.settings.burst,
            cleared_dumps=self.cleared,
        )
        self.persist.warm(self.view.cfg.store_dtype)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        next_reap = 0.0
        try:
            self._wait_for_server()
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_reap:
                        self._reap()
                        next_reap = time.monotonic() + self.settings.reap_interval_s
                    if self._step():
                        break
                except RunChangedError as exc:
                    self._changed = self._changed or str(exc)
                except STORE_DOWN as exc:
                    self._set_pause(Pause.STORE_DOWN, str(exc))
                except StoreError as exc:  # e.g. an unreadable job: logged, then go on
                    log.error("store_error", error=str(exc))
                    self._stop.wait(1.0)
        finally:
            self.state = "stopping"
            self._settle(stopping=True)
            self._stop.set()
            self.send.close()
            self.persist.close()
            self.dispatcher.stop()
            hb.join(timeout=5)
            self._shutdown_store()
            self.lock.release()
            self.client.close()
            log.info("worker_stopped", worker=self.id, peak_rss_mb=_peak_rss_mb(), **self.counts)
        return 2 if self._refused else 0

    def _step(self) -> bool:
        """One turn of the main loop; True when a --burst worker is finished."""
        self._drain_events()
        if self._changed is not None:
            self._reload_run()
            return False
        broken = self.dispatcher.broken
        if broken is not None and self._pause is None:
            self._set_pause(Pause.DUMP_DIR, broken)  # noticed while idle, or before a send
        if self._pause is not None:
            if self.sending:
                self._wait_event(0.05)
            else:
                self._end_pause()
            return False
        if time.monotonic() < self._hold_until:
            self._wait_event(min(0.05, self._hold_until - time.monotonic()))
            return False
        if self.audit.pending:  # --audit-fraction: alone on the server (hsq/workers/audit.py)
            if self.sending == 0:
                self.audit.run_one()
            else:
                self._wait_event(0.05)
            return False
        if self.sending < self.settings.inflight:
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
                self._claim_after = time.monotonic() + self.settings.claim_timeout_s
        if nxt is not None and self._tokens_allow(nxt):
            item = self.book.next_item()
            assert item is not None
            self._dispatch(item)
            return False
        if nxt is None and self._idle():
            self.state = "idle"
            if self.settings.burst:
                if self._run_finished():
                    return True
                # Another worker still holds jobs (that may come back): wait here.
                self._claim(block=True)
            return False
        if nxt is None:
            # The queue is empty and work is in flight: wait for it to settle.
            self._wait_event(max(0.0, self._claim_after - time.monotonic()))
            return False
        return None

    def _tokens_allow(self, tokens: int) -> bool:
        budget = self.settings.max_inflight_tokens
        if budget is None or self.sending == 0:
            return True  # one sample larger than the budget still goes, alone
        return self.sending_tokens + tokens <= budget

    def _idle(self) -> bool:
        return self.sending == 0 and self.persisting == 0 and not self.book.chunks

    def _claim(self, block: bool) -> bool:
        # With nothing in flight, blocks up to --claim-timeout on an empty queue. With work
        # in flight it does not wait: its events (and, at a burst's end, the exit) would.
        job = self.claims.claim(self.settings.claim_timeout_s if block else 0)
        if job is None:
            return False
        done = self.store.done_among([sid for sid, _ in job.samples])
        chunk = self.book.add(job, done)
        if chunk.complete:
            self._finish(job)
        self.state = "working"
        return True

    def _dispatch(self, item: WorkItem) -> None:
        self.sending += 1
        self.sending_tokens += item.tokens
        self.peak_inflight_tokens = max(self.peak_inflight_tokens, self.sending_tokens)
        self.last_sample = item.sample_id
        self._update_inflight()
        self.send.submit(item, self.view)

    def _update_inflight(self) -> None:
        self.metrics.set_in_flight(self.sending + self.persisting, self.sending_tokens)

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
        item = ev.item
        if ev.kind is EventKind.SENT or ev.from_send:
            self.sending -= 1
            self.sending_tokens -= item.tokens
        if ev.kind is EventKind.SENT:
            self.persisting += 1
        elif not ev.from_send:
            self.persisting -= 1
        self._update_inflight()
        if self._changed is not None:
            return  # the run changed: in-flight work is dropped, nothing is marked
        if ev.kind is EventKind.DONE:
            self.counts["done"] += 1
            self.counts["tokens"] += item.tokens
            self._server_errors = 0
            self._settled(item)
            self.audit.offer(item, self.view)
        elif ev.kind is EventKind.FAILED:
            assert ev.exc is not None
            self._route_failure(item, ev.exc)

    def _settled(self, item: WorkItem, routed: bool = False) -> None:
        chunk = self.book.resolve(item, routed)
        if chunk is not None:
            self.book.pop(chunk.job.job_id)
            self._finish(chunk.job)

    def _finish(self, job: ChunkJob) -> None:
        self.book.pop(job.job_id)
        if not self.claims.finish(job):
            log.warning("chunk_not_ours_anymore", job=job.job_id)

    def _route_failure(self, item: WorkItem, exc: BaseException) -> None:
        sid = item.sample_id
        failure = classify(exc)
        crashes = 0
        if failure.kind is Kind.SERVER_FAIL:
            crashes = self.store.record_crash(sid)
        d = decide(
            failure,
            item.attempt,
            self.view.cfg.max_attempts,
            crashes,
            self.settings.max_server_crashes,
        )
        msg = failure.message
        if d.outcome is Outcome.RUN_CHANGED:
            self._changed = msg
            return
        if d.outcome is Outcome.HAND_BACK:
            assert d.pause is not None
            self.book.hand_back(item)
            log.warning("sample_handed_back", sample=sid, reason=d.reason, error=msg)
            self._set_pause(d.pause, msg)
            return
        self.metrics.failed(d.reason, d.outcome is Outcome.DEAD)
        if d.outcome is Outcome.DEAD:
            self.store.to_dead(sid, d.reason, msg, d.attempts, self.id)
            self.counts["dead"] += 1
            log.error("sample_dead", sample=sid, reason=d.reason, attempts=d.attempts, error=msg)
        else:
            self.store.enqueue([[item.ref]], retry=True, attempt=d.attempts, reason=d.reason)
            self.counts["retried"] += 1
            log.warning("sample_retry", sample=sid, reason=d.reason, attempt=d.attempts, error=msg)
            if d.pause is Pause.SERVER_ERRORS:  # a 5xx: give the server a moment
                self._server_errors += 1
                self._hold_until = time.monotonic() + backoff(
                    self._server_errors, cap=self.settings.backoff_max_s
                )
        self._settled(item, routed=True)

    # ------------------------------------------------------------------ pauses
    def _set_pause(self, pause: Pause, why: str) -> None:
        if pause is Pause.STORE_DOWN:
            log.error("redis_unavailable", error=why)
        if pause is Pause.HOOK_INACTIVE and self._fatal is None:
            self._fatal = HookInactiveError(why)  # raised once in-flight work has settled
        if self._pause is None or pause is Pause.STORE_DOWN:
            if self._pause is None:
                log.warning("pausing", cause=pause.value, error=why)
            self._pause = pause
        self.state = "server_down" if pause is Pause.SERVER_DOWN else "backing_off"

    def _settle(self, *, stopping: bool = False) -> None:
        """Let in-flight work finish and report, then give back every chunk not finished."""
        while self.sending:
            self._wait_event(0.1)
        self.persist.drain()
        try:
            self._drain_events()
            if self._pause is Pause.STORE_DOWN or self._changed is not None:
                self.book.clear()  # released (or gone) as a whole below
                return
            for chunk in self.book.clear():
                if chunk.complete and not chunk.hand_back:
                    self.claims.finish(chunk.job)
                else:
                    self._hand_back(chunk, self._why(stopping))
        except STORE_DOWN_OR_RUN_CHANGED as exc:
            # Our heartbeat or release_wip brings the jobs back; nothing was marked wrongly.
            log.error("settle_failed", error=str(exc))
            self.book.clear()

    def _hand_back(self, chunk: OpenChunk, why: str) -> None:
        job = chunk.job
        if not chunk.routed:
            self.claims.give_back(job)  # untouched, to the front of its queue
        else:
            # Some samples already went to a retry job or the dead letter: queue the rest
            # as a new job, so none of them is done twice or both dead and done.
            rest = [ref for ref in job.samples if ref[0] not in chunk.routed]
            if rest:
                self.store.enqueue([rest], attempt=job.attempt, reason=job.reason)
            self.claims.finish(job)
        self.metrics.handed_back(len(job.samples) - len(chunk.routed))
        self.counts["handed_back"] += 1
        log.info("job_handed_back", job=job.job_id, why=why, routed=len(chunk.routed))

    def _why(self, stopping: bool) -> str:
        if stopping:
            return "stopping"
        return self._pause.value if self._pause is not None else "unknown"

    def _end_pause(self) -> None:
        pause = self._pause
        assert pause is not None
        self._settle()
        if self._fatal is not None:
            raise self._fatal  # every chunk was handed back: exit 2, nothing touched
        self._pauses += 1
        if pause is Pause.DUMP_DIR:
            self._retake_dump_dir()
        elif pause is Pause.SERVER_DOWN:
            self._wait_for_server()
        elif pause is Pause.STORE_DOWN:
            self._release_when_store_back()
        else:
            delay = backoff(self._pauses, base=1.0, cap=self.settings.backoff_max_s)
            log.error("paused_backing_off", cause=pause.value, retry_in_s=delay)
            self._stop.wait(delay)
        self._pause = None
        if self.state != "server_down":
            self.state = "working"

    def _retake_dump_dir(self) -> None:
        """The dump dir was removed, re-created or swapped under us: every chunk was handed
        back; take the directory at that path again with the start-up checks (create it if
        missing) and go on. A path that fails those checks now stops the worker (exit 2)."""
        why = self.dispatcher.broken
        self.lock.release()
        self.lock, staging, cleared = take_dump_dir(self.settings, self.id)
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
                self._stop.wait(backoff(n, cap=self.settings.backoff_max_s))

    def _wait_for_server(self) -> None:
        delay = 0.25
        was_down = False
        while not self._stop.is_set() and not self.client.healthy():
            was_down = True
            self.state = "server_down"
            self.metrics.set_server_up(False)
            log.warning(
                "waiting_for_server", server=self.settings.server, retry_in_s=round(delay, 2)
            )
            self._stop.wait(delay)
            delay = min(delay * 2, self.settings.backoff_max_s)
        if self._stop.is_set():
            return
        if was_down:
            # A restarted server starts its counter again and may have left partial dumps.
            n = self.dispatcher.clear()
            log.info("server_back", cleared_dumps=n)
        self.state = "working"
        self.metrics.set_server_up(True)

    # ------------------------------------------------------------------ run changes
    def _reload_run(self) -> None:
        """The run was purged or re-created: stop, drop in-flight work, re-read it."""
        reason = self._changed
        log.error(
            "run_changed", run=self.settings.run, reason=reason, dropping_in_flight=self.sending
        )
        self.state = "backing_off"
        self._settle()
        self.audit.clear()  # audits of the old run's files: nothing to compare any more
        n = 0
        while not self._stop.is_set():
            try:
                cfg = self.store.require_config()
                break
            except ConfigError as exc:
                n += 1
                log.error("run_gone_waiting", run=self.settings.run, error=str(exc), attempt=n)
            except STORE_DOWN_OR_RUN_CHANGED as exc:
                n += 1
                log.error("run_reload_failed", run=self.settings.run, error=str(exc), attempt=n)
            self._stop.wait(backoff(n, base=1.0, cap=self.settings.backoff_max_s))
        else:
            return
        if tampered := config_tampered(self.view.cfg, cfg):
            self._refuse(tampered)
            return
        self.view = RunView.of(cfg, self.settings.run)
        self.view.out_root.mkdir(parents=True, exist_ok=True)
        self.metrics.out_dir = self.view.out_root
        self._changed = None
        self.state = "working"
        log.warning("run_config_reloaded", run=self.settings.run, out=str(self.view.out_root))

    # ------------------------------------------------------------------ Redis chores
    def _run_finished(self) -> bool:
        return self.store.nothing_outstanding()

    def _info(self) -> dict[str, Any]:
        samples_s, tokens_s = self.rate.rates()
        discarded = self.dispatcher.discarded
        return {
            "samples_per_s": round(samples_s, 3),
            "tokens_per_s": round(tokens_s, 1),
            "name": self.name,
            "server": self.settings.server,
            "state": self.state,
            "last_sample": self.last_sample or "",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ts": time.time(),
            "inflight": self.settings.inflight,
            "in_flight_now": self.sending + self.persisting,
            "peak_inflight_tokens": self.peak_inflight_tokens,
            "rss_mb": _peak_rss_mb(),
            "dumps_discarded": sum(discarded.values()),
            "dumps_discarded_by_why": discarded,
            **self.counts,
            **self.audit.counts,
        }

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                sent = time.monotonic()
                self.store.heartbeat(self.id, self._info())
                self.lease.renewed(sent)
            except STORE_TROUBLE as exc:
                log.warning("heartbeat_failed", error=str(exc))

    def _reap(self) -> None:
        for wid, n in self.store.reap().items():
            log.warning("recovered_dead_worker_jobs", dead_worker=wid, jobs=n)
        self._check_run()

    def _check_run(self) -> None:
        """An idle worker writes nothing, so no fenced write tells it the run is gone
        (FLUSHALL, purge) or was re-created: look now and then."""
        try:
            cfg = self.store.load_config()
        except (TypeError, ValueError) as exc:  # a hash holding only pins, or garbage
            self._changed = self._changed or f"the run's config is unreadable: {exc}"
            return
        old = self.view.cfg
        if cfg is None:
            self._changed = self._changed or "the run's config is gone from Redis"
        elif tampered := config_tampered(old, cfg):
            self._refuse(tampered)
        elif (cfg.created, cfg.out, cfg.dataset) != (old.created, old.out, old.dataset):
            self._changed = self._changed or "the run's config was re-created"

    def _refuse(self, why: str) -> None:
        """Stop without writing anything more: the run's config changed where only a new
        run (a new generation) may change it. Exit code 2; in-flight work is handed back."""
        if self._refused is None:
            log.error("run_config_changed_refused", run=self.settings.run, why=why)
            self._refused = why
        self.request_stop()

    def _shutdown_store(self) -> None:
        try:
            n = self.claims.release_all()  # normally 0: chunks were finished or handed back
            if n:
                log.warning("released_jobs_at_exit", jobs=n)
            self.store.unregister(self.id)
        except STORE_TROUBLE as exc:
            # Our heartbeat expires and another worker's reaper takes our jobs back.
            log.error("unregister_failed", error=str(exc))


def config_tampered(old: RunConfig, new: RunConfig) -> str | None:
    """Why `new` cannot be the same run as `old`: its output dir, dataset or creation time
    changed but its generation did not. Only a re-created run (a new generation: purge and
    enqueue) may change them; anything else is someone rewriting the config under running
    workers (issue 23 item 19: a worker then wrote to the writer's path)."""
    if old.generation is None or new.generation != old.generation:
        return None  # a re-created run; None: no generation to judge by (never from RunStore)
    changed = [
        f"{name} {getattr(old, name)!r} -> {getattr(new, name)!r}"
        for name in ("out", "dataset", "created")
        if getattr(old, name) != getattr(new, name)
    ]
    if not changed:
        return None
    return (
        "the run's config changed without a new generation (" + "; ".join(changed) + "): "
        "refusing to write anywhere else; re-create the run (hsq purge, hsq enqueue) to move it"
    )


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_worker(settings: WorkerSettings) -> int:
    worker_id = new_worker_id(settings.name)
    started = startup(settings, worker_id)
    client = ServerClient(settings.server, request_timeout=settings.request_timeout_s)
    worker = Worker(settings, started, client, worker_id)
    if settings.metrics_port is not None:
        worker.metrics.serve(settings.metrics_port, settings.metrics_host)
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    return worker.run()
