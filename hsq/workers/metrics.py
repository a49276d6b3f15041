"""Worker metrics (prometheus-client), on a registry of the worker's own (no globals).

Labels stay low-cardinality: run, worker (the stable --name), phase, outcome, reason.
Never a sample id. The stages time their phases here; everything the main thread does
reaches the metrics as a Notice (:meth:`WorkerMetrics.on_notice`, hsq/workers/notices.py).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from hsq.workers.notices import (
    AuditRejected,
    ChunkHandedBack,
    InFlightChanged,
    Notice,
    OutputDirMoved,
    SampleFailed,
    ServerHealth,
    StateChanged,
)
from hsq.workers.state import WorkerState

# Prefill of 16 tokens on a tiny CPU model to 8k tokens of a large model on a slow server.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PHASES = ("request", "wait_done", "validate", "persist")
STATES = tuple(s.value for s in WorkerState)
M = TypeVar("M", Counter, Gauge)


class WorkerMetrics:
    def __init__(self, run: str, worker: str, out_dir: Path | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"run": run, "worker": worker}
        self.out_dir = out_dir
        counter, gauge = self._declare(Counter), self._declare(Gauge)
        self.samples = counter(
            "hsq_worker_samples",
            "Samples handled, by outcome (done, retry, dead, handed_back)",
            "outcome",
        )
        self.tokens = counter("hsq_worker_tokens", "Tokens of samples done")
        self.bytes = counter("hsq_worker_written_bytes", "Output bytes written durably")
        self.phase = Histogram(
            "hsq_worker_phase_seconds",
            "Latency of each phase of a sample",
            [*self.labels, "phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.mismatches = counter("hsq_worker_mismatches", "Failed samples by reason", "reason")
        self.server_up = gauge(
            "hsq_worker_server_up", "1 if the worker's inference server is healthy"
        )
        self.in_flight = gauge(
            "hsq_worker_in_flight_samples",
            "Samples between request and done (at most 2 x --inflight + persist depth + threads)",
        )
        self.in_flight_tokens = gauge(
            "hsq_worker_in_flight_tokens",
            "Tokens of the requests in flight on the server (bounded by --max-inflight-tokens)",
        )
        self.dumps_discarded = counter(
            "hsq_worker_dumps_discarded",
            "Dumps removed without being attributed (unknown_rid, late, unreadable)",
            "why",
        )
        self.last_success = gauge(
            "hsq_worker_last_success_timestamp_seconds", "Unix time of the last sample done"
        )
        self.state = gauge("hsq_worker_state", "1 for the worker's current state", "state")
        self.free = gauge("hsq_worker_output_free_bytes", "Free bytes on the output filesystem")
        self.size = gauge("hsq_worker_output_size_bytes", "Size of the output filesystem")
        self.free.labels(**self.labels).set_function(lambda: self._disk(free=True))
        self.size.labels(**self.labels).set_function(lambda: self._disk(free=False))
        # The children touched for every sample, looked up once: `labels(**...)` costs
        # tens of microseconds under the GIL, several times a sample (profiled).
        self._by_outcome = {
            o: self.samples.labels(**self.labels, outcome=o)
            for o in ("done", "retry", "dead", "handed_back")
        }
        self._by_phase = {ph: self.phase.labels(**self.labels, phase=ph) for ph in PHASES}
        self._tokens = self.tokens.labels(**self.labels)
        self._bytes = self.bytes.labels(**self.labels)
        self._last_success = self.last_success.labels(**self.labels)
        self._in_flight = self.in_flight.labels(**self.labels)
        self._in_flight_tokens = self.in_flight_tokens.labels(**self.labels)
        self.set_state(WorkerState.STARTING)

    def _declare(self, kind: type[M]) -> Callable[..., M]:
        """A metric of `kind` on this registry, labelled run and worker plus `extra`."""

        def make(name: str, doc: str, *extra: str) -> M:
            return kind(name, doc, [*self.labels, *extra], registry=self.registry)

        return make

    def _disk(self, free: bool) -> float:
        if self.out_dir is None:
            return float("nan")
        try:
            usage = shutil.disk_usage(self.out_dir)
        except OSError:
            return float("nan")
        return float(usage.free if free else usage.total)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def on_notice(self, notice: Notice) -> None:
        """The main thread's listener (hsq/workers/notices.py)."""
        if isinstance(notice, StateChanged):
            self.set_state(notice.state)
        elif isinstance(notice, InFlightChanged):
            self.set_in_flight(notice.samples, notice.tokens)
        elif isinstance(notice, SampleFailed):
            self.failed(notice.reason, notice.dead)
        elif isinstance(notice, AuditRejected):
            self.failed(notice.reason, True)
        elif isinstance(notice, ChunkHandedBack):
            self.handed_back(notice.samples)
        elif isinstance(notice, ServerHealth):
            self.set_server_up(notice.up)
        elif isinstance(notice, OutputDirMoved):
            self.out_dir = notice.path

    # Hooks the stages call; each is a few dict lookups.
    def observe(self, phase: str, seconds: float) -> None:
        child = self._by_phase.get(phase)
        if child is None:
            child = self._by_phase[phase] = self.phase.labels(**self.labels, phase=phase)
        child.observe(seconds)

    def done(self, tokens: int, nbytes: int) -> None:
        self._by_outcome["done"].inc()
        self._tokens.inc(tokens)
        self._bytes.inc(nbytes)
        self._last_success.set(time.time())

    def failed(self, reason: str, dead: bool) -> None:
        self._by_outcome["dead" if dead else "retry"].inc()
        self.mismatches.labels(**self.labels, reason=reason).inc()

    def handed_back(self, n: int) -> None:
        self._by_outcome["handed_back"].inc(n)

    def set_server_up(self, up: bool) -> None:
        self.server_up.labels(**self.labels).set(1 if up else 0)

    def set_state(self, state: WorkerState) -> None:
        for s in STATES:
            self.state.labels(**self.labels, state=s).set(1 if s == state.value else 0)

    def set_in_flight(self, samples: int, tokens: int) -> None:
        self._in_flight.set(samples)
        self._in_flight_tokens.set(tokens)

    def discarded(self, why: str) -> None:
        self.dumps_discarded.labels(**self.labels, why=why).inc()
