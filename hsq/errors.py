"""One exception root for everything hsq raises on purpose.

    HsqError
    ├── ConfigError                 bad flags, settings or arguments (exit code 2)
    │   └── HookInactiveError       the server's dump hook is not active (no readiness marker)
    ├── DatasetError                a dataset line or file is unusable (`reason` says why)
    ├── StoreError                  Redis unreachable or its state inconsistent (exit code 3)
    │   ├── StoreUnavailableError   Redis unreachable or timing out: transient, retried
    │   └── RunChangedError         the run was purged or re-created (generation changed)
    ├── OutputError                 an output file cannot be written (disk full, permissions)
    ├── DumpDirError                the dump dir was removed or replaced under a running worker
    ├── InternalError               a bug in the worker outside any one sample (exit code 1)
    ├── DumpError                   the dump for one request is unusable: the *sample* is retried
    │   ├── NoDumpError             no req_<N>/ appeared
    │   ├── MultipleDumpsError      more than one dump appeared (e.g. chunked prefill split it)
    │   ├── IncompleteDumpError     a dump never got its `done` marker
    │   ├── StaleDumpError          rid or input fingerprint belong to another request
    │   ├── WrongLengthError        token count differs from the request's
    │   ├── CachedTokensError       the server reused a cached prefix (radix cache on)
    │   ├── MetaMismatchError       layers, hidden size, dtype or model differ from the run's
    │   ├── CorruptDumpError        unreadable meta or tensors, bad shapes
    │   │   └── NonFiniteDumpError  NaN or Inf in the hidden states
    │   └── AuditMismatchError      stored states differ from the sample re-extracted alone
    └── ServerError                 talking to the inference server
        ├── ServerUnavailableError  down, restarting or timing out: *not* the sample's fault
        └── ServerRejectedError     the server answered 4xx/5xx to a well-formed request

Each DumpError carries a short, stable ``reason`` used for retry bookkeeping, the dead
letter and metrics labels.
"""

from __future__ import annotations

from typing import Any

# `hsq`'s exit codes (docs/operations.md): what a script calling it can branch on.
EXIT_OK = 0
EXIT_PROBLEMS = 1
"""Problems found (verify, audit, export), or an expected failure of the work itself."""
EXIT_USAGE = 2
"""A usage or configuration error: nothing was changed."""
EXIT_REDIS = 3
"""Redis unreachable."""


class HsqError(Exception):
    """Root of every error hsq raises deliberately."""


class ConfigError(HsqError):
    """Invalid configuration or usage."""


class MissingExtraError(ConfigError):
    """A command needs an optional dependency this install lacks (hsq.extras names the
    extra that brings it)."""


class DatasetError(HsqError):
    def __init__(self, message: str, reason: str = "bad_line") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # keeps `reason` through a process pool
        return (type(self), (str(self),), {"reason": self.reason})


class EmptyDatasetError(DatasetError, ConfigError):
    """DATASET holds no valid sample: a usage error (exit 2), as a missing file is."""

    def __init__(self, message: str = "the dataset holds no valid sample") -> None:
        super().__init__(message, "empty_dataset")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self),))


class StoreError(HsqError):
    """Redis is unreachable (or answers errors); not the sample's fault."""


class StoreUnavailableError(StoreError):
    """Redis could not be reached or timed out: transient, retried, never the sample's fault."""


class RunChangedError(StoreError):
    """The run was purged or re-created since this process read its config (generation changed)."""


OUTPUT_READ_ONLY = "output_read_only"


class OutputError(HsqError):
    """Writing an output failed (e.g. ENOSPC); the sample is handed back, not failed.
    `reason` names the cause where it is known (``output_read_only``: the filesystem is
    read-only, e.g. remounted so after an error); ``output_unwritable`` otherwise."""

    def __init__(self, message: str, *, reason: str = "output_unwritable") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # keeps `reason` through a process pool
        return (type(self), (str(self),), {"reason": self.reason})


class PersistProcessError(HsqError):
    """A persist process (hsq/workers/persist/procs.py) died with a sample in hand (killed,
    out of memory): not the sample's fault. Retried without using an attempt; a sample
    that kills its process --max-server-crashes times is dead-lettered with this reason."""

    reason = "persist_process_died"


class DumpDirError(HsqError):
    """The dump dir was removed, replaced or made unusable under a running worker: the
    environment's fault, never the sample's. The worker hands its work back and takes the
    directory again (docs/dump-protocol.md)."""


class InternalError(HsqError):
    """A bug in hsq itself that no one sample caused, e.g. the dump matcher raised: every
    request in flight would fail with it. Never charged to the samples: the worker hands
    its work back untouched and stops (exit code 1), loudly."""


class DumpError(HsqError):
    """A dump could not be used for the request it should belong to."""

    reason = "dump_error"


class NoDumpError(DumpError):
    reason = "no_dump"


class MultipleDumpsError(DumpError):
    reason = "multiple_dumps"


class IncompleteDumpError(DumpError):
    reason = "incomplete_dump"


class StaleDumpError(DumpError):
    reason = "stale_dump"


class WrongLengthError(DumpError):
    reason = "wrong_length"


class CachedTokensError(DumpError):
    reason = "cached_tokens"


class MetaMismatchError(DumpError):
    reason = "meta_mismatch"


class CorruptDumpError(DumpError):
    reason = "corrupt_dump"


class NonFiniteDumpError(CorruptDumpError):
    reason = "non_finite"


class AuditMismatchError(DumpError):
    """`hsq audit` or a worker's --audit-fraction re-extracted a done sample alone and its
    stored states are not within the reference tolerance: they belong to another input
    (a batching server mixed requests up). Dead-lettered, not retried: the server is at
    fault until shown otherwise."""

    reason = "audit_mismatch"


class ServerError(HsqError):
    """Problems talking to the inference server."""

    reason = "server_error"


class ServerUnavailableError(ServerError):
    reason = "server_unavailable"


class ServerRejectedError(ServerError):
    reason = "server_rejected"

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class HookInactiveError(ConfigError):
    """The server has no active dump hook (no or a mismatched readiness marker): every
    sample would time out with no_dump, so the worker refuses to start instead."""
