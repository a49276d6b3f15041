"""The worker daemon: one per inference server, owning a private dump dir.

Per sample: skip if done; clear the dump dir; send the prefill request; wait for the one
dump that appears; check it against what was sent; move it to staging (the dump dir is
clear again) and hand it to the persist stage, which validates the tensors, writes the
output durably and only then marks the sample done in Redis.

Failures: a bad dump or a 5xx goes to the retry queue with its attempt count, then to the
dead letter; a bad dataset line or a 4xx goes straight to the dead letter. A server that is
down is not the sample's fault: the chunk goes back to the front of its queue untouched and
the worker waits for the server. A full output disk is handled the same way.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import redis
import structlog

from hsq.dataset import Sample, read_sample
from hsq.errors import (
    CachedTokensError,
    DatasetError,
    DumpError,
    OutputError,
    ServerRejectedError,
    ServerUnavailableError,
    StoreError,
    WrongLengthError,
)
from hsq.outputs import ManifestEntry, output_relpath, write_output
from hsq.protocol import (
    Expected,
    check_meta,
    clear_dump_dir,
    fingerprint,
    open_dump_tensors,
    read_meta,
    wait_for_dump,
)
from hsq.runconfig import RunConfig
from hsq.store import ChunkJob, RunStore, SampleRef, connect, new_worker_id
from workers.client import MidRequestFailure, ServerClient
from workers.lock import DumpDirLock
from workers.metrics import WorkerMetrics
from workers.persist import ChunkTracker, Persister, StagedSample
from workers.rate import RateWindow
from workers.readiness import require_hook
from workers.settings import WorkerSettings

log = structlog.get_logger("hsq.worker")
STAGING = ".hsq-staging"
# Reasons that no retry can fix.
PERMANENT = {"rejected", "server_crash"}


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        settings.validate()
        self.s = settings
        self.id = new_worker_id(settings.name)
        self.name = settings.name or self.id.rsplit(".", 1)[0]
        self.metrics = WorkerMetrics(settings.run, self.name)
        self._state = "starting"
        self.last_sample: str | None = None
        self.counts = {"done": 0, "retried": 0, "dead": 0, "tokens": 0}
        self._counts_lock = threading.Lock()
        self.rate = RateWindow(60.0)
        self._stop = threading.Event()
        self._output_error: OutputError | None = None
        self._redis_error = False
        self._lock = DumpDirLock(settings.dump_dir)
        self.staging = settings.dump_dir / STAGING
        self.client = ServerClient(settings.server, request_timeout=settings.request_timeout_s)
        self.store: RunStore
        self.cfg: RunConfig
        self.out_root: Path
        self.expected_model: str | None = None
        self.expected_layers: list[int] | None = None

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if value != self._state:
            self._state = value
            self.metrics.set_state(value)

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self, *_args: object) -> None:
        if not self._stop.is_set():
            log.info("stop_requested", worker=self.id)
        self._stop.set()

    def run(self) -> int:
        self._start()
        persister = Persister(self._persist, self.s.persist_depth, self.s.persist_threads)
        self.persister = persister
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        next_reap = 0.0
        try:
            self._wait_for_server()
            while not self._stop.is_set():
                if time.monotonic() >= next_reap:
                    self._reap()
                    next_reap = time.monotonic() + self.s.reap_interval_s
                if self._output_error is not None:
                    self._recover_output()
                    continue
                if self._redis_error:
                    self._release_when_redis_back()
                    continue
                try:
                    job = self.store.claim(self.id, self.s.claim_timeout_s)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    self._redis_down(e)
                    continue
                if job is None:
                    self.state = "idle"
                    if self.s.burst and self._run_finished():
                        break
                    continue
                self.state = "working"
                try:
                    self._process(job)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    self._redis_down(e)
                    self._release_when_redis_back()
        finally:
            self.state = "stopping"
            persister.drain()
            persister.close()
            self._stop.set()
            hb.join(timeout=5)
            self._shutdown_store()
            self._lock.release()
            self.client.close()
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            log.info("worker_stopped", worker=self.id, peak_rss_mb=round(peak_mb, 1), **self.counts)
        return 0

    def _start(self) -> None:
        d = self.s.dump_dir
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)  # private to this worker
        self._lock.acquire(self.id)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(mode=0o700)
        clear_dump_dir(d)
        self.store = RunStore(connect(self.s.redis_url), self.s.run)
        self.cfg = self.store.require_config()
        if not os.access(self.cfg.dataset, os.R_OK):
            raise StoreError(f"dataset {self.cfg.dataset} is not readable on this node")
        self.out_root = Path(self.cfg.out) / self.s.run
        self.out_root.mkdir(parents=True, exist_ok=True)
        self.metrics.out_dir = self.out_root
        if self.s.metrics_port is not None:
            self.metrics.serve(self.s.metrics_port, self.s.metrics_host)
        self.expected_model, self.expected_layers = self.cfg.model_id, self.cfg.layer_ids
        require_hook(d, self.client.healthy, self.cfg, self._stop)  # no hook: refuse
        self.store.register(self.id, self._info())
        log.info(
            "worker_started",
            worker=self.id,
            run=self.s.run,
            server=self.s.server,
            dump_dir=str(d),
            out=str(self.out_root),
            burst=self.s.burst,
        )

    def _run_finished(self) -> bool:
        self.persister.drain()  # its failures may have enqueued retries
        return self.store.nothing_outstanding()

    def _info(self) -> dict[str, Any]:
        samples_s, tokens_s = self.rate.rates()
        return {
            "samples_per_s": round(samples_s, 3),
            "tokens_per_s": round(tokens_s, 1),
            "name": self.name,
            "server": self.s.server,
            "state": self.state,
            "last_sample": self.last_sample or "",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ts": time.time(),
            **self.counts,
        }

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.s.heartbeat_interval_s):
            try:
                self.store.heartbeat(self.id, self._info())
            except redis.exceptions.RedisError as exc:
                log.warning("heartbeat_failed", error=str(exc))

    def _reap(self) -> None:
        try:
            recovered = self.store.reap()
        except redis.exceptions.RedisError as exc:
            log.warning("reap_failed", error=str(exc))
            return
        for wid, n in recovered.items():
            log.warning("recovered_dead_worker_jobs", dead_worker=wid, jobs=n)

    def _release_when_redis_back(self) -> None:
        """After a Redis error mid-chunk, put every job we hold back in the queue."""
        self.persister.drain()
        while not self._stop.is_set():
            try:
                n = self.store.release_wip(self.id)
                self._redis_error = False
                log.info("released_jobs_after_redis_error", jobs=n)
                return
            except redis.exceptions.RedisError as exc:
                self._redis_down(exc)

    def _shutdown_store(self) -> None:
        try:
            n = self.store.release_wip(self.id)  # normally 0: chunks were finished or handed back
            if n:
                log.warning("released_jobs_at_exit", jobs=n)
            self.store.unregister(self.id)
        except redis.exceptions.RedisError as exc:
            # Our heartbeat expires and another worker's reaper takes our jobs back.
            log.error("unregister_failed", error=str(exc))

    def _redis_down(self, exc: Exception) -> None:
        self.state = "backing_off"
        log.error("redis_unavailable", error=str(exc))
        self._stop.wait(2.0)

    # ------------------------------------------------------------------ per chunk
    def _process(self, job: ChunkJob) -> None:
        tracker = ChunkTracker(job)
        done = self.store.done_among([sid for sid, _ in job.samples])
        for ref in job.samples:
            if self._stop.is_set() or self._output_error is not None:
                self._hand_back(job, "stopping" if self._stop.is_set() else "output_error")
                return
            if ref[0] in done:
                continue
            outcome = self._one(ref, job.attempt, tracker)
            if outcome == "server_down":
                self._hand_back(job, "server_down")
                self._wait_for_server()
                return
        if tracker.close():
            self._end_chunk(job)

    def _hand_back(self, job: ChunkJob, why: str) -> None:
        self.persister.drain()
        self.store.give_back(self.id, job)
        self.metrics.handed_back(len(job.samples))
        log.info("job_handed_back", job=job.job_id, why=why)

    def _one(self, ref: SampleRef, attempt: int, tracker: ChunkTracker) -> str:
        sid, entry = ref
        self.last_sample = sid
        try:
            sample = read_sample(Path(self.cfg.dataset), sid, entry)
        except DatasetError as exc:
            self._fail(ref, attempt, exc.reason, str(exc), permanent=True)
            return "failed"
        self.metrics.add_in_flight(1)
        try:
            staged = self._extract(ref, sample, attempt, tracker)
        except DumpError as exc:
            self._fail(ref, attempt, exc.reason, str(exc))
            return "failed"
        except ServerRejectedError as exc:
            permanent = 400 <= exc.status_code < 500
            self._fail(
                ref,
                attempt,
                "rejected" if permanent else "server_error",
                str(exc),
                permanent=permanent,
            )
            return "failed"
        except MidRequestFailure as exc:
            crashes = self.store.record_crash(sid)
            log.warning("server_failed_mid_request", sample=sid, crashes=crashes, error=str(exc))
            if crashes >= self.s.max_server_crashes:
                msg = f"the server failed {crashes} times while processing it: {exc}"
                self._fail(ref, attempt, "server_crash", msg, permanent=True)
                return "failed"
            return "server_down"
        except ServerUnavailableError as exc:
            log.warning("server_unavailable", sample=sid, error=str(exc))
            return "server_down"
        finally:
            self.metrics.add_in_flight(-1)
        self.metrics.add_in_flight(1)  # until the persist stage is through with it
        tracker.add()
        self.persister.submit(staged)
        return "submitted"

    # ------------------------------------------------------------------ per sample
    def _extract(
        self, ref: SampleRef, sample: Sample, attempt: int, tracker: ChunkTracker
    ) -> StagedSample:
        d = self.s.dump_dir
        t0 = time.perf_counter()
        clear_dump_dir(d)
        rid = f"hsq-{sample.id}-a{attempt}-{secrets.token_hex(4)}"
        n = len(sample.input_ids)
        answer = self.client.prefill(sample.input_ids, rid)
        t1 = time.perf_counter()
        if answer.prompt_tokens != n:
            raise WrongLengthError(f"server counted {answer.prompt_tokens} prompt tokens, sent {n}")
        if answer.cached_tokens != 0:
            raise CachedTokensError(
                f"server reused {answer.cached_tokens} cached tokens; disable the radix cache"
            )
        path = wait_for_dump(d, self.s.dump_timeout_s, server_alive=self.client.healthy)
        t2 = time.perf_counter()
        meta = read_meta(path)
        if self.expected_model is None or self.expected_layers is None:
            self.expected_model, self.expected_layers = self.store.pin_model(
                meta.model.model_id, meta.layer_ids
            )
        expected = Expected(
            rid=rid,
            input_fingerprint=fingerprint(sample.input_ids),
            num_tokens=n,
            layer_ids=self.expected_layers,
            model_id=self.expected_model,
        )
        check_meta(meta, expected)
        staged = self.staging / rid
        os.rename(path, staged)  # the dump dir is clear: the next prefill may start
        t3 = time.perf_counter()
        self.metrics.observe("request", t1 - t0)
        self.metrics.observe("wait_done", t2 - t1)
        timings = {
            "request_ms": (t1 - t0) * 1e3,
            "wait_ms": (t2 - t1) * 1e3,
            "stage_ms": (t3 - t2) * 1e3,
        }
        return StagedSample(ref, sample, staged, meta, attempt, tracker, timings)

    def _persist(self, item: StagedSample) -> None:
        """Runs on the persist thread."""
        sid = item.ref[0]
        t0 = time.perf_counter()
        try:
            tensors = open_dump_tensors(item.staged, item.meta)  # header, shapes, finite
            t1 = time.perf_counter()
            self.metrics.observe("validate", t1 - t0)
            rel = output_relpath(sid)
            try:
                out = self.out_root / rel
                nbytes, crc = write_output(
                    out, item.sample, item.meta, tensors, self.s.run, self.cfg.store_dtype
                )
            finally:
                tensors.close()
            entry = ManifestEntry(
                path=rel,
                num_tokens=len(item.sample.input_ids),
                bytes=nbytes,
                checksum=crc,
                worker=self.id,
                time=time.time(),
                attempt=item.attempt,
                store_dtype=self.cfg.store_dtype,
            )
            newly = self.store.mark_done(sid, entry)
            self.metrics.observe("persist", time.perf_counter() - t1)
            self.metrics.done(entry.num_tokens, entry.bytes)
            with self._counts_lock:  # several persist threads
                self.counts["done"] += 1
                self.counts["tokens"] += entry.num_tokens
            self.rate.add(entry.num_tokens)
            log.info(
                "sample_done",
                sample=sid,
                tokens=entry.num_tokens,
                bytes=entry.bytes,
                attempt=item.attempt,
                first=newly,
                persist_ms=round((time.perf_counter() - t0) * 1e3, 2),
                **{k: round(v, 2) for k, v in item.timings.items()},
            )
        except DumpError as exc:
            self._fail(item.ref, item.attempt, exc.reason, str(exc))
        except OutputError as exc:
            log.error("output_write_failed", sample=sid, error=str(exc))
            self._output_error = exc
        except redis.exceptions.RedisError as exc:
            # The file is durable but not marked done: the chunk goes back once Redis
            # answers again and the sample is redone (same bytes, one manifest entry).
            log.error("mark_done_failed", sample=sid, error=str(exc))
            self._redis_error = True
        finally:
            shutil.rmtree(item.staged, ignore_errors=True)
            self.metrics.add_in_flight(-1)
            if item.tracker.one_done():  # the request loop closed the chunk: ours to end
                self._end_chunk(item.tracker.job)

    def _end_chunk(self, job: ChunkJob) -> None:
        """Finish a chunk from the persist thread (hand it back if a sample failed to land)."""
        try:
            if self._output_error is None and not self._redis_error:
                self.store.finish(self.id, job)
            else:
                self.store.give_back(self.id, job)
        except redis.exceptions.RedisError as exc:
            log.error("end_chunk_failed", job=job.job_id, error=str(exc))
            self._redis_error = True  # the request loop releases our jobs once Redis is back

    def _fail(
        self, ref: SampleRef, attempt: int, reason: str, message: str, permanent: bool = False
    ) -> None:
        try:
            self._route_failure(ref, attempt, reason, message, permanent)
        except redis.exceptions.RedisError as exc:
            # Not recorded: the chunk is handed back (not finished) once Redis answers, and
            # the sample runs again.
            log.error("failure_not_recorded", sample=ref[0], reason=reason, error=str(exc))
            self._redis_error = True

    def _route_failure(
        self, ref: SampleRef, attempt: int, reason: str, message: str, permanent: bool
    ) -> None:
        sid = ref[0]
        attempts = attempt + 1
        dead = permanent or reason in PERMANENT or attempts >= self.cfg.max_attempts
        self.metrics.failed(reason, dead)
        if dead:
            self.store.to_dead(sid, reason, message, attempts, self.id)
            with self._counts_lock:
                self.counts["dead"] += 1
            log.error("sample_dead", sample=sid, reason=reason, attempts=attempts, error=message)
        else:
            self.store.enqueue([[ref]], retry=True, attempt=attempts, reason=reason)
            with self._counts_lock:
                self.counts["retried"] += 1
            log.warning("sample_retry", sample=sid, reason=reason, attempt=attempts, error=message)

    # ------------------------------------------------------------------ waiting
    def _wait_for_server(self) -> None:
        delay = 0.25
        while not self._stop.is_set() and not self.client.healthy():
            self.state = "server_down"
            self.metrics.set_server_up(False)
            log.warning("waiting_for_server", server=self.s.server, retry_in_s=round(delay, 2))
            self._stop.wait(delay)
            delay = min(delay * 2, self.s.backoff_max_s)
        if not self._stop.is_set():
            self.state = "working"
            self.metrics.set_server_up(True)

    def _recover_output(self) -> None:
        self.state = "backing_off"
        log.error(
            "output_unwritable_pausing",
            error=str(self._output_error),
            retry_in_s=self.s.backoff_max_s,
        )
        self._stop.wait(self.s.backoff_max_s)
        self._output_error = None


def run_worker(settings: WorkerSettings) -> int:
    worker = Worker(settings)
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    return worker.run()
