"""`hsq serve-reference`, `hsq worker`, `hsq exporter`: the long-running processes."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from hsq import extras
from hsq.cli.command import hsq_command
from hsq.cli.flags import RedisFlags
from hsq.cli.options import settings_options, take
from hsq.engines.reference.settings import ReferenceSettings
from hsq.settings import setting
from hsq.workers.settings import WorkerSettings


@hsq_command("serve-reference")
@settings_options(ReferenceSettings)
def serve_reference(**values: Any) -> None:
    """Serve a real transformer with SGLang's HTTP API, dumping hidden states per request.

    \b
    Example:
      hsq serve-reference --model tiny --dump-dir /tmp/dumps --port 30000
      hsq serve-reference --model /models/llama --device cuda --dump-dir /dev/shm/d0
    """
    extras.require("reference", "hsq serve-reference")
    # Before torch loads. Idle OpenMP threads spin after each forward: on a CPU that is the
    # workers' CPU (20 forwards of 200 tokens: 6.3-6.9 s of CPU, 0.7 s passive; the same
    # threads, so the same states). A value the user set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from hsq.engines.reference.app import serve

    serve(take(ReferenceSettings, values))
    # serve() returns once the dumps are flushed and `stopped` is logged: skip the
    # interpreter's teardown, seconds of CPU with torch and transformers loaded.
    _exit_now(0)


@hsq_command("worker")
@settings_options(RedisFlags)
@settings_options(WorkerSettings, skip=("redis_url",))
def worker(**values: Any) -> None:
    """Extract samples of a run through one inference server.

    \b
    Example:
      hsq worker --run kimi-v1 --server http://127.0.0.1:30000 --dump-dir /dev/shm/hsq0
    """
    from hsq.workers.worker import run_worker

    redis = take(RedisFlags, values)
    rc = run_worker(take(WorkerSettings, values, redis_url=redis.url()))
    # Everything is released (jobs, registration, dump dir lock) and `worker_stopped` is
    # logged: skip the interpreter's teardown, which takes seconds once torch is loaded.
    _exit_now(rc)


def _exit_now(rc: int) -> None:
    """Flush stdout and stderr, then end the process without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


@dataclass(frozen=True)
class ExporterFlags:
    # `--metrics-port` and `--metrics-host`, as a worker's: one name per concept (the
    # servers' --port and --host are where they serve requests).
    exporter_port: int = setting(
        9640, flag="--metrics-port", deprecated=("--port",), help="port serving /metrics"
    )
    exporter_host: str = setting(
        "127.0.0.1",
        flag="--metrics-host",
        deprecated=("--host",),
        help="address to bind; 0.0.0.0 to let Prometheus on another host scrape it",
    )


@hsq_command("exporter")
@settings_options(RedisFlags)
@settings_options(ExporterFlags)
def exporter(**values: Any) -> None:
    """Serve queue-level Prometheus metrics for every run in a Redis.

    \b
    Example:
      hsq exporter --redis-url-file /run/secrets/redis_url --metrics-host 0.0.0.0
    """
    from hsq.ops.prometheus import run_exporter

    redis = take(RedisFlags, values)
    flags = take(ExporterFlags, values)
    run_exporter(redis.url(), flags.exporter_host, flags.exporter_port)
