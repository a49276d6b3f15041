"""The connector's settings: the ``kv_connector_extra_config`` of vLLM's
``--kv-transfer-config``, read once in every process that builds the connector.

JSON from the command line, so untrusted in shape: unknown ``hsq_*`` keys and wrong
types are refused (a typo must not run silently). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hsq.dump.format import is_int
from hsq.states import ENCODINGS, PLAIN

KEY_DUMP_DIR = "shared_storage_path"
"""vLLM's own key (ExampleHiddenStatesConnector reads it too): the worker's dump dir."""
KEY_LAYER_IDS = "hsq_layer_ids"
KEY_ENCODING = "hsq_dump_encoding"
KEY_PRENORM = "hsq_prenorm"
KEY_FSYNC = "hsq_fsync"
KEY_MODEL_PATH = "hsq_model_path"
HSQ_KEYS = frozenset({KEY_LAYER_IDS, KEY_ENCODING, KEY_PRENORM, KEY_FSYNC, KEY_MODEL_PATH})
RID_PARAM = "hsq_rid"
"""The key of a request's ``kv_transfer_params`` that carries the worker's rid."""
MAX_LAYERS = 1024


@dataclass(frozen=True)
class ConnectorConfig:
    dump_dir: Path
    layer_ids: tuple[int, ...]
    """The run's aux layers in hsq's convention (HF hidden_states indices), in the order
    the dump's aux tensor holds them."""
    encoding: str = PLAIN
    """`fp8-e4m3`: the server quantizes (as fp8 outputs store the states)."""
    prenorm: bool = False
    """Also dump the final norm's input (runs enqueued with --prenorm)."""
    fsync: bool = True
    model_path: str | None = None
    """Where the checkpoint's files are, when vLLM's model name is not a directory (a hub
    id): the final norm's weight is read from there."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> ConnectorConfig:
        unknown = sorted(k for k in extra if k.startswith("hsq_") and k not in HSQ_KEYS)
        if unknown:
            raise ValueError(f"unknown settings {unknown}; known: {sorted(HSQ_KEYS)}")
        raw_dir = extra.get(KEY_DUMP_DIR)
        if not isinstance(raw_dir, str) or not raw_dir.strip():
            raise ValueError(f"{KEY_DUMP_DIR} must name the worker's dump dir")
        layers = extra.get(KEY_LAYER_IDS)
        if (
            not isinstance(layers, list)
            or not 0 < len(layers) <= MAX_LAYERS
            or not all(is_int(i) and i >= 0 for i in layers)
        ):
            raise ValueError(f"{KEY_LAYER_IDS} must be a non-empty list of layer ids >= 0")
        if len(set(layers)) != len(layers):
            raise ValueError(f"{KEY_LAYER_IDS} {layers} repeats a layer")
        encoding = extra.get(KEY_ENCODING, PLAIN)
        if encoding not in ENCODINGS:
            raise ValueError(f"{KEY_ENCODING} must be one of {', '.join(ENCODINGS)}")
        model_path = extra.get(KEY_MODEL_PATH)
        if model_path is not None and not isinstance(model_path, str):
            raise ValueError(f"{KEY_MODEL_PATH} must be a path")
        return cls(
            dump_dir=Path(raw_dir),
            layer_ids=tuple(layers),
            encoding=str(encoding),
            prenorm=_flag(extra, KEY_PRENORM, False),
            fsync=_flag(extra, KEY_FSYNC, True),
            model_path=model_path,
        )

    def to_extra(self) -> dict[str, object]:
        """The ``kv_connector_extra_config`` that reproduces this config."""
        extra: dict[str, object] = {
            KEY_DUMP_DIR: str(self.dump_dir),
            KEY_LAYER_IDS: list(self.layer_ids),
            # hsq's dumps are complete once renamed: no per-file lock files in the dump dir.
            "use_synchronization_lock": False,
        }
        if self.encoding != PLAIN:
            extra[KEY_ENCODING] = self.encoding
        if self.prenorm:
            extra[KEY_PRENORM] = True
        if not self.fsync:
            extra[KEY_FSYNC] = False
        if self.model_path is not None:
            extra[KEY_MODEL_PATH] = self.model_path
        return extra


def _flag(extra: Mapping[str, object], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, not {value!r}")
    return value
