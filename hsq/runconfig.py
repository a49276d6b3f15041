"""A run's configuration as recorded in Redis by the producer and read by every worker."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hsq import jsonsafe
from hsq.errors import ConfigError
from hsq.settings import int_list_or_none, setting
from hsq.states import BF16, FP8, STORE_DTYPES

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_CHUNK_SIZE = 16
# How a run's outputs store hidden states (RunConfig.store_dtype; hsq/quant.py does the FP8
# part). The names are hsq.states' (stdlib only), not hsq.quant's, so that the run config,
# and the Redis gateway that reads it, import no file format (tests/test_layers.py).


def check_store_dtype(name: str) -> str:
    if name not in STORE_DTYPES:
        raise ConfigError(f"store dtype must be one of {', '.join(STORE_DTYPES)}, not {name!r}")
    return name


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
DEFAULT_GROUP = "train"
HEADER_ALLOWANCE = 4 * 2**10
"""Bytes an output file holds besides its tensors (the safetensors header and metadata),
at most: a reservation's margin before the file's real size replaces it."""


def parse_size(text: str) -> int:
    """ "64G" -> 64 GiB in bytes; plain digits are bytes; K/M/G/T are powers of 1024."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        raise ValueError(f"a size is bytes or a number with K/M/G/T, not {text!r}") from None
    if n < 0:
        raise ValueError(f"a size is not negative: {text!r}")
    return int(n * _SIZE_UNITS[unit])


def size_text(n: float) -> str:
    """Bytes for people: 512B, 3.2K, 64.0G (powers of 1024, as parse_size reads them)."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


@dataclass(frozen=True)
class ModelShape:
    """The shape of the states a run's servers will dump, read off the model before any
    starts (`hsq run`: the checkpoint's config.json, or the reference server's named
    shape). It sizes the spool's check at enqueue and pins nothing: the first valid dump
    still does."""

    hidden_size: int
    layer_ids: list[int] | None
    """The engine's default aux layers for the model; None: the servers are given their
    own `--layers`, so only the run's recorded layers count."""
    source: str
    """Where it was read, in words ("config.json of /m/qwen3-8b")."""


def parse_groups(text: str) -> list[str] | None:
    """ "train,ablate" -> ["train", "ablate"]: consumer group names, each a plain name."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if not GROUP_RE.fullmatch(name):
            raise ValueError(f"consumer group {name!r} must match {GROUP_RE.pattern}")
    if len(set(names)) != len(names):
        raise ValueError(f"consumer groups named twice: {text!r}")
    return names or None


RUN_SECTION = "Run settings"
"""The --help heading of the settings a run records that a first run leaves alone."""


@dataclass(frozen=True)
class RunConfig:
    """Fields with setting() are given to `hsq enqueue` / `hsq recover` (hsq.cli.options)."""

    run: str
    dataset: str
    """Absolute path; readable at that path on every worker node."""
    out: str
    """Absolute output root; files go to <out>/<run>/."""
    max_attempts: int = setting(
        DEFAULT_MAX_ATTEMPTS,
        section=RUN_SECTION,
        help="tries of a sample before it goes to the dead letter",
    )
    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE,
        section=RUN_SECTION,
        help="samples per queue job (queue cost is paid per job); default: 16, more for a "
        "dataset of more than ~260k lines (up to 1024)",
    )
    layer_ids: list[int] | None = setting(
        None,
        flag="--layers",
        parse=int_list_or_none,
        metavar="IDS",
        section=RUN_SECTION,
        help="expected effective aux layer ids; default: pinned by the first valid dump",
    )
    model_id: str | None = setting(
        None,
        section=RUN_SECTION,
        help="expected model id (name@digest); default: pinned by the first valid dump",
    )
    max_tokens: int | None = setting(
        None, section=RUN_SECTION, help="reject longer samples up front"
    )
    dump_dtype: str | None = None
    """Expected dtype of the dumped states; None: pinned by the first valid dump."""
    hidden_size: int | None = setting(
        None,
        minimum=1,
        section=RUN_SECTION,
        help="expected hidden size; default: pinned by the first valid dump (with --layers "
        "it checks --spool-budget against the largest sample at enqueue)",
    )
    created: float = field(default_factory=time.time)
    store_dtype: str = setting(
        BF16,
        choices=STORE_DTYPES,
        default_text="bf16, or the run's",
        section=RUN_SECTION,
        help="how outputs store the states (fp8-e4m3: per-token scaled, half the bytes); a "
        "run keeps one",
    )
    """bf16 or fp8-e4m3 (hsq/quant.py). Runs recorded before the field existed read as
    bf16, which is what they stored."""
    generation: str | None = None
    """Set by the store when the run is created; a purge and re-create changes it."""
    prenorm: bool = setting(
        False,
        help="also store the pre-norm final state (vLLM speculators trains on it); a run keeps one",
    )
    """Runs recorded before the field existed read as False, which is what they stored."""

    spool_budget: int | None = setting(
        None,
        parse=parse_size,
        metavar="SIZE",
        help="stream: outputs stay on disk until each consumer group commits them; at most "
        "this much (K/M/G/T)",
    )
    """None or 0: no stream, an offline run (every output stays)."""
    consumers: list[str] | None = setting(
        None,
        parse=parse_groups,
        default_text="train",
        section=RUN_SECTION,
        help="a streamed run's consumer groups (comma-separated): each gets every sample once",
    )
    keep_after_commit: bool = setting(
        False,
        section=RUN_SECTION,
        help="a streamed run keeps each output after every group committed it",
    )

    @property
    def streamed(self) -> bool:
        return bool(self.spool_budget)

    @property
    def groups(self) -> list[str]:
        """The consumer groups of a streamed run (none for an offline one)."""
        if not self.streamed:
            return []
        return list(self.consumers or [DEFAULT_GROUP])

    def spool_bytes_per_token(self) -> int | None:
        """Bytes per token of an output file's tensors (exact for the store dtype, the
        layers and the pre-norm state), or None while the layers or hidden size are not
        known yet (pinned by the first valid dump)."""
        if self.layer_ids is None or self.hidden_size is None:
            return None
        states = len(self.layer_ids) + 1 + int(self.prenorm)
        if self.store_dtype == FP8:  # one byte a value, a float32 scale per row and tensor
            per = states * self.hidden_size + 4 * (len(self.layer_ids) + 1 + int(self.prenorm))
        else:
            per = states * self.hidden_size * 2
        return per + 16  # input_ids and loss_mask: int64 each

    def spool_estimate(self, tokens: int) -> int | None:
        """The bytes to reserve for a sample's output (None: not known yet)."""
        per = self.spool_bytes_per_token()
        return None if per is None else tokens * per + HEADER_ALLOWANCE

    def validate(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("--max-attempts must be >= 1")
        if not 1 <= self.chunk_size <= 4096:
            raise ConfigError("--chunk-size must be within [1, 4096]")
        check_store_dtype(self.store_dtype)
        if self.spool_budget is not None and self.spool_budget < 0:
            raise ConfigError("--spool-budget must be >= 0")

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
        names = (
            "dataset", "out", "layer_ids", "model_id", "hidden_size", "store_dtype", "prenorm",
            "consumers",
        )  # fmt: skip
        return [
            f"{n}: recorded {getattr(self, n)!r}, given {getattr(other, n)!r}"
            for n in names
            if getattr(other, n) is not None and getattr(self, n) != getattr(other, n)
        ]
