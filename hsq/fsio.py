"""Filesystem primitives: safe opens of untrusted files, removal without following links,
and durable writes (temp file, fsync, rename, fsync of the directory).

Every durable writer of hsq goes through here: a dump (hsq.dump.write), the readiness
marker (hsq.dump.ready), an output file (hsq.outputs.durable), the exports. So the idiom is
written once, and a fault in it is fixed once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hsq.errors import OUTPUT_READ_ONLY, CorruptDumpError, OutputError

T = TypeVar("T")
Publish = Callable[[Path, Path, T], T]
"""How a complete, fsynced temp file takes its name: (tmp, path, what fill returned) ->
what the write returns."""

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
FOREIGN_TEMP_AGE_S = 600.0
"""A temp file from another host this old has no live writer: one sample writes in seconds."""


# ---------------------------------------------------------------------------- reading


def open_regular(path: Path) -> int:
    """Open a file that a server (or anyone who can write the dump dir) made, for reading.

    Only a regular file is opened: a FIFO would block open() (and with it the dispatcher's
    lock, the heartbeat and SIGTERM), a device may act on open, a symlink may lead out of
    the dump dir. So: lstat first, then open with O_NONBLOCK | O_NOFOLLOW, then fstat the
    descriptor and check it is the same regular file (nothing swapped in between).
    CorruptDumpError if it is not a regular file; OSError if it cannot be opened.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptDumpError(f"{path} is not a regular file ({entry_kind(st.st_mode)})")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise CorruptDumpError(f"{path} was replaced while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a regular file (open_regular): never a whole file of
    a server's choosing."""
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def entry_kind(mode: int) -> str:
    """What a directory entry is, in words (for error messages)."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def is_real_dir(path: Path) -> bool:
    """A directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_entry(path: Path) -> bool:
    """Remove a directory entry of any kind without following a link: a real directory
    with its contents, anything else (a symlink, a file, a FIFO) by unlink. True when
    nothing is left at ``path`` (also when it was already gone)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links inside
        else:
            os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return not os.path.lexists(path)


# ---------------------------------------------------------------------------- writing


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory: the names in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """A small file written whole (meta.json, a marker), fsynced unless told not to. For a
    file inside a directory that is itself renamed into place afterwards (a dump)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def rename_durably(src: Path, dst: Path, *, fsync: bool = True) -> None:
    """Rename, then fsync the destination's directory so the new name survives a crash."""
    os.rename(src, dst)
    if fsync:
        fsync_path(dst.parent)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_NOREPLACE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


def _load_renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Give `src` the name `dst` only if no entry has that name: True if it did, False if
    `dst` exists (`src` is left as it was). Never replaces, whoever else writes `dst`.

    renameat2(RENAME_NOREPLACE): one syscall, as a plain rename. Where the filesystem or
    libc lacks it (NFS, older kernels), link(2), which fails on an existing name too, then
    unlink of `src` (one syscall more); where hard links are refused as well (FAT, some
    FUSE), a look and a plain rename, which a writer racing in between can defeat
    (docs/reliability.md)."""
    if _renameat2 is not None:
        names = os.fsencode(src), os.fsencode(dst)
        if _renameat2(_AT_FDCWD, names[0], _AT_FDCWD, names[1], _RENAME_NOREPLACE) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code not in _NOREPLACE_UNSUPPORTED:
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        if os.path.lexists(dst):
            return False
        os.rename(src, dst)
        return True
    with contextlib.suppress(OSError):  # both names hold the file; a left temp is swept
        os.unlink(src)
    return True


def temp_name(path: Path) -> Path:
    """The temp file beside `path` that a write of `path` fills: named after its writer
    (host, pid), so whoever writes `path` next can remove what a killed writer left."""
    return path.with_name(f".{path.name}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_atomically(
    path: Path,
    fill: Callable[[int], T],
    *,
    fsync: bool = True,
    mode: int = 0o644,
    stats: dict[str, float] | None = None,
    before_rename: Callable[[], None] | None = None,
    publish: Publish[T] | None = None,
) -> T:
    """`fill(fd)` a new temp file beside `path`, fsync it, rename it to `path`, fsync the
    directory: a reader sees the old file or the whole new one, never a part. Any failure
    (an OSError included, which propagates) leaves no temp behind.

    `before_rename()` runs last before the rename and may raise (nothing is renamed then);
    `stats` gets the seconds of the two fsyncs (fsync_s) and of before_rename (check_s).
    `fsync=False` keeps the rename's atomicity without the durability (tmpfs).
    `publish(tmp, path, result)` gives the temp its name instead of the replacing rename
    (and fsyncs the directory) and returns what the write yields: an output file's writer
    never replaces another's (hsq.outputs.publish)."""
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            result = fill(fd)
            t0 = time.perf_counter()
            if fsync:
                os.fsync(fd)
            t1 = time.perf_counter()
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        t2 = time.perf_counter()
        if publish is None:
            rename_durably(tmp, path, fsync=fsync)
        else:
            result = publish(tmp, path, result)
        if stats is not None:
            stats["fsync_s"] = stats.get("fsync_s", 0.0) + t1 - t0 + time.perf_counter() - t2
            stats["check_s"] = stats.get("check_s", 0.0) + t2 - t1
    except BaseException:
        _discard(tmp)  # never in place of the error that got us here
        raise
    return result


def _discard(tmp: Path) -> None:
    """Remove a failed write's temp, best effort: on a filesystem gone read-only the
    unlink itself raises EROFS, which must not replace the write's own error (the temp
    stays; the next write of that sample removes it once this process is gone)."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


def write_durably(
    path: Path,
    fill: Callable[[int], T],
    *,
    stats: dict[str, float] | None = None,
    before_rename: Callable[[], None] | None = None,
    publish: Publish[T] | None = None,
) -> T:
    """write_atomically for the files a run produces (outputs, exports): the directory is
    made if missing, a disk that refuses (full, read-only, ...) is an OutputError (making
    the directory too: a new shard's mkdir is the first write to fail on a filesystem
    remounted read-only), and the temps that killed writers left of `path` are removed
    afterwards (sweep_dead_temps)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        result = write_atomically(
            path, fill, stats=stats, before_rename=before_rename, publish=publish
        )
    except OSError as exc:
        raise output_error(f"cannot write {path}", exc) from exc
    sweep_dead_temps(path)
    return result


def output_error(what: str, exc: OSError) -> OutputError:
    """The OutputError for a filesystem that refused a write, named by its cause: a full
    disk, a read-only filesystem (reason ``output_read_only``), or the OS's words."""
    if exc.errno == errno.EROFS:
        return OutputError(f"{what}: read-only file system", reason=OUTPUT_READ_ONLY)
    cause = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return OutputError(f"{what}: {cause}")


def sweep_dead_temps(path: Path) -> None:
    """Remove temps of `path` whose writer is dead (kill -9 mid-write leaves one).

    Same host: the pid is gone. Another host: older than FOREIGN_TEMP_AGE_S. A live
    duplicate writer's temp is never touched, so its rename still lands. Best effort."""
    prefix = f".{path.name}."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix) : -len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        host, pid = parts[0], int(parts[1])
        temp = path.parent / name
        try:
            if host == HOST:
                if pid == os.getpid() or _alive(pid):
                    continue
            elif time.time() - temp.stat().st_mtime < FOREIGN_TEMP_AGE_S:
                continue
            temp.unlink()
        except OSError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True
