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


def encode_error(exc: BaseException) -> dict[str, Any]:
    """An exception as JSON, for the persist process's answer."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError):
        out["errno"] = exc.errno
        out["strerror"] = exc.strerror
    if isinstance(exc, errors_mod.DatasetError):
        out["reason"] = exc.reason
    return out


def decode_error(raw: dict[str, Any]) -> BaseException:
    """The exception a persist process reported, rebuilt as its own class where that is
    one of hsq.errors' (so the failure policy classifies it as in a thread), an OSError
    with its errno, else PersistChildError. Never builds any other type."""
    name = str(raw.get("type", ""))
    msg = str(raw.get("message", ""))
    cls = getattr(errors_mod, name, None)
    if isinstance(cls, type) and issubclass(cls, HsqError):
        try:
            if issubclass(cls, errors_mod.DatasetError):
                return cls(msg, str(raw.get("reason", "bad_line")))
            return cls(msg)
        except TypeError:  # a constructor of another shape: keep the message
            return PersistChildError(f"{name}: {msg}")
    if "errno" in raw:
        code = raw["errno"] if isinstance(raw["errno"], int) else errno.EIO
        return OSError(code, str(raw.get("strerror") or msg))
    return PersistChildError(f"{name}: {msg}")


_encode = msgspec.json.Encoder().encode


def frame(obj: dict[str, Any]) -> bytes:
    # msgspec, not json.dumps: a job's token ids cost the worker's interpreter ~10x less.
    data = _encode(obj)
    return len(data).to_bytes(4, "big") + data
