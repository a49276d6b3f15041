"""The worker's settings, built once at the edge (CLI flags and env vars) and validated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsq.errors import ConfigError
from hsq.keys import HEARTBEAT_TTL_S
from hsq.settings import setting

SERVER_KINDS = ("sglang", "vllm")


@dataclass(frozen=True)
class WorkerSettings:
    """Each field is a flag of `hsq worker` and an HSQ_* variable (hsq.settings)."""

    run: str = setting(help="run name")
    server: str = setting(help="inference server URL")
    dump_dir: Path = setting(
        help="the server's dump dir, owned by this worker", env=("SGLANG_HS_DUMP_DIR",)
    )
    redis_url: str = setting(help="Redis URL (the shared --redis option)")
    server_kind: str = setting(
        "sglang",
        choices=SERVER_KINDS,
        help="the server's API: sglang (SGLang with hsq's hook, the reference server: "
        "/generate) or vllm (stock vLLM with hsq's connector: /v1/completions)",
    )
    served_model: str | None = setting(
        None,
        default_text="the server's only model",
        help="vLLM only: the `model` of each completions request (--served-model-name)",
    )
    name: str | None = setting(
        None, help="stable name for logs and metrics; a unique suffix is added"
    )
    burst: bool = setting(False, help="exit when the run has nothing queued or held")
    dump_timeout_s: float = setting(
        60.0, help="seconds to wait for a dump's `done` after the server answered"
    )
    request_timeout_s: float = setting(
        600.0,
        help="seconds one /generate request may take, all of it (connect, send, the whole "
        "answer); a server that trickles its answer cannot stretch it",
    )
    claim_timeout_s: float = setting(
        1.0, help="seconds one claim waits for a job before the worker looks around"
    )
    persist_depth: int = setting(
        4, help="validated dumps waiting for the persist stage (bounds memory)"
    )
    persist_threads: int = setting(
        8,
        help="threads writing outputs: many small files are bound by fsync latency, which "
        "threads overlap (BENCHMARKS.md)",
    )
    persist_procs: int | None = setting(
        None,
        help="persist processes doing each sample's checks, quantizing and writing outside "
        "the worker's interpreter (0: threads only) [default: half the usable cores, at most "
        "8; 0 below 4 cores]",
    )
    direct_io: bool = setting(
        True,
        help="write output files of 1 MiB or more with O_DIRECT where the filesystem allows "
        "it (not tmpfs): faster on disks whose page-cache write-back limits a stream",
    )
    backoff_max_s: float = setting(
        30.0, help="longest wait, in seconds, between retries while a dependency is down"
    )
    max_server_crashes: int = setting(
        3, help="requests of one sample that may die with the server before it is dead-lettered"
    )
    reap_interval_s: float = setting(
        5.0, help="seconds between looks for dead workers' held jobs (to put them back)"
    )
    heartbeat_interval_s: float = setting(
        2.0, help=f"seconds between heartbeats in Redis (at most {HEARTBEAT_TTL_S / 2:g})"
    )
    metrics_port: int | None = setting(
        None, help="serve Prometheus metrics on this port [default: off]"
    )
    metrics_host: str = setting(
        "127.0.0.1",
        help="bind address of the metrics endpoint (0.0.0.0 exposes it to the network)",
    )
    inflight: int = setting(
        4,
        help="requests in flight on the server at once; dumps are matched by rid "
        "(1: one at a time; up to as many more answered ones wait for their dumps)",
    )
    max_inflight_tokens: int | None = setting(
        None,
        help="cap on the tokens of the requests in flight [default: only --inflight caps it]; "
        "one larger sample still goes alone",
    )
    dump_dir_force: bool = setting(
        False, help="use a dump dir that looks shared (sticky, or owned by another user)"
    )
    audit_fraction: float = setting(
        0.0,
        help="re-extract this fraction of done samples alone and compare with the stored "
        "states (finds a server that mixes up requests; mismatches: dead letter "
        "`audit_mismatch`)",
    )

    def validate(self) -> None:
        if not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"--server must be an http(s) URL, not {self.server!r}")
        if self.server_kind not in SERVER_KINDS:
            raise ConfigError(f"--server-kind must be one of {', '.join(SERVER_KINDS)}")
        if not 0.0 <= self.audit_fraction <= 1.0:
            raise ConfigError("--audit-fraction must be within [0, 1]")
        if not 1 <= self.inflight <= 256:
            raise ConfigError("--inflight must be within [1, 256]")
        if self.max_inflight_tokens is not None and self.max_inflight_tokens < 1:
            raise ConfigError("--max-inflight-tokens must be >= 1")
        if self.persist_procs is not None and not 0 <= self.persist_procs <= 64:
            raise ConfigError("--persist-procs must be within [0, 64]")
        if min(self.persist_depth, self.persist_threads, self.max_server_crashes) < 1:
            raise ConfigError(
                "--persist-depth, --persist-threads and --max-server-crashes must be >= 1"
            )
        for name in (
            "dump_timeout_s",
            "request_timeout_s",
            "claim_timeout_s",
            "backoff_max_s",
            "reap_interval_s",
            "heartbeat_interval_s",
        ):
            if getattr(self, name) <= 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ConfigError(f"{flag} must be > 0")
        if self.heartbeat_interval_s > HEARTBEAT_TTL_S / 2:
            # Slower beats let the heartbeat expire between two of them (a reaper then takes
            # the jobs of a live worker) or break its lease on every beat
            # (hsq/workers/persist/stage.py).
            raise ConfigError(
                f"--heartbeat-interval must be at most {HEARTBEAT_TTL_S / 2:g} s, half the "
                f"{HEARTBEAT_TTL_S} s heartbeat TTL"
            )
