"""What a live run is told through its environment (scripts/sglang_live.sh sets it).

Pure and small, so tests/test_live_settings.py checks it without a GPU. Every value is
validated here: a bad one stops the run at collection, before a server start costs minutes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "HSQ_LIVE_"


class LiveSettingsError(ValueError):
    """A HSQ_LIVE_* variable with a value the live run cannot use."""


@dataclass(frozen=True)
class LiveSettings:
    work: Path | None
    """Where models, logs, Redis and outputs go (None: pytest's temporary directory)."""
    dump_root: Path | None
    """Where each server's dump dir is made (None: /dev/shm if there, else `work`)."""
    models: Path | None
    """The test checkpoints, shared by parallel jobs (None: `work`/models)."""
    results: Path | None
    """The JSON file every figure is written to as it is measured."""
    sglang_version: str | None
    """The SGLang version the run must find installed (None: whatever is there)."""
    tp: int = 1
    samples: int = 300
    moe_samples: int = 120
    audit_samples: int = 40
    inflight: int = 8
    chunk: int = 1024
    kill: bool = True
    start_timeout: float = 600.0
    long: tuple[int, ...] = (16384, 32768, 65536)
    """Sample lengths of the long-context test (tests/gpu/test_sglang_long.py)."""
    long_layers: int = 8
    """Decoder layers of its 8B-width model (Llama-3-8B has 32; the bytes per token are the
    same with fewer)."""
    long_reference_max: int = 65536
    """Longest sample held to the float32 reference forward (longer: stated, not compared)."""
    routing: str = "proxy"
    """MoE equality: "proxy" replays the server's expert choices (recorded by
    tests/gpu/proxy.py); "free": the dense prefix row by row, the rest under hsq's MoE
    allowance (tests/gpu/equality.compare_moe), no proxy between worker and server."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LiveSettings:
        e = os.environ if env is None else env
        unknown = sorted(k for k in e if k.startswith(PREFIX) and k[len(PREFIX) :] not in _KNOWN)
        if unknown:
            raise LiveSettingsError(f"unknown live settings {unknown}; known: {sorted(_KNOWN)}")

        def path(name: str) -> Path | None:
            v = e.get(PREFIX + name, "")
            return Path(v) if v else None

        version = e.get(PREFIX + "SGLANG_VERSION") or None
        if version is not None and not _is_version(version):
            raise LiveSettingsError(f"{PREFIX}SGLANG_VERSION={version!r}: expected X.Y.Z")
        s = cls(
            work=path("WORK"),
            dump_root=path("DUMP_ROOT"),
            models=path("MODELS"),
            results=path("RESULTS"),
            sglang_version=version,
            tp=_int(e, "TP", 1, low=1, high=8),
            samples=_int(e, "SAMPLES", 300, low=10, high=100_000),
            moe_samples=_int(e, "MOE_SAMPLES", 120, low=10, high=100_000),
            audit_samples=_int(e, "AUDIT_SAMPLES", 40, low=2, high=10_000),
            inflight=_int(e, "INFLIGHT", 8, low=1, high=256),
            chunk=_int(e, "CHUNK", 1024, low=1024, high=65536),
            kill=_flag(e, "KILL", True),
            start_timeout=float(_int(e, "START_TIMEOUT", 600, low=30, high=3600)),
            routing=_choice(e, "ROUTING", "proxy", ("proxy", "free")),
            long=_ints(e, "LONG", (16384, 32768, 65536), low=1024, high=262144),
            long_layers=_int(e, "LONG_LAYERS", 8, low=4, high=80),
            long_reference_max=_int(e, "LONG_REFERENCE_MAX", 65536, low=0, high=262144),
        )
        return s


_KNOWN = {
    "WORK",
    "DUMP_ROOT",
    "MODELS",
    "RESULTS",
    "SGLANG_VERSION",
    "TP",
    "SAMPLES",
    "MOE_SAMPLES",
    "AUDIT_SAMPLES",
    "INFLIGHT",
    "CHUNK",
    "KILL",
    "START_TIMEOUT",
    "ROUTING",
    "LONG",
    "LONG_LAYERS",
    "LONG_REFERENCE_MAX",
}


def _is_version(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 3 and all(p.isdigit() for p in parts)


def _int(env: Mapping[str, str], name: str, default: int, *, low: int, high: int) -> int:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise LiveSettingsError(f"{PREFIX}{name}={raw!r}: expected an integer") from None
    if not low <= value <= high:
        raise LiveSettingsError(f"{PREFIX}{name}={value}: expected {low}..{high}")
    return value


def _ints(
    env: Mapping[str, str], name: str, default: tuple[int, ...], *, low: int, high: int
) -> tuple[int, ...]:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        values = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise LiveSettingsError(f"{PREFIX}{name}={raw!r}: expected integers, a,b,c") from None
    if not all(low <= v <= high for v in values):
        raise LiveSettingsError(f"{PREFIX}{name}={raw!r}: expected each within {low}..{high}")
    return values


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(PREFIX + name) or default
    if raw not in choices:
        raise LiveSettingsError(f"{PREFIX}{name}={raw!r}: expected one of {list(choices)}")
    return raw


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise LiveSettingsError(f"{PREFIX}{name}={raw!r}: expected 0 or 1")
    return raw == "1"
