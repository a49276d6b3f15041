"""`hsq run`'s own Redis when none is given: a redis-server with its data under DIR/.hsq/.

State layout (DIR/.hsq/, mode 700):
    lock            flock: one `hsq run` per DIR at a time (released when it dies)
    redis-password  generated once, mode 600: the same DIR finds the same password
    redis-url       the URL of the Redis now running, mode 600 (`--redis-url-file` for
                    `hsq status` and for `hsq run --join` on another node)
    redis/          redis-server's dir: AOF (fsync every second), its log, auth.conf
    redis.pid       the redis-server this DIR started, to wait out one still shutting down

AOF with appendfsync everysec: a crash of the whole node loses at most the last second of
queue moves, which the queue's own recovery (held jobs of dead workers go back, `done`
entries are checked against files) absorbs; a crash of `hsq run` alone loses nothing
(redis-server gets SIGTERM when its parent dies and shuts down cleanly).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import signal
import time
from pathlib import Path
from typing import IO

from hsq.errors import ConfigError, HsqError, StoreError
from hsq.node.procs import RedisServer

STATE_DIR = ".hsq"


def state_dir(out: Path) -> Path:
    d = out / STATE_DIR
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    return d


def write_private(path: Path, text: str) -> None:
    """A mode-600 file, replaced whole (never readable by others, not even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class DirLock:
    """One `hsq run` per DIR: two would share one Redis AOF and one set of dump dirs."""

    def __init__(self, state: Path) -> None:
        self.path = state / "lock"
        self._file: IO[str] | None = None

    def acquire(self) -> DirLock:
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the run's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise ConfigError(
                f"another `hsq run` (pid {holder}) is using {self.path.parent.parent}: "
                "wait for it, or give this one another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def password(state: Path) -> str:
    """This DIR's Redis password: made on the first run, read back on every later one."""
    path = state / "redis-password"
    if path.exists():
        text = path.read_text().strip()
        if not text.isalnum():
            raise ConfigError(f"{path} is not a password hsq wrote: remove it with {state}/redis/")
        return text
    pw = secrets.token_hex(24)
    write_private(path, pw + "\n")
    return pw


def _wait_out_previous(state: Path, workdir: Path, timeout: float = 30.0) -> None:
    """A redis-server of a killed `hsq run` on this DIR gets SIGTERM with its parent's
    death and writes its AOF out: wait for it (it is ours only if its command line names
    our dir), so two servers never share the AOF."""
    pidfile = state / "redis.pid"
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return
    if str(workdir) not in cmdline:
        return  # the pid was reused by an unrelated process
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if Path(f"/proc/{pid}").exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def start_private_redis(state: Path) -> RedisServer:
    """Start (or restart, on the data a previous run left) this DIR's redis-server."""
    workdir = state / "redis"
    _wait_out_previous(state, workdir)
    server = RedisServer(
        workdir,
        password=password(state),
        appendonly=True,
        # Its own session: a terminal's Ctrl-C reaches hsq and its workers, and the
        # workers hand their jobs back to a Redis that is still up; hsq stops it last.
        new_session=True,
        parent_death_signal=signal.SIGTERM,
    )
    write_private(state / "redis.pid", f"{server.pid}\n")
    try:
        server.wait_ready()
    except HsqError as exc:
        server.stop()
        raise StoreError(f"the private redis-server in {workdir} did not start: {exc}") from exc
    write_private(state / "redis-url", server.url + "\n")
    return server
