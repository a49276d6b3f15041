"""What `hsq launch-sglang` and `hsq launch-vllm` share: their common flags, a local
checkpoint's config, and the dump dir a launched server writes into.

Apart from hsq/engines/common.py so a launcher's `--help` (and SGLang's launcher, which
reads these settings before torch loads) imports no dump format and no msgspec
(tests/test_cli_start.py checks what each command's help imports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsq.settings import setting
from hsq.states import ENCODINGS, PLAIN

MAX_CONFIG_BYTES = 4 * 2**20
"""A checkpoint's config.json read by a launcher: far larger is not a config."""


@dataclass(frozen=True)
class LaunchCommon:
    """The flags `hsq launch-sglang` and `hsq launch-vllm` both take."""

    host: str = setting("127.0.0.1", help="address to listen on")
    tp: int = setting(1, help="tensor parallel size (GPUs of one server)")
    dump_encoding: str = setting(
        PLAIN,
        choices=ENCODINGS,
        help="fp8-e4m3: the server quantizes the states as fp8 outputs store them (for runs "
        "enqueued with --store-dtype fp8-e4m3)",
    )
    prenorm: bool = setting(False, help="also dump the final norm's input (runs with --prenorm)")
    print_only: bool = setting(False, help="print the command, start nothing")


def read_local_config(model_path: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json; None for a hub id or an unreadable file (the
    server checks again once it has loaded the model)."""
    try:
        with open(Path(model_path) / "config.json", "rb") as f:
            config = json.loads(f.read(MAX_CONFIG_BYTES))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def prepare_dump_dir(dump_dir: Path) -> None:
    """The dump dir a launched server writes into: private to the one worker that owns it,
    and without an earlier server's marker."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    dump_dir.chmod(0o700)
    from hsq.engines.common import forget_marker  # the dump format: when launching only

    forget_marker(dump_dir)
