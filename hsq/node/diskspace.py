"""Space set aside on the output disk for the private Redis's AOF.

OUT/.hsq/redis/ shares a disk with the outputs. When the outputs fill it, the workers
pause ("output disk full": the sample is handed back, nothing is lost) and resume once
there is space; but a redis-server that cannot append to its AOF refuses every write
(MISCONF), and then the workers' heartbeats and hand-backs fail and they exit. So the AOF
file it appends to gets blocks allocated ahead of its end (fallocate with
FALLOC_FL_KEEP_SIZE: the file's size and content stay the same, the blocks are reserved):
Redis's appends land in space the outputs cannot take. `tend` tops the reservation up
(every poll of `hsq run`), and follows a rewrite to the new file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from pathlib import Path

RESERVE_BYTES = 64 << 20
"""Ahead of the AOF's end: a worker's heartbeat and moves append some 100 bytes a second."""
SMALL_DISK_SHARE = 16
"""On a disk smaller than RESERVE_BYTES * this, a 1/this share of it."""
FALLOC_FL_KEEP_SIZE = 1


def _fallocate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return fn


_FALLOCATE = _fallocate()


class AofReserve:
    """The reservation ahead of the AOF's end in a redis-server's `workdir`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        stats = os.statvfs(workdir)
        self.size = min(RESERVE_BYTES, stats.f_frsize * stats.f_blocks // SMALL_DISK_SHARE)

    def current_file(self) -> Path | None:
        """The AOF file Redis appends to now: the manifest's last incremental file."""
        aof_dir = self.workdir / "appendonlydir"
        with contextlib.suppress(OSError):
            for manifest in aof_dir.glob("*.manifest"):
                incr = [ln.split()[1] for ln in manifest.read_text().splitlines()
                        if ln.startswith("file ") and ln.split()[-1] == "i"]  # fmt: skip
                if incr and "/" not in incr[-1]:
                    return aof_dir / incr[-1]
        return None

    def ahead(self) -> int:
        """Bytes allocated past the current file's end (0 if unknown)."""
        path = self.current_file()
        if path is None:
            return 0
        try:
            st = os.lstat(path)
        except OSError:
            return 0
        return max(0, st.st_blocks * 512 - st.st_size)

    def tend(self) -> bool:
        """Top the reservation up when half of it is used; False if the disk had no room
        (the reservation left is kept: that is what it is for)."""
        path = self.current_file()
        if path is None or _FALLOCATE is None or self.ahead() >= self.size // 2:
            return True
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return True
        try:
            end = os.fstat(fd).st_size
            return int(_FALLOCATE(fd, FALLOC_FL_KEEP_SIZE, end, self.size)) == 0
        finally:
            os.close(fd)
