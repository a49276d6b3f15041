"""`hsq exporter`: queue-level metrics read from Redis at scrape time.

One exporter per Redis, so the numbers are right when no worker runs. Every scrape costs a
handful of O(1) commands per run (HLEN, LLEN, HGETALL of the small stats hash), plus the
SCAN that lists the runs (hsq.store.scan_runs: O(keys in Redis), since no shared set of run
names is kept: a run's user could remove or forge another run's entry in one), taken again
only as often as RESCAN_FACTOR allows. Labels: run, queue, state; never a sample id.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import threading
import time
from collections.abc import Iterator

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hsq.errors import ConfigError, StoreError
from hsq.ops import run_figures
from hsq.runstore import RunStore
from hsq.store import Client, RunListing, connect, scan_runs

log = structlog.get_logger("hsq.ops.prometheus")


RESCAN_FACTOR = 10
"""The run list is taken again once it is older than this many times what its SCAN took:
every scrape on a small Redis, every ~40 s at a million keys (SCAN then holds Redis's one
thread for under a tenth of the time)."""


class RedisCollector(Collector):
    def __init__(self, client: Client) -> None:
        self.client = client
        self.errors = 0
        self._listing = RunListing()
        self._listed_at = -math.inf
        self._scan_s = 0.0

    def _run_listing(self) -> RunListing:
        now = time.monotonic()
        if now - self._listed_at >= RESCAN_FACTOR * self._scan_s:
            self._listing = scan_runs(self.client)
            self._listed_at = time.monotonic()
            self._scan_s = self._listed_at - now
        last = self._listing  # a copy: what this scrape skips is counted for this scrape
        return RunListing(list(last.runs), list(last.skipped), last.skipped_total)

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        up = GaugeMetricFamily("hsq_redis_up", "1 if the exporter could read Redis")
        try:
            families = list(self._runs())
            up.add_metric([], 1)
        except StoreError as exc:
            self.errors += 1
            log.warning("scrape_failed", error=str(exc))
            families = []
            up.add_metric([], 0)
        yield up
        yield from families
        err = CounterMetricFamily("hsq_exporter_scrape_errors", "Scrapes that failed to read Redis")
        err.add_metric([], self.errors)
        yield err
        dur = GaugeMetricFamily("hsq_exporter_scrape_duration_seconds", "Time to read Redis")
        dur.add_metric([], time.perf_counter() - t0)
        yield dur

    def _runs(self) -> Iterator[Metric]:
        listing = self._run_listing()
        jobs = GaugeMetricFamily(
            "hsq_queue_jobs", "Jobs waiting in a queue", labels=["run", "queue"]
        )
        samples = GaugeMetricFamily(
            "hsq_run_samples",
            "Samples of a run by state (total, done, dead, remaining)",
            labels=["run", "state"],
        )
        tokens = GaugeMetricFamily(
            "hsq_run_tokens", "Tokens of a run (total, done)", labels=["run", "state"]
        )
        written = GaugeMetricFamily(
            "hsq_run_written_bytes", "Output bytes of samples done", labels=["run"]
        )
        workers = GaugeMetricFamily(
            "hsq_run_workers", "Workers with a live heartbeat", labels=["run"]
        )
        held = GaugeMetricFamily(
            "hsq_run_held_jobs", "Jobs held by workers (in progress)", labels=["run"]
        )
        free = GaugeMetricFamily(
            "hsq_run_output_free_bytes",
            "Free bytes on the run's output filesystem, where the exporter can see it",
            labels=["run"],
        )
        for run in listing.runs:
            try:
                fig = run_figures(RunStore(self.client, run))
            except ConfigError as exc:  # purged meanwhile, or its config cannot be read
                listing.skip(f"run {run!r}: {exc}")
                continue
            # The same figures `hsq status` prints (hsq.ops.run_figures).
            jobs.add_metric([run, "main"], fig.queued_jobs)
            jobs.add_metric([run, "retry"], fig.retry_jobs)
            samples.add_metric([run, "total"], fig.total)
            samples.add_metric([run, "done"], fig.done)
            samples.add_metric([run, "dead"], fig.dead)
            samples.add_metric([run, "remaining"], fig.remaining)
            tokens.add_metric([run, "total"], fig.tokens_total)
            tokens.add_metric([run, "done"], fig.tokens_done)
            written.add_metric([run], fig.bytes_done)
            workers.add_metric([run], fig.live_workers)
            held.add_metric([run], fig.held_jobs)
            if fig.out:
                # Skipped where the output filesystem is not mounted on the exporter's host.
                with contextlib.suppress(OSError):
                    free.add_metric([run], shutil.disk_usage(fig.out).free)
        skipped = GaugeMetricFamily(
            "hsq_runs_skipped",
            "Keys that look like a run's config but could not be read as one (last scrape)",
        )
        skipped.add_metric([], listing.skipped_total)
        if listing.skipped:
            log.warning("runs_skipped", count=listing.skipped_total, first=listing.skipped[:3])
        yield from (jobs, samples, tokens, written, workers, held, free, skipped)


def run_exporter(redis_url: str, host: str, port: int) -> None:
    client = connect(redis_url)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(client))
    start_http_server(port, addr=host, registry=registry)
    log.info("exporter_ready", host=host, port=port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    log.info("exporter_stopped")
