"""The manifest codec: what a run records of each written output (the done entry).

An entry is JSON to every reader (`ManifestEntry.to_json`, `manifest export`), and stored
compactly in Redis's done hash: half the memory of the JSON, since the path is always
output_relpath(id) and "crc32:" and the default store dtype are implied. Readers get the
JSON back (`manifest_json`); an entry of an older hsq is JSON already. The field names and
the compact form are a wire format (Redis, exports): never change them. The store holds
entries through this codec (MANIFEST_CODEC, an hsq.store.DoneCodec) and knows no file
format; hsq/runstore.py binds the two.
"""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass, fields

from hsq.errors import DatasetError
from hsq.outputs.format import output_relpath
from hsq.states import BF16


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    num_tokens: int
    bytes: int
    checksum: str
    worker: str
    time: float
    attempt: int
    store_dtype: str = BF16
    """Entries written before FP8 existed have none: bf16."""

    def to_json(self) -> str:
        # The fields by hand, in their order: asdict deep-copies every value, and verify
        # makes a million of these.
        return json.dumps({name: getattr(self, name) for name in _FIELDS}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | builtins.bytes) -> ManifestEntry:
        return cls(**json.loads(text))


_FIELDS = tuple(f.name for f in fields(ManifestEntry))
_COMPACT = "m1"


def encode_manifest(sample_id: str, e: ManifestEntry) -> str:
    """A done entry as stored: `m1|tokens|bytes|checksum|worker|time|attempt|dtype`."""
    if e.path != output_relpath(sample_id) or "|" in e.worker + e.checksum + e.store_dtype:
        return e.to_json()  # not the usual shape: stored as it is
    crc = e.checksum.removeprefix("crc32:")
    if ":" in crc:
        crc = e.checksum  # another kind of checksum, kept whole
    dtype = "" if e.store_dtype == BF16 else e.store_dtype
    when = f"{e.time:.1f}"
    return f"{_COMPACT}|{e.num_tokens}|{e.bytes}|{crc}|{e.worker}|{when}|{e.attempt}|{dtype}"


def stored_entry(sample_id: str, raw: builtins.bytes | str) -> ManifestEntry | None:
    """The entry a compact stored form holds; None when `raw` is not one (JSON of an older
    hsq, or damaged: untrusted either way)."""
    got = _compact(sample_id, raw)
    if got is None:
        return None
    path, tokens, nbytes, crc, worker, when, attempt, dtype = got
    return ManifestEntry(path, tokens, nbytes, crc, worker, when, attempt, dtype)


def stored_path(sample_id: str, raw: builtins.bytes | str) -> str | None:
    """The path a compact stored form implies (stored_entry's verdict, no entry built:
    verify's orphan pass asks this of a million files); None when `raw` is not one."""
    got = _compact(sample_id, raw)
    return None if got is None else got[0]


def _compact(
    sample_id: str, raw: builtins.bytes | str
) -> tuple[str, int, int, str, str, float, int, str] | None:
    data = raw.encode() if isinstance(raw, str) else raw
    if not data.startswith(b"m1|"):
        return None
    try:
        _, tokens, nbytes, crc, worker, when, attempt, dtype = data.decode().split("|")
        return (
            output_relpath(sample_id),
            int(tokens),
            int(nbytes),
            crc if ":" in crc else f"crc32:{crc}",
            worker,
            float(when),
            int(attempt),
            dtype or BF16,
        )
    except (ValueError, UnicodeDecodeError, DatasetError):
        return None


def manifest_json(sample_id: str, raw: builtins.bytes | str) -> builtins.bytes:
    """A stored done entry as the manifest JSON readers check (untrusted either way: what
    does not decode is handed back as it is, and refused by whoever checks it)."""
    entry = stored_entry(sample_id, raw)
    if entry is None:
        return raw.encode() if isinstance(raw, str) else raw
    return entry.to_json().encode()


class ManifestCodec:
    """hsq.store.DoneCodec[ManifestEntry]: how the store keeps manifest entries."""

    def encode(self, sample_id: str, entry: ManifestEntry) -> str:
        return encode_manifest(sample_id, entry)

    def totals(self, entry: ManifestEntry) -> tuple[int, int]:
        return entry.num_tokens, entry.bytes

    def decode(self, sample_id: str, raw: builtins.bytes) -> ManifestEntry | None:
        try:
            return ManifestEntry.from_json(manifest_json(sample_id, raw))
        except (ValueError, TypeError):  # Redis is untrusted: a damaged entry is no entry
            return None

    def as_json(self, sample_id: str, raw: builtins.bytes) -> builtins.bytes:
        return manifest_json(sample_id, raw)


MANIFEST_CODEC = ManifestCodec()
