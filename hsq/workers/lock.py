"""Exclusive ownership of a dump dir.

flock(2) on <dump_dir>/.hsq-worker.lock: the kernel drops the lock when its holder dies,
even by SIGKILL, so a stale lock needs no cleanup and can never be stolen from a live worker.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from hsq.errors import ConfigError

LOCK_NAME = ".hsq-worker.lock"


class DumpDirLock:
    def __init__(self, dump_dir: Path) -> None:
        self.path = dump_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, owner: str) -> None:
        # Never follow a link (as root, truncating the file a planted link names would
        # destroy it) and never block on a FIFO: a regular file or a clear error.
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open the dump dir lock {self.path}: {exc}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"the dump dir lock {self.path} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            raise ConfigError(
                f"dump dir {self.path.parent} is owned by another live worker ({holder}); "
                "each worker needs its own dump dir"
            ) from None
        info = {
            "worker": owner,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def holder_text(raw: bytes) -> str:
    """The lock file's record in words: `worker W, pid P on H, since 2026-12-01T17:58:35Z`
    (the record is JSON with a Unix time; anything else is shown as it is, shortened)."""
    text = raw.decode(errors="replace").strip()
    try:
        info = json.loads(text)
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(info["since"])))
        return f"worker {info['worker']}, pid {info['pid']} on {info['host']}, since {since}"
    except (ValueError, TypeError, KeyError, OverflowError, OSError):
        return text[:300] or "unknown"
