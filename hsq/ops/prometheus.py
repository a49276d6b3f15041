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
        stream = StreamFamilies()
        for run in listing.runs:
            try:
                rs = RunStore(self.client, run)
                fig = run_figures(rs)
                stream.add(run, rs)
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
        yield from stream.families()


class StreamFamilies:
    """A streamed run's metrics (docs/training.md, "Train while extracting"): the spool
    against its budget, the workers held back by it, and per consumer group what was
    delivered, committed and is pending, the oldest pending entry's age and the trainers'
    data-wait share. A few commands a streamed run (XINFO GROUPS, an XPENDING summary
    per group with pending entries, the worker records, one HGETALL); nothing for an
    offline run."""

    def __init__(self) -> None:
        self.spool = GaugeMetricFamily(
            "hsq_spool_bytes", "Bytes reserved in a streamed run's spool", labels=["run"]
        )
        self.budget = GaugeMetricFamily(
            "hsq_spool_budget_bytes", "A streamed run's spool budget", labels=["run"]
        )
        self.paused = GaugeMetricFamily(
            "hsq_spool_paused_seconds",
            "Seconds the live workers of a streamed run were held back by a full spool "
            "(summed over them; a restarted worker starts again from 0)",
            labels=["run"],
        )
        self.full = GaugeMetricFamily(
            "hsq_spool_full_workers",
            "Live workers of a streamed run paused by its spool now (full, or a sample "
            "above the budget)",
            labels=["run"],
        )
        self.entries = GaugeMetricFamily(
            "hsq_stream_group_entries",
            "Stream entries of a consumer group by state (published, delivered, committed, "
            "pending)",
            labels=["run", "group", "state"],
        )
        self.oldest = GaugeMetricFamily(
            "hsq_stream_group_oldest_pending_seconds",
            "Age of a consumer group's oldest delivered, not committed entry (0: none)",
            labels=["run", "group"],
        )
        self.wait = GaugeMetricFamily(
            "hsq_stream_group_data_wait_ratio",
            "Share of its time a consumer group's trainers waited for data, as of their "
            "last commit (0 until one committed)",
            labels=["run", "group"],
        )

    def add(self, run: str, store: RunStore) -> None:
        cfg = store.require_config()
        if not cfg.streamed:
            return
        spool = store.spool
        self.spool.add_metric([run], spool.spool_bytes())
        self.budget.add_metric([run], cfg.spool_budget or 0)
        held = full = 0.0
        for info in store.workers.workers_info().values():
            with contextlib.suppress(ValueError):
                held += float(info.get("spool_paused_s", 0) or 0)
            full += info.get("cause") in ("spool_full", "spool_too_small")
        self.paused.add_metric([run], held)
        self.full.add_metric([run], full)
        published = spool.published()
        waits = spool.consumer_waits()
        for g in spool.groups():
            self.entries.add_metric([run, g.name, "published"], published)
            self.entries.add_metric([run, g.name, "delivered"], g.delivered)
            self.entries.add_metric([run, g.name, "committed"], g.committed)
            self.entries.add_metric([run, g.name, "pending"], g.pending)
            self.oldest.add_metric([run, g.name], g.oldest_pending_s)
            self.wait.add_metric([run, g.name], waits.get(g.name, {}).get("wait_share", 0.0))

    def families(self) -> Iterator[Metric]:
        yield from (self.spool, self.budget, self.paused, self.full, self.entries)
        yield from (self.oldest, self.wait)


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
