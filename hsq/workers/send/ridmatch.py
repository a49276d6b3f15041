"""Attributing dumps to in-flight requests by rid: the worker's dispatcher runs it.

Pure logic over one dump dir (hsq.dump.find lists it); the rules are docs/dump-protocol.md's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hsq.dump.find import FoundDump, RidScan, entry_id, remove_dump, scan_by_rid
from hsq.errors import (
    CorruptDumpError,
    DumpDirError,
    IncompleteDumpError,
    MultipleDumpsError,
    NoDumpError,
    StaleDumpError,
)
from hsq.fsio import is_real_dir


@dataclass
class Wanted:
    """One request in flight, as the matcher sees it."""

    rid: str
    num_tokens: int
    answered_at: float | None = None
    discards_at_add: int = 0
    held: FoundDump | None = None
    held_at: float = 0.0

    def hold_until(self, grace: float) -> float | None:
        """When a held short dump is given up waiting for its other part (None: not yet
        answered). Counted from the later of the answer and the sighting: a server may
        write its dumps after it answers."""
        if self.answered_at is None:
            return None
        return max(self.answered_at, self.held_at) + grace


@dataclass(frozen=True)
class Match:
    """The matcher's word on one in-flight rid: its dump, or why there is none."""

    rid: str
    dump: FoundDump | None = None
    error: Exception | None = None


UNREMOVABLE = "unremovable"
"""The `why` of a discarded entry that could not be removed: reported once, then skipped."""


