"""The failure policy: what happens to a sample after an exception. Pure logic, no I/O.

Every exception raised while handling a sample is classified into a :class:`Kind`; with
the sample's attempt and crash counts :func:`decide` turns it into an :class:`Outcome`.
Nothing is dropped: an exception this module does not know is ``internal_error``, which is
retried and, after ``max_attempts``, dead-lettered with its message.

    Kind         example                                  outcome
    SAMPLE       bad dump, wrong length, NaN, unknown bug RETRY, DEAD after max_attempts
    PERMANENT    4xx, bad dataset line, dataset changed   DEAD now
    SERVER_FAIL  server died mid-request, 5xx answer,      RETRY (no attempt used) / HAND_BACK,
                 a persist process died                   DEAD after max_server_crashes
    PAUSE        server down, dataset unreadable (EIO,    HAND_BACK the chunk untouched and
                 missing), disk full, Redis unreachable,  back off: never the sample's fault
                 dump dir replaced, hook not live, a bug  (the last three: take the dir again /
                 outside the sample (matcher raised)      exit 2 / exit 1)
    RUN_CHANGED  run purged or re-created                 drop in-flight work, re-read the run
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hsq.errors import (
    OUTPUT_READ_ONLY,
    DatasetError,
    DumpDirError,
    DumpError,
    HookInactiveError,
    HsqError,
    InternalError,
    OutputError,
    PersistProcessError,
    RunChangedError,
    ServerRejectedError,
    ServerUnavailableError,
    StoreError,
    StoreUnavailableError,
)
from hsq.workers.send.client import MidRequestFailure

# The one place that says "Redis is unreachable": the store translates every redis-py error
# into the hsq tree, so this is the only type workers catch for it.
STORE_DOWN: tuple[type[BaseException], ...] = (StoreUnavailableError,)

# For the places that only log and go on (heartbeat, shutdown, settling after a fault).
STORE_DOWN_OR_RUN_CHANGED: tuple[type[BaseException], ...] = (*STORE_DOWN, RunChangedError)
STORE_TROUBLE: tuple[type[BaseException], ...] = (HsqError, *STORE_DOWN)

# The reasons classify gives itself (the others are the exceptions' `reason`): `hsq requeue
# --reason` accepts them (hsq/ops/requeue.py:known_reasons).
POLICY_REASONS = ("rejected", "server_error", "internal_error")

# Dataset reasons that mean "the file is not there or not readable right now".
DATASET_TRANSIENT = {"dataset_unreadable"}


class Outcome(enum.Enum):
    RETRY = "retry"
    DEAD = "dead"
    HAND_BACK = "hand_back"
    RUN_CHANGED = "run_changed"


class Kind(enum.Enum):
    SAMPLE = "sample"
    PERMANENT = "permanent"
    SERVER_FAIL = "server_fail"
    PAUSE = "pause"
    RUN_CHANGED = "run_changed"


class Pause(enum.Enum):
    """Why the worker stops sending for a while; all are outside the sample."""

    SERVER_DOWN = "server_down"
    SERVER_STARTING = "server_starting"
    """Only a cause on the worker's record, never a pause: the server has not answered
    once yet (loading, compiling); `server_down` is for one that answered before."""
    DATASET_UNAVAILABLE = "dataset_unavailable"
    OUTPUT_UNWRITABLE = "output_unwritable"
    OUTPUT_READ_ONLY = "output_read_only"
    """The output filesystem is read-only (e.g. remounted so after an error): hand back,
    retry until it is writable again."""
    STORE_DOWN = "store_down"
    SERVER_ERRORS = "server_errors"
    DUMP_DIR = "dump_dir_changed"
    """The dump dir was removed or replaced: take it again, then go on."""
    HOOK_INACTIVE = "hook_inactive"
    """Requests get no dump at all and none ever came: the worker stops (exit 2)."""
    SPOOL_FULL = "spool_full"
    """A streamed run's spool holds its byte budget: no sample is sent until consumers
    commit (hsq/workers/spool.py; never handed back, never the sample's fault)."""
    SPOOL_TOO_SMALL = "spool_too_small"
    """A sample alone is larger than the spool's budget: nothing is sent (no dead letter)
    until the budget is raised to the number the cause names."""
    INTERNAL_ERROR = "worker_internal_error"
    """A bug in the worker outside any one sample (the dump matcher raised): it stops
    (exit 1) once its work is handed back."""


@dataclass(frozen=True)
class Failure:
    kind: Kind
    reason: str
    message: str
    pause: Pause | None = None
    mid_request: bool = False


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str
    attempts: int
    """The attempt count recorded with a retry or in the dead letter."""
    pause: Pause | None = None


# Faults outside the sample that their type alone classifies: (type, reason, pause). The
# first match wins; all are handed back untouched (Kind.PAUSE).
_PAUSES: tuple[tuple[type[BaseException], str, Pause], ...] = (
    (DumpDirError, "dump_dir_changed", Pause.DUMP_DIR),
    (HookInactiveError, "hook_inactive", Pause.HOOK_INACTIVE),
    (InternalError, "worker_internal_error", Pause.INTERNAL_ERROR),
    (ServerUnavailableError, "server_unavailable", Pause.SERVER_DOWN),
    (OutputError, "output_unwritable", Pause.OUTPUT_UNWRITABLE),
    # EIO and friends reading the dataset or staging: the disk, not the sample.
    (OSError, "io_error", Pause.DATASET_UNAVAILABLE),
    (StoreError, "store_error", Pause.STORE_DOWN),
)


def classify(exc: BaseException) -> Failure:
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, RunChangedError):
        return Failure(Kind.RUN_CHANGED, "run_changed", msg)
    if isinstance(exc, STORE_DOWN):
        return Failure(Kind.PAUSE, "store_unavailable", msg, Pause.STORE_DOWN)
    if isinstance(exc, DumpError):
        return Failure(Kind.SAMPLE, exc.reason, msg)
    if isinstance(exc, DatasetError):
        if exc.reason in DATASET_TRANSIENT:
            return Failure(Kind.PAUSE, exc.reason, msg, Pause.DATASET_UNAVAILABLE)
        return Failure(Kind.PERMANENT, exc.reason, msg)
    if isinstance(exc, MidRequestFailure):  # before ServerUnavailableError, its base
        return Failure(Kind.SERVER_FAIL, exc.reason, msg, Pause.SERVER_DOWN, mid_request=True)
    if isinstance(exc, ServerRejectedError):
        if 400 <= exc.status_code < 500:
            return Failure(Kind.PERMANENT, "rejected", msg)
        return Failure(Kind.SERVER_FAIL, "server_error", msg, Pause.SERVER_ERRORS)
    if isinstance(exc, OutputError) and exc.reason == OUTPUT_READ_ONLY:
        return Failure(Kind.PAUSE, OUTPUT_READ_ONLY, msg, Pause.OUTPUT_READ_ONLY)
    if isinstance(exc, PersistProcessError):  # counted as a crash: retried, no attempt used
        return Failure(Kind.SERVER_FAIL, exc.reason, msg)
    for kind, reason, pause in _PAUSES:
        if isinstance(exc, kind):
            return Failure(Kind.PAUSE, reason, msg, pause)
    return Failure(Kind.SAMPLE, "internal_error", f"{type(exc).__name__}: {msg}")


