"""`hsq export --format manifest`: `manifest.jsonl` in the run's output directory, the list
hsq.data reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hsq.data import MANIFEST
from hsq.errors import OutputError
from hsq.fsio import write_durably
from hsq.ops.export.common import check_complete, checked_entry, log, without_consumed

if TYPE_CHECKING:
    from hsq.runstore import RunStore


def export_manifest(store: RunStore, root: Path, *, partial: bool = False) -> int:
    """Write `root/manifest.jsonl` (sorted by path) from the run's manifest; returns lines."""
    check_complete(store, partial)
    rows = []
    for sid, raw in without_consumed(store):
        try:
            e = checked_entry(sid, raw)
        except OutputError as exc:
            log.warning("manifest_entry_skipped", sample_id=sid, error=str(exc))
            continue
        line = {"id": sid, "path": e.path, "num_tokens": e.num_tokens, "bytes": e.bytes}
        rows.append((e.path, json.dumps(line)))
    rows.sort()
    text = "".join(line + "\n" for _, line in rows).encode()
    write_durably(root / MANIFEST, lambda fd: os.write(fd, text))
    return len(rows)