class RidMatcher:
    """Attributes dumps to in-flight requests by rid; pure logic over one directory.

    Not thread-safe: the worker's dispatcher calls it under one lock. Rules
    (docs/dump-protocol.md): a dump whose rid is not in flight is removed and counted
    (``discarded[why]``); two dumps for one rid fail it (multiple_dumps), also when the
    second lands after the first was handed out but before it is used
    (:meth:`confirm_single`); a renamed dump without `done` fails its rid (incomplete_dump); a dump
    shorter than the request is held until ``split_grace_s`` after the answer, because a
    server that split the prefill writes the rest next (then multiple_dumps); no dump within
    ``timeout_s`` of the answer fails the rid (no_dump, or stale_dump when foreign dumps
    arrived meanwhile). A rid that gave up (``abandon``) is remembered for a while, so its
    late dump is discarded as "late". An attributed dump is moved into ``staging`` (same
    filesystem) before it is returned. An entry under a protocol name that is not a real
    directory (a symlink, a file, a FIFO) is unlinked, never followed; one that cannot be
    removed is counted once as ``unremovable`` and skipped from then on.
    """

    def __init__(
        self,
        dump_dir: Path,
        staging: Path,
        *,
        timeout_s: float,
        split_grace_s: float = 0.25,
        remember_late: int = 4096,
    ) -> None:
        self.dump_dir = dump_dir
        self.staging = staging
        self.timeout_s = timeout_s
        self.split_grace_s = split_grace_s
        self.wanted: dict[str, Wanted] = {}
        self._gone: dict[str, None] = {}  # insertion-ordered set of finished/abandoned rids
        # Rids whose dump was handed out and not used yet -> whether another dump carrying
        # the rid came since (then confirm_single() fails the attempt).
        self._delivered: dict[str, bool] = {}
        self._remember = remember_late
        self._stuck: dict[str, tuple[int, int]] = {}  # entries that cannot be removed
        self.discarded: dict[str, int] = {}
        self._discards = 0
        self.proven = False
        """A dump writer made something in the dump dir since the last reset_proof()."""

    def add(self, rid: str, num_tokens: int) -> None:
        if rid in self.wanted or rid in self._gone:
            raise ValueError(f"rid {rid!r} was used before: every attempt needs a fresh rid")
        self.wanted[rid] = Wanted(rid, num_tokens, discards_at_add=self._discards)

    def answered(self, rid: str, now: float) -> None:
        w = self.wanted.get(rid)
        if w is not None:
            w.answered_at = now

    def abandon(self, rid: str) -> None:
        """The request failed or timed out: whatever dump it still gets is late."""
        if self.wanted.pop(rid, None) is not None:
            self._forget(rid)

    def confirm_single(self, rid: str) -> None:
        """The dump handed out for ``rid`` is about to be used (validated, pinned, written).
        MultipleDumpsError if another dump carrying the rid came after it; from then on a
        dump carrying the rid is "late"."""
        if self._delivered.pop(rid, False):
            raise MultipleDumpsError(
                f"a second dump carrying rid {rid!r} arrived after the first was taken"
            )

    def release(self, rid: str) -> None:
        """The handed-out dump of ``rid`` failed validation: it will not be used."""
        self._delivered.pop(rid, None)

    def reset_proof(self) -> None:
        self.proven = False

    def retarget(self, staging: Path) -> None:
        """The dump dir was taken again (re-created, or another directory under its path)."""
        self.staging = staging
        self._stuck.clear()
        self.proven = False

    def _forget(self, rid: str) -> None:
        self._gone[rid] = None
        while len(self._gone) > self._remember:
            del self._gone[next(iter(self._gone))]

    def _discard(self, path: Path, why: str) -> str:
        """Remove an entry; returns the `why` it is counted under."""
        if not remove_dump(path):
            try:
                ident = entry_id(os.lstat(path))  # after the attempt: what is left
            except OSError:
                ident = None
            if ident is not None:
                if len(self._stuck) >= 1024:  # keep only names that still exist
                    self._stuck = {
                        n: i for n, i in self._stuck.items() if os.path.lexists(self.dump_dir / n)
                    }
                self._stuck[path.name] = ident
                why = UNREMOVABLE
        self.discarded[why] = self.discarded.get(why, 0) + 1
        self._discards += 1
        return why

    def poll(self, now: float) -> tuple[list[Match], list[tuple[str, Path, str]]]:
        """One scan. Returns the decided rids and the discarded dumps (why, path, rid).

        A decided dump has been moved into ``staging`` already, so no later scan sees it.
        """
        s = scan_by_rid(self.dump_dir, self._stuck)
        self.proven = self.proven or s.activity
        decided: list[Match] = []
        dropped: list[tuple[str, Path, str]] = []
        for path, why in s.strays:
            self._drop(dropped, path, "not_a_dump", why)
        for path, why in s.unreadable:
            self._drop(dropped, path, "unreadable", why)
        for rid, found in s.final_incomplete.items():
            w = self.wanted.get(rid)
            if w is not None and w.held is None and rid not in s.complete:
                for f in found:
                    remove_dump(f.path)
                msg = f"{found[0].path.name} (rid {rid!r}) was renamed without its `done` marker"
                decided.append(self._decide(rid, error=IncompleteDumpError(msg)))
            else:
                for f in found:
                    self._drop(dropped, f.path, self._unwanted(rid), rid)
        for rid, dumps in s.complete.items():
            match = self._complete(rid, dumps, now, dropped)
            if match is not None:
                decided.append(match)
        decided.extend(self._expired(now, s))
        return decided, dropped

    def _unwanted(self, rid: str) -> str:
        """Why a dump carrying ``rid`` (not in flight) is discarded."""
        if rid in self._delivered:
            self._delivered[rid] = True  # confirm_single() fails the attempt
            return "duplicate"
        return "late" if rid in self._gone else "unknown_rid"

    def _drop(self, dropped: list[tuple[str, Path, str]], path: Path, why: str, rid: str) -> None:
        dropped.append((self._discard(path, why), path, rid))

    def _complete(
        self, rid: str, dumps: list[FoundDump], now: float, dropped: list[tuple[str, Path, str]]
    ) -> Match | None:
        w = self.wanted.get(rid)
        if w is None:
            why = self._unwanted(rid)
            for f in dumps:
                self._drop(dropped, f.path, why, rid)
            return None
        paths = {f.path for f in dumps}
        if w.held is not None:
            paths.add(w.held.path)
        if len(paths) > 1:
            for p in paths:
                remove_dump(p)
            names = ", ".join(sorted(p.name for p in paths))
            msg = f"{len(paths)} dumps carry rid {rid!r}: {names}"
            return self._decide(rid, error=MultipleDumpsError(msg))
        found = dumps[0]
        if found.meta.num_tokens < w.num_tokens:
            if w.held is None:  # maybe the first part of a split prefill: wait for the rest
                w.held, w.held_at = found, now
            until = w.hold_until(self.split_grace_s)
            if until is None or now < until:
                return None
        return self._decide(rid, dump=found)

    def _expired(self, now: float, s: RidScan) -> list[Match]:
        out = []
        for w in list(self.wanted.values()):
            if w.answered_at is None:
                continue  # the HTTP request itself has its own timeout
            until = w.hold_until(self.split_grace_s)
            if w.held is not None and until is not None and now >= until:
                out.append(self._decide(w.rid, dump=w.held))
                continue
            if now < w.answered_at + self.timeout_s:
                continue
            foreign = self._discards - w.discards_at_add
            err: Exception
            if foreign:
                err = StaleDumpError(
                    f"no dump carried rid {w.rid!r} within {self.timeout_s:.1f}s; {foreign} "
                    "dump(s) with other rids appeared meanwhile"
                )
            elif s.writing:
                err = IncompleteDumpError(
                    f"no complete dump for rid {w.rid!r} within {self.timeout_s:.1f}s "
                    f"({s.writing} still being written)"
                )
            else:
                err = NoDumpError(
                    f"no dump for rid {w.rid!r} appeared in {self.dump_dir} "
                    f"within {self.timeout_s:.1f}s"
                )
            out.append(self._decide(w.rid, error=err))
        return out

    def _decide(
        self, rid: str, *, dump: FoundDump | None = None, error: Exception | None = None
    ) -> Match:
        self.wanted.pop(rid, None)
        self._forget(rid)
        if dump is not None:
            # The rid is one we created (in flight), so it is safe as a file name.
            staged = self.staging / rid
            try:
                os.rename(dump.path, staged)
            except OSError as exc:
                if not is_real_dir(self.staging):
                    # The dump dir was removed or replaced under us: the environment's
                    # fault, not the sample's (the dispatcher sees it too and pauses).
                    return Match(rid, None, DumpDirError(f"cannot stage {rid!r}: {exc}"))
                remove_dump(dump.path)
                return Match(rid, None, CorruptDumpError(f"cannot stage {dump.path.name}: {exc}"))
            dump = FoundDump(staged, dump.meta)
            self._delivered[rid] = False
            while len(self._delivered) > self._remember:
                del self._delivered[next(iter(self._delivered))]
        return Match(rid, dump, error)
