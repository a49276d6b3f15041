"""One sample's CPU work in the persist stage, the same in a persist thread and in a persist
process (hsq/workers/persist/procs.py): open the staged dump, check it, write the output.

`write_staged` is that work: the header against the meta, then hsq.outputs.transcode's one
pass (read, finite check, checksum, quantize, write, fsync); `before_rename` is where the
worker's single owner (its main process: pins, the done look, the lease) decides whether
the file may take its name. A dump check that belongs to every sample (e.g. fp8 invariants)
goes here, so it runs wherever the work runs.

`WriteJob` carries what a persist process needs, as JSON (no pickle between processes):
the sample, the meta the worker already checked against its request, and the paths.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

import hsq.errors as errors_mod
from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta
from hsq.dump.read import open_dump_tensors
from hsq.errors import HsqError
from hsq.outputs.transcode import write_output
from hsq.stfile.engine import WriteEngine


def write_staged(
    out: Path,
    sample: Sample,
    meta: DumpMeta,
    staged: Path,
    run: str,
    store_dtype: str,
    *,
    engine: WriteEngine,
    prenorm: bool,
    stats: dict[str, float],
    before_rename: Callable[[], None] | None,
) -> tuple[int, str]:
    """Write `sample`'s output from its staged dump; (bytes, checksum)."""
    # The header against the meta here; the values (finite) in the one pass that copies
    # them, so the bytes checked are the bytes written (a dump rewritten between a check and
    # the copy must not reach the output).
    tensors = open_dump_tensors(staged, meta, check_finite=False, mapped=False)
    try:
        return write_output(
            out,
            sample,
            meta,
            tensors,
            run,
            store_dtype,
            engine=engine,
            prenorm=prenorm,
            stats=stats,
            before_rename=before_rename,
        )
    finally:
        tensors.close()


@dataclass(frozen=True)
class WriteJob:
    out: str
    staged: str
    meta: str
    """meta.json's text as the worker checked it (DumpMeta.to_json)."""
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int] | None
    run: str
    store_dtype: str
    prenorm: bool

    @classmethod
    def of(
        cls,
        out: Path,
        sample: Sample,
        meta: DumpMeta,
        staged: Path,
        run: str,
        store_dtype: str,
        prenorm: bool,
    ) -> WriteJob:
        return cls(
            str(out),
            str(staged),
            meta.to_json(),
            sample.id,
            list(sample.input_ids),
            None if sample.loss_mask is None else list(sample.loss_mask),
            run,
            store_dtype,
            prenorm,
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> WriteJob:
        return cls(**raw)

    def run_here(
        self,
        engine: WriteEngine,
        stats: dict[str, float],
        before_rename: Callable[[], None] | None,
    ) -> tuple[int, str]:
        sample = Sample(self.sample_id, self.input_ids, self.loss_mask)
        return write_staged(
            Path(self.out),
            sample,
            DumpMeta.from_json(self.meta),
            Path(self.staged),
            self.run,
            self.store_dtype,
            engine=engine,
            prenorm=self.prenorm,
            stats=stats,
            before_rename=before_rename,
        )


class PersistChildError(Exception):
    """An exception a persist process raised that is neither an HsqError nor an OSError
    (a bug): classified as any unexpected exception of a stage (retried, then dead)."""


_REASON = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""What a `reason` looks like (it names a dead letter, a pause, a metrics label)."""


def encode_error(exc: BaseException) -> dict[str, Any]:
    """An exception as JSON, for the persist process's answer: its type, message, errno,
    its `reason` (read-only, disk full, dataset unreadable: each its own reason, which the
    failure policy turns into its own pause) and the errno of the OSError that caused it."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError):
        out["errno"] = exc.errno
        out["strerror"] = exc.strerror
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        out["reason"] = reason
    cause = exc.__cause__
    if isinstance(cause, OSError) and isinstance(cause.errno, int):
        out["cause"] = {"errno": cause.errno, "strerror": str(cause.strerror or cause)}
    return out


def decode_error(raw: dict[str, Any]) -> BaseException:
    """The exception a persist process reported, rebuilt as its own class where that is
    one of hsq.errors' (so the failure policy classifies it as in a thread, by type and
    `reason`), an OSError with its errno, else PersistChildError. Never builds any other
    type; a `reason` that does not look like one is left out."""
    name = str(raw.get("type", ""))
    msg = str(raw.get("message", ""))
    cls = getattr(errors_mod, name, None)
    exc: BaseException
    if isinstance(cls, type) and issubclass(cls, HsqError):
        try:
            exc = cls(msg)
        except TypeError:  # a constructor of another shape: keep the message
            return PersistChildError(f"{name}: {msg}")
        reason = raw.get("reason")
        if isinstance(reason, str) and _REASON.fullmatch(reason):
            exc.reason = reason  # type: ignore[attr-defined]
    elif "errno" in raw:
        code = raw["errno"] if isinstance(raw["errno"], int) else errno.EIO
        return OSError(code, str(raw.get("strerror") or msg))
    else:
        return PersistChildError(f"{name}: {msg}")
    cause = raw.get("cause")
    if isinstance(cause, dict) and isinstance(cause.get("errno"), int):
        exc.__cause__ = OSError(cause["errno"], str(cause.get("strerror") or ""))
    return exc


_encode = msgspec.json.Encoder().encode


def frame(obj: dict[str, Any]) -> bytes:
    # msgspec, not json.dumps: a job's token ids cost the worker's interpreter ~10x less.
    data = _encode(obj)
    return len(data).to_bytes(4, "big") + data
