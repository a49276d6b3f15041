"""The worker's settings, built once at the edge (CLI flags and env vars) and validated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsq.errors import ConfigError


@dataclass(frozen=True)
class WorkerSettings:
    run: str
    server: str
    dump_dir: Path
    redis_url: str
    name: str | None = None
    burst: bool = False
    dump_timeout_s: float = 60.0
    """How long to wait for `done` after the server answered."""
    request_timeout_s: float = 600.0
    claim_timeout_s: float = 1.0
    persist_depth: int = 2
    persist_threads: int = 2
    backoff_max_s: float = 30.0
    max_server_crashes: int = 3
    """Requests of one sample that may die with the server before it is dead-lettered."""
    reap_interval_s: float = 5.0
    heartbeat_interval_s: float = 2.0
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (None: off)."""
    metrics_host: str = "127.0.0.1"
    inflight: int = 4
    """Requests in flight on the server at once (K); 1 is the v1 one-at-a-time loop."""
    max_inflight_tokens: int | None = None
    """Tokens in flight at once (None: only K bounds it); one larger sample still goes alone."""
    dump_dir_force: bool = False
    """Use a dump dir that looks shared (sticky, or owned by someone else)."""

    def validate(self) -> None:
        if not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"--server must be an http(s) URL, not {self.server!r}")
        if not 1 <= self.inflight <= 256:
            raise ConfigError("--inflight must be within [1, 256]")
        if self.max_inflight_tokens is not None and self.max_inflight_tokens < 1:
            raise ConfigError("--max-inflight-tokens must be >= 1")
        if min(self.persist_depth, self.persist_threads, self.max_server_crashes) < 1:
            raise ConfigError(
                "--persist-depth, --persist-threads and --max-server-crashes must be >= 1"
            )
        for name in ("dump_timeout_s", "request_timeout_s", "claim_timeout_s", "backoff_max_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
