"""The hook's settings, read once from the environment of each SGLang process.

Environment, not flags: SGLang's argument parser rejects flags it does not know, and the
environment reaches every spawned scheduler process unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hsq.engines.sglang.layers import parse_layer_ids
from hsq.states import ENCODINGS, PLAIN  # torch-free: this module loads before torch

ENV_PREFIX = "SGLANG_HS_"
ENV_DUMP_DIR = "SGLANG_HS_DUMP_DIR"
ENV_LAYER_IDS = "SGLANG_HS_LAYER_IDS"
ENV_RID_PREFIX = "SGLANG_HS_RID_PREFIX"
ENV_QUEUE_ITEMS = "SGLANG_HS_QUEUE_ITEMS"
ENV_QUEUE_MB = "SGLANG_HS_QUEUE_MB"
ENV_EVICT_AFTER_S = "SGLANG_HS_EVICT_AFTER_S"
ENV_FSYNC = "SGLANG_HS_FSYNC"
ENV_DUMP_ENCODING = "SGLANG_HS_DUMP_ENCODING"
ENV_PRENORM = "SGLANG_HS_PRENORM"
ENV_DEVICE_STAGING = "SGLANG_HS_DEVICE_STAGING"
KNOWN_ENV = frozenset(
    {
        ENV_DUMP_DIR,
        ENV_LAYER_IDS,
        ENV_RID_PREFIX,
        ENV_QUEUE_ITEMS,
        ENV_QUEUE_MB,
        ENV_EVICT_AFTER_S,
        ENV_FSYNC,
        ENV_DUMP_ENCODING,
        ENV_PRENORM,
        ENV_DEVICE_STAGING,
    }
)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class HookConfig:
    dump_dir: Path
    layer_ids: tuple[int, ...] | None = None
    """EAGLE-3 ids as a drafter config names them (SGLang applies its +1 rule); None:
    SGLang's default. The effective HF indices are what meta.json records."""
    rid_prefix: str = ""
    """Dump only rids starting with this (e.g. "hsq-"); health checks and rid-less
    requests (SGLang's warm-up) are never dumped."""
    queue_items: int = 8
    """Forwards whose host copies may wait for the writer before the scheduler blocks."""
    queue_bytes: int = 8 << 30
    """Bytes of queued host copies before the scheduler blocks (one larger batch is
    still admitted when the queue is empty, so no batch can deadlock)."""
    evict_after_s: float = 600.0
    """Drop the chunks of a request not seen for this long (aborted, client gone)."""
    fsync: bool = True
    encoding: str = PLAIN
    """`fp8-e4m3`: quantize on the GPU as fp8 outputs store the states (per-token
    absmax/448 scales); only runs enqueued with --store-dtype fp8-e4m3 take such dumps."""
    prenorm: bool = False
    """Also dump the final norm's input (last_hidden_state_prenorm), for runs enqueued
    with --prenorm; refused at start-up for model families whose final norm is not known."""
    device_staging: bool = False
    """Clone the captured rows on the GPU first, so the next forward does not wait for
    the copy to the host (costs GPU memory for one forward's states until it lands).
    fp8 dumps always work this way: their quantized tensors are the hook's own."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HookConfig | None:
        """None when SGLANG_HS_DUMP_DIR is unset (the hook stays off); ValueError on a
        typo'd SGLANG_HS_* name or a bad value, so a misconfiguration never runs silently."""
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in KNOWN_ENV)
        if unknown:
            raise ValueError(f"unknown settings {unknown}; known: {sorted(KNOWN_ENV)}")
        raw_dir = env.get(ENV_DUMP_DIR, "").strip()
        if not raw_dir:
            return None
        cfg = cls(
            dump_dir=Path(raw_dir),
            layer_ids=parse_layer_ids(env.get(ENV_LAYER_IDS)),
            rid_prefix=env.get(ENV_RID_PREFIX, ""),
            queue_items=_int(env, ENV_QUEUE_ITEMS, cls.queue_items),
            queue_bytes=_int(env, ENV_QUEUE_MB, cls.queue_bytes >> 20) << 20,
            evict_after_s=float(env.get(ENV_EVICT_AFTER_S, cls.evict_after_s)),
            fsync=env.get(ENV_FSYNC, "1").strip().lower() not in ("0", "false", "no"),
            encoding=env.get(ENV_DUMP_ENCODING, PLAIN).strip() or PLAIN,
            prenorm=_bool(env, ENV_PRENORM),
            device_staging=_bool(env, ENV_DEVICE_STAGING),
        )
        if cfg.queue_items < 1 or cfg.queue_bytes < 1 or cfg.evict_after_s <= 0:
            raise ValueError(f"queue sizes and eviction time must be positive: {cfg}")
        if cfg.encoding not in ENCODINGS:
            raise ValueError(
                f"{ENV_DUMP_ENCODING} must be one of {', '.join(ENCODINGS)}, not {cfg.encoding!r}"
            )
        return cfg

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces this config (for launch commands)."""
        env = {ENV_DUMP_DIR: str(self.dump_dir)}
        if self.layer_ids is not None:
            env[ENV_LAYER_IDS] = ",".join(str(i) for i in self.layer_ids)
        if self.rid_prefix:
            env[ENV_RID_PREFIX] = self.rid_prefix
        if self.encoding != PLAIN:
            env[ENV_DUMP_ENCODING] = self.encoding
        if self.prenorm:
            env[ENV_PRENORM] = "1"
        if self.device_staging:
            env[ENV_DEVICE_STAGING] = "1"
        return env


def _bool(env: Mapping[str, str], key: str) -> bool:
    raw = env.get(key, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{key} must be 1 or 0, got {raw!r}")


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {raw!r}") from None
