"""The one dump finder: what a dump dir holds, by position (`req_<N>`) or by rid.

:func:`scan_by_rid` is how a worker attributes dumps (several requests in flight, each
named by a rid of its own, hsq.workers.send.ridmatch); :func:`scan` lists dumps by N for tools
that send one request at a time; :func:`wait_for_dump` waits for one of either kind (the
audit waits by rid). All of them list the directory the same way (:func:`_listing`): only
names of the protocol count, and an entry under such a name that is not a real directory
(a symlink, a file, a FIFO) is never followed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hsq import fsio
from hsq.dump.format import DONE_FILE, MAX_META_BYTES, DumpMeta, dump_index, is_dump_name
from hsq.dump.read import read_meta_bytes
from hsq.errors import (
    CorruptDumpError,
    IncompleteDumpError,
    MultipleDumpsError,
    NoDumpError,
    ServerUnavailableError,
)


@dataclass(frozen=True)
class _Entry:
    name: str
    path: Path
    is_dir: bool
    index: int | None
    """N of a renamed dump (req_<N>); None for req_<N>.tmp."""


def _listing(dump_dir: Path, skip: Mapping[str, tuple[int, int]] | None = None) -> list[_Entry]:
    """Every entry under a protocol name, with whether it is a real directory. ``skip``
    maps names to entry_id() of entries to pass over."""
    out: list[_Entry] = []
    with os.scandir(dump_dir) as it:
        for e in it:
            if not is_dump_name(e.name):
                continue
            try:
                if (
                    skip
                    and e.name in skip
                    and skip[e.name] == entry_id(e.stat(follow_symlinks=False))
                ):
                    continue
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            out.append(_Entry(e.name, Path(e.path), is_dir, dump_index(e.name)))
    return out


def entry_id(st: os.stat_result) -> tuple[int, int]:
    # The inode alone is not enough: a removed entry's number is soon reused.
    return st.st_ino, st.st_ctime_ns


def remove_dump(path: Path) -> bool:
    """Remove a dump (or anything else under a protocol name) without following links;
    True when it is gone."""
    return fsio.remove_entry(path)


def clear_dump_dir(dump_dir: Path) -> int:
    """Remove every dump and partial dump; returns how many were removed.

    Only names of the protocol are touched, so a lock file or anything else stays.
    """
    return sum(remove_dump(e.path) for e in _listing(dump_dir))  # links unlinked, not followed


# ---------------------------------------------------------------------------- by position


@dataclass(frozen=True)
class Scan:
    complete: list[Path]
    """req_<N>/ directories holding `done`, sorted by N."""
    pending: list[Path]
    """req_<N>.tmp/, req_<N>/ without `done`, and anything else under a protocol name:
    something is (or was) being written."""


def scan(dump_dir: Path) -> Scan:
    complete: list[tuple[int, Path]] = []
    pending: list[Path] = []
    for e in _listing(dump_dir):
        if e.is_dir and e.index is not None and os.path.lexists(e.path / DONE_FILE):
            complete.append((e.index, e.path))
        else:
            pending.append(e.path)
    complete.sort()
    return Scan(complete=[p for _, p in complete], pending=sorted(pending))


# ---------------------------------------------------------------------------- by rid
#
# Protocol v2 lets a worker keep several requests in flight on one server. A dump is
# attributed *only* by the rid in its meta.json (then validated as in v1); the server's
# req_<N> counter is never predicted nor used. See docs/dump-protocol.md.


@dataclass(frozen=True)
class FoundDump:
    path: Path
    meta: DumpMeta


@dataclass(frozen=True)
class RidScan:
    complete: dict[str, list[FoundDump]]
    """Dumps holding `done`, by the rid in their meta.json (sorted by N)."""
    final_incomplete: dict[str, list[FoundDump]]
    """req_<N>/ without `done`: renamed without the marker, so it never gets one."""
    unreadable: list[tuple[Path, str]]
    """Renamed dumps whose meta.json cannot be read: no rid, so never attributable."""
    writing: int
    """req_<N>.tmp/ directories: a server is (or was) writing them."""
    strays: list[tuple[Path, str]] = field(default_factory=list)
    """Protocol names that are not real directories (a symlink, a file, a FIFO): no writer
    of the protocol makes them, so they are never dumps."""

    @property
    def activity(self) -> bool:
        """Something a dump writer makes appeared (strays do not count)."""
        return bool(self.complete or self.final_incomplete or self.unreadable or self.writing)


def _read_meta_limited(path: Path) -> DumpMeta:
    data = read_meta_bytes(path)
    if len(data) > MAX_META_BYTES:
        raise CorruptDumpError(f"{path.name}: meta.json is larger than {MAX_META_BYTES} bytes")
    meta = DumpMeta.from_json(data.decode("utf-8"))
    if not isinstance(meta.rid, str) or not isinstance(meta.num_tokens, int):
        raise CorruptDumpError(f"{path.name}: rid or num_tokens has the wrong type")
    return meta


def scan_by_rid(dump_dir: Path, skip: Mapping[str, tuple[int, int]] | None = None) -> RidScan:
    """One pass over the dump dir: every renamed dump with its meta read and typed.

    ``skip`` maps names to :func:`entry_id` of entries to pass over (ones that could not be
    removed): the same name as another (or a changed) entry is looked at again.
    """
    complete: dict[str, list[tuple[int, FoundDump]]] = {}
    final_incomplete: dict[str, list[FoundDump]] = {}
    unreadable: list[tuple[Path, str]] = []
    strays: list[tuple[Path, str]] = []
    writing = 0
    for e in _listing(dump_dir, skip):
        path = e.path
        if not e.is_dir:
            strays.append((path, _stray_kind(path)))
            continue
        if e.index is None:
            writing += 1
            continue
        done = os.path.lexists(path / DONE_FILE)  # any kind of entry: it is never opened
        try:
            meta = _read_meta_limited(path)
        except FileNotFoundError:
            if not os.path.lexists(path):
                continue  # removed between listing and reading (by us, after attribution)
            unreadable.append((path, "meta.json is missing"))
            continue
        except Exception as exc:  # untrusted bytes: any failure means "no usable rid"
            unreadable.append((path, f"{type(exc).__name__}: {exc}"))
            continue
        found = FoundDump(path, meta)
        if done:
            complete.setdefault(meta.rid, []).append((e.index, found))
        else:
            final_incomplete.setdefault(meta.rid, []).append(found)
    return RidScan(
        complete={
            rid: [f for _, f in sorted(v, key=lambda x: x[0])] for rid, v in complete.items()
        },
        final_incomplete=final_incomplete,
        unreadable=unreadable,
        writing=writing,
        strays=strays,
    )


def _stray_kind(path: Path) -> str:
    try:
        return f"{fsio.entry_kind(os.lstat(path).st_mode)}, not a dump directory"
    except OSError as exc:
        return f"not a dump directory ({exc.strerror})"


# ---------------------------------------------------------------------------- waiting


def wait_for_dump(
    dump_dir: Path,
    timeout: float,
    poll_interval: float = 0.002,
    *,
    rid: str | None = None,
    server_alive: Callable[[], bool] | None = None,
    alive_check_s: float = 1.0,
) -> Path:
    """Wait for the dump of one request sent alone.

    Without ``rid``: until exactly one complete dump exists and nothing else is being
    written. MultipleDumpsError as soon as two complete dumps exist, and after ``timeout``
    IncompleteDumpError (a dump without `done`), MultipleDumpsError (one complete plus
    another one started) or NoDumpError (nothing at all).

    With ``rid``: until the complete dump carrying it exists; every other dump (warm-ups,
    an operator's request) is removed, as a worker does in the dump dir it owns.
    MultipleDumpsError for two dumps carrying the rid, IncompleteDumpError for one renamed
    without `done`, NoDumpError after ``timeout``.

    While waiting longer than ``alive_check_s``, ``server_alive`` is asked now and then: a
    server that died after answering never finishes its dump, and that is not the
    sample's fault (ServerUnavailableError).
    """
    start = time.monotonic()
    deadline = start + timeout
    next_check = start + alive_check_s
    delay = poll_interval
    while True:
        late = time.monotonic() >= deadline
        found = _one_dump(dump_dir, late, timeout) if rid is None else _rid_dump(dump_dir, rid)
        if found is not None:
            return found
        if late:
            if rid is None:
                raise NoDumpError(f"no dump appeared in {dump_dir} within {timeout:.1f}s")
            raise NoDumpError(f"no dump carried {rid} within {timeout:.0f}s")
        if server_alive is not None and time.monotonic() >= next_check:
            if not server_alive():
                raise ServerUnavailableError("the server went away before its dump was complete")
            next_check = time.monotonic() + alive_check_s
        time.sleep(delay)
        # Capped low: a dump usually lands within milliseconds of the answer, and every
        # millisecond between the dump and the next request is idle GPU time.
        delay = min(delay * 1.5, 0.005)


def _one_dump(dump_dir: Path, late: bool, timeout: float) -> Path | None:
    s = scan(dump_dir)
    if len(s.complete) > 1:
        raise MultipleDumpsError(
            f"{len(s.complete)} dumps appeared for one request: "
            + ", ".join(p.name for p in s.complete)
        )
    if len(s.complete) == 1 and not s.pending:
        return s.complete[0]
    if late and (s.complete or s.pending):
        names = ", ".join(p.name for p in s.complete + s.pending)
        if s.complete:
            raise MultipleDumpsError(f"one complete dump and more being written: {names}")
        raise IncompleteDumpError(f"no `done` marker after {timeout:.1f}s: {names}")
    return None


def _rid_dump(dump_dir: Path, rid: str) -> Path | None:
    s = scan_by_rid(dump_dir)
    for other, found in s.complete.items():
        if other != rid:
            for f in found:
                remove_dump(f.path)
    for path, _why in s.unreadable:
        remove_dump(path)
    mine = s.complete.get(rid, [])
    if len(mine) > 1:
        for f in mine:
            remove_dump(f.path)
        raise MultipleDumpsError(f"{len(mine)} dumps carry rid {rid}")
    if mine:
        return mine[0].path
    if s.final_incomplete.get(rid):
        raise IncompleteDumpError(f"the dump of {rid} was renamed without `done`")
    return None
