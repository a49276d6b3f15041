"""OUT/.hsq: `hsq run`'s state directory, trusted only once it is checked.

What lies in it (the Redis password in its URL files and auth.conf, the AOF, logs, the
lock) is as good as the run's queue, so it is read only from a directory that

    - hsq made itself (mkdir, which fails if the name exists), or that exists already and
      is a real directory (no symlink) owned by the running user;
    - no other user can write (no group/other write bit): nobody could have planted a
      file in it, so a name in it is hsq's own;

and every file in it is opened with O_NOFOLLOW (a link planted before the check, or by the
user by mistake, is refused, never followed). A directory that fails the check is refused
with one line that names the fix; hsq never chmods or chowns what another user made.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
from pathlib import Path

from hsq.errors import ConfigError

STATE_DIR = ".hsq"
PRIVATE_FILE = os.O_NOFOLLOW | os.O_CLOEXEC


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def check_private_dir(d: Path, what: str = "hsq's state directory") -> None:
    """Raise ConfigError unless `d` is a real directory of the running user that no other
    user can write."""
    try:
        st = os.lstat(d)
    except OSError as exc:
        raise ConfigError(f"cannot use {what} {d}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"{what} {d} is not a directory (a link or a file): remove it, or give another --out"
        )
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"{what} {d} belongs to {_user(st.st_uid)}, not to you ({_user(os.geteuid())}): "
            f"it could hold their password and files; remove it (`rm -rf {d}`, as its owner "
            "or root) or give another --out"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"{what} {d} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"anything in it may be planted; remove it (`rm -rf {d}`) or give another --out"
        )


def private_dir(d: Path, what: str = "hsq's state directory") -> Path:
    """`d`, made now with mode 700 if it does not exist, checked (check_private_dir)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    check_private_dir(d, what)
    if stat.S_IMODE(os.lstat(d).st_mode) & 0o077:
        os.chmod(d, 0o700)  # ours, not writable by others: only tighten the read bits
    return d


def state_dir(out: Path) -> Path:
    """OUT/.hsq, made or checked (module docstring); OUT itself is made if missing."""
    out.mkdir(parents=True, exist_ok=True)
    return private_dir(out / STATE_DIR)


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """A descriptor on a regular file in a checked directory, never through a link."""
    try:
        fd = os.open(path, flags | PRIVATE_FILE, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link: hsq does not follow links in its state "
                f"directory; remove it (`rm {path}`)"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file of yours: remove it (`rm {path}`)")
    return fd


def read_private(path: Path, limit: int = 1 << 16) -> str | None:
    """A small file of the state directory as text; None if it does not exist."""
    try:
        fd = open_private(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit).decode(errors="replace")


def write_private(path: Path, text: str) -> None:
    """A mode-600 file, replaced whole (never readable by others, not even briefly): a
    fresh temp name (O_EXCL: never an existing file or link), fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_private(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class DirLock:
    """One user of OUT's Redis and dump dirs at a time (`hsq run`, or a command that
    started OUT's Redis for itself): two would share one AOF and one set of dump dirs."""

    def __init__(self, state: Path) -> None:
        self.path = state / "lock"
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """True if this process holds the lock now; False if another one does."""
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return True

    def holder(self) -> str:
        text = (read_private(self.path, 64) or "").strip()
        if not text.isdigit():
            return "?"
        try:
            argv = Path(f"/proc/{text}/cmdline").read_bytes().split(b"\0")
            words = [a.decode(errors="replace") for a in argv if a]
            hsq = words[words.index("hsq") :] if "hsq" in words else words[-2:]
            return f"pid {text}: {' '.join(hsq[:2])}"
        except OSError:
            return f"pid {text}"

    def acquire(self) -> DirLock:
        if not self.try_acquire():
            raise ConfigError(
                f"another hsq command ({self.holder()}) is using {self.path.parent.parent}: "
                "wait for it, or give this one another --out"
            )
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
