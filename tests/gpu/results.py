"""The live run's figures: one JSON document, rewritten (atomically) after every record,
so a run cut short by its time limit still leaves what it measured."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


class Results:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        self._lock = threading.Lock()

    def record(self, section: str, **figures: Any) -> None:
        with self._lock:
            self.data.setdefault(section, {}).update(figures)
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            os.replace(tmp, self.path)

    def say(self, msg: str) -> None:
        print(f"[live] {msg}", flush=True)
