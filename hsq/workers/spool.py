"""Admission by a streamed run's byte budget: before a sample is sent, its output's bytes
are reserved in the spool (hsq/store/spool.py, atomically against the budget). While the
spool is full the worker sends nothing more and shows why (cause `spool_full`: `hsq
status`, the live view, the metrics); it asks again after FIRST_RETRY_S, doubling up to
RETRY_S, so it goes on within tens of milliseconds of a short pause (the first sample,
which reserves the whole budget until its done mark sets its size, or a commit just due)
and costs a few calls a second in a long one (a stalled trainer). A run without a stream
costs nothing here (no Redis call).

The reservation is the sample's tokens times the run's exact bytes per token (store dtype,
layers, pre-norm state) plus a header allowance; before the first dump pinned the layers
and hidden size it is the whole budget (the sample goes alone). The done mark sets it to
the file's real size in the same step, so what the spool counts is what is on disk.
"""

from __future__ import annotations

import dataclasses
import time

import structlog

from hsq.outputs.manifest import ManifestEntry
from hsq.store import SampleOverBudget, WorkerStore
from hsq.workers.chunks import WorkItem
from hsq.workers.pauses import Pauses
from hsq.workers.policy import Pause
from hsq.workers.runview import RunView

log = structlog.get_logger("hsq.worker")

RETRY_S = 0.25
FIRST_RETRY_S = 0.02
"""A full spool is asked again after 20 ms, 40, 80, 160, then every RETRY_S (measured: a
fixed 0.25 s held a worker 0.5 s of a 3 s streamed run, once for its first sample)."""


class SpoolGate:
    def __init__(self, store: WorkerStore[ManifestEntry], pauses: Pauses) -> None:
        self.store = store
        self.pauses = pauses
        self.paused_s = 0.0
        """Seconds this worker was held back by a full spool (metrics)."""
        self._full_since: float | None = None
        self._retry_at = 0.0
        self._delay = FIRST_RETRY_S

    @property
    def full(self) -> bool:
        return self._full_since is not None

    def held_for(self) -> float:
        """Seconds before the next reservation is tried (0: now)."""
        return max(0.0, self._retry_at - time.monotonic()) if self.full else 0.0

    def admit(self, item: WorkItem, view: RunView) -> bool:
        """Reserve the sample's bytes; False: the spool is full, send nothing now."""
        cfg = view.cfg
        if not cfg.streamed:
            return True
        pinned = dataclasses.replace(
            cfg, layer_ids=view.pins.get("layer_ids"), hidden_size=view.pins.get("hidden_size")
        )
        nbytes = pinned.spool_estimate(item.tokens)
        now = time.monotonic()
        try:
            reserved = self.store.reserve_spool(item.sample_id, nbytes)
        except SampleOverBudget as exc:
            return self._too_small(item, exc, now)
        if reserved:
            self._delay = FIRST_RETRY_S
            if self._full_since is not None:
                self.paused_s += now - self._full_since
                log.info("spool_has_room", paused_s=round(now - self._full_since, 3))
                self._full_since = None
            return True
        if self._full_since is None:
            self._full_since = now
            log.info("spool_full", budget=cfg.spool_budget, sample=item.sample_id)
        self.pauses.note(
            Pause.SPOOL_FULL,
            f"the spool holds its budget of {cfg.spool_budget} bytes: waiting for the "
            "consumers to commit",
        )
        self._retry_at = now + self._delay
        self._delay = min(RETRY_S, self._delay * 2)
        return False

    def _too_small(self, item: WorkItem, exc: SampleOverBudget, now: float) -> bool:
        """The sample can never fit the budget: pause (the sample stays queued with this
        worker, nothing is dead-lettered) and say the number needed, until it is raised."""
        if self._full_since is None:
            self._full_since = now
            log.error(
                "spool_budget_too_small", budget=exc.budget, needed=exc.needed,
                sample=item.sample_id,
            )  # fmt: skip
        self.pauses.note(
            Pause.SPOOL_TOO_SMALL,
            f"sample {item.sample_id} needs {exc.needed} bytes, above the spool budget of "
            f"{exc.budget}: raise it to at least {exc.needed} (`hsq enqueue DATASET --run "
            f"RUN --spool-budget {exc.needed}`)",
        )
        self._retry_at = now + RETRY_S
        return False

    def paused_total(self) -> float:
        """Seconds held back so far, the current stretch included."""
        now = time.monotonic()
        return self.paused_s + (now - self._full_since if self._full_since is not None else 0)
