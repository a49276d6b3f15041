"""A run's configuration as recorded in Redis by the producer and read by every worker."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hsq import jsonsafe
from hsq.errors import ConfigError
from hsq.settings import int_list_or_none, setting
from hsq.states import BF16, STORE_DTYPES

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_CHUNK_SIZE = 16
# How a run's outputs store hidden states (RunConfig.store_dtype; hsq/quant.py does the FP8
# part). The names are hsq.states' (stdlib only), not hsq.quant's, so that the run config,
# and the Redis gateway that reads it, import no file format (tests/test_layers.py).


def check_store_dtype(name: str) -> str:
    if name not in STORE_DTYPES:
        raise ConfigError(f"store dtype must be one of {', '.join(STORE_DTYPES)}, not {name!r}")
    return name


@dataclass(frozen=True)
class RunConfig:
    """Fields with setting() are given to `hsq enqueue` / `hsq recover` (hsq.cli.options)."""

    run: str
    dataset: str
    """Absolute path; readable at that path on every worker node."""
    out: str
    """Absolute output root; files go to <out>/<run>/."""
    max_attempts: int = setting(
        DEFAULT_MAX_ATTEMPTS, help="tries of a sample before it goes to the dead letter"
    )
    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE,
        help="samples per queue job (queue cost is paid per job); default: 16, more for a "
        "dataset of more than ~260k lines (up to 1024)",
    )
    layer_ids: list[int] | None = setting(
        None,
        flag="--layers",
        parse=int_list_or_none,
        help="expected effective aux layer ids; default: pinned by the first valid dump",
    )
    model_id: str | None = setting(
        None, help="expected model id (name@digest); default: pinned by the first valid dump"
    )
    max_tokens: int | None = setting(None, help="reject longer samples up front")
    dump_dtype: str | None = None
    """Expected dtype of the dumped states; None: pinned by the first valid dump."""
    hidden_size: int | None = None
    """Expected hidden size; None: pinned by the first valid dump."""
    created: float = field(default_factory=time.time)
    store_dtype: str = setting(
        BF16,
        choices=STORE_DTYPES,
        default_text="bf16, or what the run already has",
        help="how outputs store hidden states (fp8-e4m3: per-token scaled, about half the "
        "bytes); a run keeps one",
    )
    """bf16 or fp8-e4m3 (hsq/quant.py). Runs recorded before the field existed read as
    bf16, which is what they stored."""
    generation: str | None = None
    """Set by the store when the run is created; a purge and re-create changes it."""
    prenorm: bool = setting(
        False,
        help="also store the final layer's state before the model's final norm "
        "(last_hidden_state_prenorm, what vLLM speculators trains on); every server must "
        "capture it (serve-reference --prenorm, SGLang SGLANG_HS_PRENORM=1); a run keeps one",
    )
    """Runs recorded before the field existed read as False, which is what they stored."""

    def validate(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("--max-attempts must be >= 1")
        if not 1 <= self.chunk_size <= 4096:
            raise ConfigError("--chunk-size must be within [1, 4096]")
        check_store_dtype(self.store_dtype)

    def to_redis(self) -> dict[str, str]:
        # Unset fields are left out, so workers can pin them atomically with HSETNX.
        return {k: json.dumps(v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> RunConfig:
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        try:
            for k, v in raw.items():
                key = k.decode()
                if key in known:
                    values[key] = jsonsafe.loads(v)
            return cls(**values)
        except (ValueError, TypeError) as exc:  # Redis is untrusted too
            raise ConfigError(f"the run's config in Redis is unreadable: {exc}") from exc

    def conflicts(self, other: RunConfig) -> list[str]:
        """Settings a second `enqueue` may not change for an existing run."""
        names = ("dataset", "out", "layer_ids", "model_id", "store_dtype", "prenorm")
        return [
            f"{n}: recorded {getattr(self, n)!r}, given {getattr(other, n)!r}"
            for n in names
            if getattr(other, n) is not None and getattr(self, n) != getattr(other, n)
        ]
