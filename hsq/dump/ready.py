"""The readiness marker: what a server with an active dump hook announces in its dump dir.

A worker reads it before its first request: without it every sample would time out with
no_dump (a hook that never loaded), so the worker refuses to start instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hsq import fsio
from hsq.dump.format import (
    FORMAT_2_DEFAULTS,
    READ_VERSIONS,
    ModelIdentity,
    Versioned,
    format_version_for,
    is_int,
    load_bounded,
)
from hsq.errors import CorruptDumpError, HookInactiveError
from hsq.states import ENCODINGS, PLAIN

READY_FILE = "hsq-ready.json"
"""Written by a server once its dump hook is active; not a req_* name, so never cleared."""
READY_MAX_BYTES = 64 * 1024
_READY_MAX_STR = 4096
_READY_MAX_LAYERS = 1024


@dataclass(frozen=True)
class ReadyMarker(Versioned):
    """What a server with an active dump hook announces in its dump dir."""

    layer_ids: tuple[int, ...]
    """Effective HF hidden_states indices, as every dump's meta.json will record them."""
    model: ModelIdentity
    server: str
    """"sglang" or "hsq-reference"."""
    server_version: str
    hook_version: str
    """hsq's version (hsq.__version__) in the server's environment."""
    pid: int
    created_unix: float
    format_version: int = 0
    """The dump format the server writes (0, the default: derived from encoding and
    prenorm, as for DumpMeta); a worker refuses formats it cannot read."""
    encoding: str = PLAIN
    """How the server encodes its dumps: `plain` or `fp8-e4m3` (format 2)."""
    prenorm: bool = False
    """Whether every dump holds last_hidden_state_prenorm (format 2)."""

    def to_json(self) -> str:
        data = asdict(self)
        data["layer_ids"] = list(self.layer_ids)
        return self.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> ReadyMarker:
        """Strict: exact keys, exact types, bounded sizes; HookInactiveError otherwise."""
        raw = load_bounded(text, READY_MAX_BYTES, READY_FILE, HookInactiveError)
        required = {f.name for f in fields(cls)} - set(_READY_OPTIONAL)
        obj = _ready_obj(raw, required, READY_FILE, optional=set(_READY_OPTIONAL))
        model = _ready_obj(obj["model"], {f.name for f in fields(ModelIdentity)}, "model")
        layers = obj["layer_ids"]
        if (
            not isinstance(layers, list)
            or not 0 < len(layers) <= _READY_MAX_LAYERS
            or not all(is_int(i) and i >= 0 for i in layers)
        ):
            raise HookInactiveError(f"{READY_FILE}: layer_ids must be a list of ints >= 0")
        marker = cls(
            layer_ids=tuple(layers),
            model=ModelIdentity(
                name=_ready_str(model, "name"),
                architecture=_ready_str(model, "architecture"),
                num_layers=_ready_int(model, "num_layers"),
                hidden_size=_ready_int(model, "hidden_size"),
                config_digest=_ready_str(model, "config_digest"),
            ),
            server=_ready_str(obj, "server"),
            server_version=_ready_str(obj, "server_version"),
            hook_version=_ready_str(obj, "hook_version"),
            pid=_ready_int(obj, "pid"),
            created_unix=_ready_float(obj, "created_unix"),
            format_version=_ready_int(obj, "format_version"),
            encoding=_ready_str(obj, "encoding") if "encoding" in obj else PLAIN,
            prenorm=_ready_bool(obj, "prenorm") if "prenorm" in obj else False,
        )
        if marker.format_version not in READ_VERSIONS:
            raise HookInactiveError(
                f"the server writes dump format {marker.format_version}, this hsq reads "
                f"{' and '.join(map(str, READ_VERSIONS))}"
            )
        if marker.encoding not in ENCODINGS:
            raise HookInactiveError(f"{READY_FILE}: unknown encoding {marker.encoding!r}")
        if marker.format_version < format_version_for(marker.encoding, marker.prenorm):
            raise HookInactiveError(
                f"{READY_FILE}: format {marker.format_version} cannot describe encoding "
                f"{marker.encoding!r} with prenorm={marker.prenorm}"
            )
        return marker


_READY_OPTIONAL = FORMAT_2_DEFAULTS
"""Marker keys of format 2, left out of a format 1 marker (a strict reader of format 1
refuses keys it does not know)."""


def _ready_obj(
    raw: object, keys: set[str], what: str, optional: set[str] | None = None
) -> dict[str, object]:
    if not isinstance(raw, dict):
        raise HookInactiveError(f"{READY_FILE}: {what} is not an object")
    if set(raw) - (optional or set()) != keys:
        raise HookInactiveError(f"{READY_FILE}: {what} keys {sorted(raw)}, expected {sorted(keys)}")
    return raw


def _ready_bool(obj: Mapping[str, object], key: str) -> bool:
    v = obj[key]
    if not isinstance(v, bool):
        raise HookInactiveError(f"{READY_FILE}: {key} must be true or false")
    return v


def _ready_str(obj: Mapping[str, object], key: str) -> str:
    v = obj[key]
    if not isinstance(v, str) or not v or len(v) > _READY_MAX_STR:
        raise HookInactiveError(f"{READY_FILE}: {key} must be a non-empty string")
    return v


def _ready_int(obj: Mapping[str, object], key: str) -> int:
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
        raise HookInactiveError(f"{READY_FILE}: {key} must be an integer >= 0")
    return v


def _ready_float(obj: Mapping[str, object], key: str) -> float:
    v = obj[key]
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise HookInactiveError(f"{READY_FILE}: {key} must be a finite number")
    return float(v)


def write_ready(dump_dir: Path, marker: ReadyMarker, *, fsync: bool = True) -> Path:
    """Write the marker atomically (temp file, fsync, rename): a reader sees all or none."""
    final = dump_dir / READY_FILE
    data = marker.to_json().encode()
    fsio.write_atomically(final, lambda fd: os.write(fd, data), fsync=fsync, mode=0o600)
    return final


def read_ready(dump_dir: Path) -> ReadyMarker | None:
    """The server's marker; None while there is none. HookInactiveError if unusable."""
    try:
        data = fsio.read_regular(dump_dir / READY_FILE, READY_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, CorruptDumpError) as exc:
        raise HookInactiveError(f"cannot read {dump_dir / READY_FILE}: {exc}") from exc
    return ReadyMarker.from_json(data)
