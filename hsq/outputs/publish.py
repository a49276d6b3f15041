"""Publishing an output file: its temp takes the sample's name only where no file has it,
so no writer ever replaces another writer's file.

Two writers of one sample meet when a worker woken after a SIGSTOP (or a partition) was
between its look and its rename while the worker that redid its reaped job published, or
after an operator's requeue of a sample still being written. Each writer marks done (the
first mark wins, and a worker marks only while the job is in its wip list) the entry of
the file it *published* or *adopted* here, and a valid file at the name is never moved by a
writer, so the marked entry is the file on disk whatever the order and wherever either
writer is stopped (docs/reliability.md gives the argument and the one case it leaves).

The name taken (EEXIST), the file there is judged by `recover`'s checks (hsq.outputs.adopt:
header, sample id, run, token count and values, loss mask, fingerprint, layout, format,
every tensor finite or, fp8, by verify's rules, and its checksum computed) and by the
dump's identity (model, layers, states dtype and hidden size), through a descriptor, so
what is judged is one file:
- valid: adopted: the temp is dropped and the write yields that file's size and checksum;
- invalid (a file of an earlier configuration, one verify found corrupt and left, not a
  regular file): moved aside to a temp name, confirmed by inode to be the file judged
  (else put back, never replacing anything), removed, and the publish tried again.
Both are rare; the common path is one renameat2 in place of a rename (hsq.fsio).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hsq.dataset.jsonl import Sample
from hsq.errors import HsqError
from hsq.fsio import fsync_path, rename_noreplace, temp_name
from hsq.outputs.format import output_relpath, read_header

if TYPE_CHECKING:
    from hsq.dump.format import DumpMeta

MAX_ROUNDS = 8
"""Publish attempts before giving up (OutputError, retried): each further round needs
another writer to have put an invalid file at the name meanwhile."""

Pause = Callable[[str], None]
FileId = tuple[int, int]

ADOPTED, REPLACED_INVALID, DISPLACED = "adopted", "replaced_invalid", "displaced"
"""Counters in the write's stats (floats, so they cross a persist process's pipe)."""
EVENTS = (ADOPTED, REPLACED_INVALID, DISPLACED)


def _go_on(_point: str) -> None:
    return None


@dataclass(frozen=True)
class Publisher:
    """fsio's `publish` for one sample's output: (tmp, path, (bytes, checksum)) -> the
    (bytes, checksum) of the file that holds the name afterwards."""

    sample: Sample
    meta: DumpMeta
    run: str
    store_dtype: str
    prenorm: bool
    stats: dict[str, float] | None = None
    pause: Pause = _go_on
    """A port for tests: called before each step that reads or changes the name, so two
    writers can be interleaved at every point."""

    def __call__(self, tmp: Path, path: Path, result: tuple[int, str]) -> tuple[int, str]:
        for _ in range(MAX_ROUNDS):
            self.pause("publish")
            if rename_noreplace(tmp, path):
                fsync_path(path.parent)
                return result
            adopted = self._taken(path)
            if adopted is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                # The other writer may be stopped before its directory fsync: the name we
                # mark done must survive a crash all the same.
                fsync_path(path.parent)
                self._count(ADOPTED)
                return adopted
        raise OSError(errno.EEXIST, f"invalid files kept taking the name {path.name}")

    def _taken(self, path: Path) -> tuple[int, str] | None:
        """The name is taken: the adopted file's (bytes, checksum), or None to try again."""
        self.pause("judge")
        judged = self._judge(path)
        if judged is None:
            return None  # gone, or replaced while we opened it: look again
        ident, valid = judged
        if valid is not None:
            self.pause("confirm")
            return valid if _ident(path) == ident else None
        aside = temp_name(path)  # a temp's name: swept if we die before removing it
        self.pause("move aside")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return None
        self.pause("check aside")
        if _ident(aside) == ident:
            self._count(REPLACED_INVALID)
        else:  # another writer's file came meanwhile: it goes back, replacing nothing
            self.pause("put back")
            if rename_noreplace(aside, path):
                return None
            self._count(DISPLACED)  # a third file took the name meanwhile
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        return None

    def _judge(self, path: Path) -> tuple[FileId, tuple[int, str] | None] | None:
        """(the file's identity, its (bytes, checksum) if it is a valid output of this
        sample, else None); None when nothing (or something else by now) has the name."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        ident = (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode):
            return ident, None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError:
            return ident, None  # unreadable to us: no file we could adopt
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != ident:
                return None
            return ident, self._valid(Path(f"/proc/self/fd/{fd}"))
        finally:
            os.close(fd)

    def _valid(self, path: Path) -> tuple[int, str] | None:
        from hsq.outputs.adopt import file_identity, file_states, judge_output

        rel = output_relpath(self.sample.id)
        meta = self.meta
        try:
            header = read_header(path)  # parsed once, for the three checks
        except (OSError, ValueError):  # gone, or unreadable: judge_output's "no" for these
            return None
        try:
            entry, _why = judge_output(
                path, rel, self.sample, self.run, self.store_dtype, self.prenorm, header
            )
            if entry is None:
                return None
            if file_identity(header) != (meta.model.model_id, list(meta.layer_ids)):
                return None
            if file_states(header) not in (None, (meta.dtype, meta.hidden_size)):
                return None
        except (ValueError, HsqError):  # a header too damaged to read: not adoptable
            return None  # (an OSError, e.g. EIO, propagates: the write is retried)
        return entry.bytes, entry.checksum

    def _count(self, what: str) -> None:
        if self.stats is not None:
            self.stats[what] = self.stats.get(what, 0.0) + 1.0


def _ident(path: Path) -> FileId | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