def decide(
    failure: Failure, attempt: int, max_attempts: int, crashes: int = 0, max_crashes: int = 3
) -> Decision:
    """``attempt`` is the sample's attempt number (0-based); ``crashes`` the server failures
    recorded for it, this one included."""
    attempts = attempt + 1
    if failure.kind is Kind.RUN_CHANGED:
        return Decision(Outcome.RUN_CHANGED, failure.reason, attempt)
    if failure.kind is Kind.PAUSE:
        return Decision(Outcome.HAND_BACK, failure.reason, attempt, failure.pause)
    if failure.kind is Kind.PERMANENT:
        return Decision(Outcome.DEAD, failure.reason, attempts)
    if failure.kind is Kind.SERVER_FAIL:
        if crashes >= max_crashes:
            return Decision(Outcome.DEAD, failure.reason, attempts)
        if failure.mid_request:  # the server is probably gone: hand back, wait for it
            return Decision(Outcome.HAND_BACK, failure.reason, attempt, failure.pause)
        # A 5xx: retried without using an attempt; the worker backs off.
        return Decision(Outcome.RETRY, failure.reason, attempt, failure.pause)
    if attempts >= max_attempts:
        return Decision(Outcome.DEAD, failure.reason, attempts)
    return Decision(Outcome.RETRY, failure.reason, attempts)


def backoff(failures: int, base: float = 0.25, cap: float = 30.0) -> float:
    """Exponential backoff after ``failures`` consecutive failures (>= 1)."""
    return float(min(cap, base * 2 ** max(0, failures - 1)))
