"""The worker's settings, built once at the edge (CLI flags and env vars) and validated.

Three commands set them, each the part it owns, so nothing is filled with placeholders:

    WorkerSettings   one `hsq worker`: who it is (run, server URL, dump dir, Redis, name)
      api            EngineApi: which API that server speaks         (hsq worker, hsq audit)
      tuning         WorkerTuning: how any worker works              (hsq worker, hsq run)
        exchange     ExchangeTuning: one request and its dump        (+ hsq audit)

`hsq run` takes a WorkerTuning and hands it to each worker it starts (hsq.cli.options.as_argv),
with the identity and the engine it chose itself; `hsq audit` takes an EngineApi and an
ExchangeTuning, as it talks to one server the way a worker does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hsq.errors import ConfigError
from hsq.keys import HEARTBEAT_TTL_S
from hsq.settings import setting

SGLANG_API = "sglang"
VLLM_API = "vllm"
ENGINES = (SGLANG_API, VLLM_API)
"""The APIs a worker speaks: SGLang's /generate (SGLang with hsq's hook and the reference
server) and vLLM's /v1/completions (stock vLLM with hsq's connector)."""


TUNING = "Worker tuning"
"""The --help heading of the options that tune how a worker works (hsq/cli/command.py)."""


@dataclass(frozen=True)
class EngineApi:
    """Which API the server speaks, and the model name its requests carry."""

    engine: str = setting(
        SGLANG_API,
        choices=ENGINES,
        deprecated=("--server-kind",),
        deprecated_env=("HSQ_SERVER_KIND",),
        help="the server's API: sglang (SGLang with hsq's hook, or the reference server: "
        "/generate) or vllm (stock vLLM with hsq's connector: /v1/completions)",
    )
    served_model: str | None = setting(
        None,
        default_text="the server's only model",
        help="vLLM only: the `model` of each completions request (--served-model-name)",
    )


@dataclass(frozen=True)
class ExchangeTuning:
    """One request to a server and the dump it writes, as a worker or the audit waits for
    them, and the dump dir it takes."""

    dump_timeout_s: float = setting(
        60.0, section=TUNING, help="seconds to wait for a dump's `done` after the server answered"
    )
    request_timeout_s: float = setting(
        600.0,
        section=TUNING,
        help="seconds one request to the server may take, all of it (connect, send, the "
        "whole answer: a server that trickles its answer cannot stretch it; the audit also "
        "waits this long for a server that answers to become healthy)",
    )
    dump_dir_force: bool = setting(
        False,
        section=TUNING,
        help="use a dump dir that looks shared (sticky, or owned by another user)",
    )

    def validate(self) -> None:
        _positive(self, "dump_timeout_s", "request_timeout_s")


@dataclass(frozen=True)
class WorkerTuning:
    """How a worker works, whatever its run and server: the same for every worker of an
    `hsq run` (each gets the flags given)."""

    exchange: ExchangeTuning = field(default_factory=ExchangeTuning)
    claim_timeout_s: float = setting(
        1.0, section=TUNING, help="seconds one claim waits for a job before the worker looks around"
    )
    persist_depth: int = setting(
        4, section=TUNING, help="validated dumps waiting for the persist stage (bounds memory)"
    )
    persist_threads: int = setting(
        8,
        section=TUNING,
        help="threads writing outputs: many small files are bound by fsync latency, which "
        "threads overlap (BENCHMARKS.md)",
    )
    persist_procs: int | None = setting(
        None,
        section=TUNING,
        help="persist processes doing each sample's checks, quantizing and writing outside "
        "the worker's interpreter (0: threads only) [default: half the usable cores, at most "
        "8; 0 below 4 cores; `hsq run`: the cores shared by its workers]",
    )
    direct_io: bool = setting(
        True,
        section=TUNING,
        help="write output files of 1 MiB or more with O_DIRECT where the filesystem allows "
        "it (not tmpfs): faster on disks whose page-cache write-back limits a stream",
    )
    backoff_max_s: float = setting(
        30.0,
        section=TUNING,
        help="longest wait, in seconds, between retries while a dependency is down",
    )
    max_server_crashes: int = setting(
        3,
        section=TUNING,
        help="requests of one sample that may die with the server before it is dead-lettered",
    )
    reap_interval_s: float = setting(
        5.0,
        section=TUNING,
        help="seconds between looks for dead workers' held jobs (to put them back)",
    )
    heartbeat_interval_s: float = setting(
        2.0,
        section=TUNING,
        help=f"seconds between heartbeats in Redis (at most {HEARTBEAT_TTL_S / 2:g})",
    )
    metrics_host: str = setting(
        "127.0.0.1",
        section=TUNING,
        help="bind address of the metrics endpoint (0.0.0.0 exposes it to the network)",
    )
    inflight: int = setting(
        4,
        section=TUNING,
        help="requests in flight on the server at once; dumps are matched by rid "
        "(1: one at a time; up to as many more answered ones wait for their dumps)",
    )
    max_inflight_tokens: int | None = setting(
        None,
        section=TUNING,
        help="cap on the tokens of the requests in flight [default: only --inflight caps it]; "
        "one larger sample still goes alone",
    )
    audit_fraction: float = setting(
        0.0,
        section=TUNING,
        help="re-extract this fraction of done samples alone and compare with the stored "
        "states (finds a server that mixes up requests; mismatches: dead letter "
        "`audit_mismatch`)",
    )

    def validate(self) -> None:
        self.exchange.validate()
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
        _positive(
            self, "claim_timeout_s", "backoff_max_s", "reap_interval_s", "heartbeat_interval_s"
        )
        if self.heartbeat_interval_s > HEARTBEAT_TTL_S / 2:
            # Slower beats let the heartbeat expire between two of them (a reaper then takes
            # the jobs of a live worker) or break its lease on every beat
            # (hsq/workers/persist/stage.py).
            raise ConfigError(
                f"--heartbeat-interval must be at most {HEARTBEAT_TTL_S / 2:g} s, half the "
                f"{HEARTBEAT_TTL_S} s heartbeat TTL"
            )


@dataclass(frozen=True)
class WorkerSettings:
    """One `hsq worker`: each field is a flag and an HSQ_* variable (hsq.settings)."""

    run: str = setting(help="run name")
    server: str = setting(help="inference server URL")
    dump_dir: Path = setting(
        help="the server's dump dir, owned by this worker", env=("SGLANG_HS_DUMP_DIR",)
    )
    redis_url: str = setting(help="Redis URL (the shared --redis option)")
    api: EngineApi = field(default_factory=EngineApi)
    name: str | None = setting(
        None, help="stable name for logs and metrics; a unique suffix is added"
    )
    burst: bool = setting(False, help="exit when the run has nothing queued or held")
    metrics_port: int | None = setting(
        None, help="serve Prometheus metrics on this port [default: off]"
    )
    tuning: WorkerTuning = field(default_factory=WorkerTuning)

    def validate(self) -> None:
        if not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"--server must be an http(s) URL, not {self.server!r}")
        if self.api.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}")
        self.tuning.validate()


def _positive(obj: object, *names: str) -> None:
    """Each named duration must be > 0; the message names its flag."""
    for name in names:
        if getattr(obj, name) <= 0:
            flag = "--" + name.removesuffix("_s").replace("_", "-")
            raise ConfigError(f"{flag} must be > 0")
