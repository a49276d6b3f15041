"""`hsq exporter`: queue-level metrics read from Redis at scrape time.

One exporter per Redis, so the numbers are right when no worker runs. Every scrape costs a
handful of O(1) commands per run (HLEN, LLEN, HGETALL of the small stats hash). Labels:
run, queue, state; never a sample id.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator

import redis
import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hsq.keys import RUNS, RunKeys, rq_queue_key

log = structlog.get_logger("hsq.exporter")


class RedisCollector(Collector):
    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self.errors = 0

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        up = GaugeMetricFamily("hsq_redis_up", "1 if the exporter could read Redis")
        try:
            families = list(self._runs())
            up.add_metric([], 1)
        except redis.exceptions.RedisError as exc:
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
        runs = sorted(r.decode() for r in self.r.smembers(RUNS))  # type: ignore[union-attr]
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
        for run in runs:
            k = RunKeys(run)
            p = self.r.pipeline(transaction=False)
            p.llen(rq_queue_key(k.main_queue))
            p.llen(rq_queue_key(k.retry_queue))
            p.hlen(k.index)
            p.hlen(k.done)
            p.hlen(k.dead)
            p.hgetall(k.stats)
            p.smembers(k.workers)
            p.hget(k.config, "out")
            main, retry, index, done, dead, stats, wids, out = p.execute()
            st = {a.decode(): int(b) for a, b in stats.items()}
            jobs.add_metric([run, "main"], main)
            jobs.add_metric([run, "retry"], retry)
            # Invalid dataset lines are dead-letter entries and part of `total`, as in status.
            total = index + st.get("invalid_lines", 0)
            samples.add_metric([run, "total"], total)
            samples.add_metric([run, "done"], done)
            samples.add_metric([run, "dead"], dead)
            samples.add_metric([run, "remaining"], max(total - done - dead, 0))
            tokens.add_metric([run, "total"], st.get("total_tokens", 0))
            tokens.add_metric([run, "done"], st.get("tokens", 0))
            written.add_metric([run], st.get("bytes", 0))
            p = self.r.pipeline(transaction=False)
            for w in wids:
                p.exists(k.worker(w.decode()))
                p.llen(k.wip(w.decode()))
            res = p.execute()
            workers.add_metric([run], sum(res[0::2]))
            held.add_metric([run], sum(res[1::2]))
            if out:
                # Skipped where the output filesystem is not mounted on the exporter's host.
                with contextlib.suppress(OSError):
                    free.add_metric([run], shutil.disk_usage(json.loads(out)).free)
        yield from (jobs, samples, tokens, written, workers, held, free)


def run_exporter(redis_url: str, host: str, port: int) -> None:
    from hsq.store import connect

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
