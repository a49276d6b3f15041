"""Operating a run: status, requeue, verify and repair, purge. The CLI only formats.

One module per concern: status.py (`hsq status`, `hsq runs`, the figures the exporter
serves), requeue.py, verify.py (verify, repair, the trusted read of a manifest entry).
The names below are the ones docs/ and the other commands use.
"""

from __future__ import annotations

from hsq.ops.requeue import RequeueResult, requeue, select_for_requeue
from hsq.ops.status import (
    DeadSample,
    RunFigures,
    RunStatus,
    WorkerStatus,
    dead_samples,
    dead_text,
    dumps_json,
    recount,
    run_figures,
    run_status,
    status_text,
)
from hsq.ops.verify import VerifyResult, repair, trusted_entry, verify
from hsq.runstore import RunStore

__all__ = [
    "DeadSample",
    "RequeueResult",
    "RunFigures",
    "RunStatus",
    "VerifyResult",
    "WorkerStatus",
    "dead_samples",
    "dead_text",
    "dumps_json",
    "purge",
    "recount",
    "repair",
    "requeue",
    "run_figures",
    "run_status",
    "select_for_requeue",
    "status_text",
    "trusted_entry",
    "verify",
]


def purge(store: RunStore) -> int:
    """Delete every Redis key of a run (outputs on disk stay). Returns keys deleted."""
    return store.lifecycle.purge()
