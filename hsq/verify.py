"""Check a run's outputs on disk against its manifest (the done hash)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hsq.outputs import ManifestEntry, check_output
from hsq.store import RunStore


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)
    """sample id -> what is wrong with its file."""


def verify_run(
    store: RunStore,
    out_root: Path,
    *,
    deep: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    report = VerifyReport()
    for raw_id, raw_entry in store.r.hscan_iter(store.k.done, count=1000):
        sid = raw_id.decode()
        entry = ManifestEntry.from_json(raw_entry)
        problems = check_output(out_root / entry.path, sid, entry, deep=deep)
        report.checked += 1
        if problems:
            report.problems[sid] = problems
        else:
            report.ok += 1
        if on_progress is not None:
            on_progress(1)
    return report
