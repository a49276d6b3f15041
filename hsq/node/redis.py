"""`hsq run`'s own Redis when none is given: a redis-server with its data under OUT/.hsq/.

State layout (OUT/.hsq/, mode 700, checked before use: hsq/node/statedir.py):
    lock            flock: one user of OUT's Redis at a time (released when it dies)
    redis-url       while that Redis runs: its URL, mode 600, removed when it stops
    join-url        with --listen, while it runs: the URL other hosts join with (TLS, the
                    run's own ACL user, the certificate to check the server by)
    redis/          redis-server's dir: AOF (fsync every second), its log, auth.conf, and
                    its Unix socket (redis.sock) where the path is short enough
    tls/            with --listen: the run's self-signed certificate and key
    redis.pid       the redis-server this DIR started, to wait out one still shutting down

Why a Unix socket and no TCP port by default: the socket lies in a directory only the
running user can enter, so no other local user can connect to it, take its address over
once it is gone, or read a password on a wire; and every client checks who serves a
socket before it sends anything (hsq.store.connection.check_peer), so even a stale URL
file (a socket path under /tmp when OUT's path is too long for one) leaks nothing. The
password is new at every start (a password of an earlier start is worth nothing).

Other hosts (`--listen HOST[:PORT]`): a TLS port on HOST, with a certificate made at this
start and pinned in join-url (the client checks the server before it sends the password),
and a per-run ACL user (`hsq acl --run`'s rules), which can reach no other run's keys.

AOF with appendfsync everysec: a crash of the whole node loses at most the last second of
queue moves, which the queue's own recovery absorbs; a crash of `hsq run` alone loses
nothing (redis-server gets SIGTERM when its parent dies and shuts down cleanly). The AOF
has space set aside on the output disk (hsq/node/diskspace.py): a full output disk
pauses the workers, never the queue.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from hsq.errors import ConfigError, HsqError, StoreError
from hsq.keys import RunKeys
from hsq.node.diskspace import AofReserve
from hsq.node.procs import RedisServer, free_port
from hsq.node.statedir import (
    STATE_DIR,
    DirLock,
    check_private_dir,
    private_dir,
    read_private,
    remove_private,
    state_dir,
    write_private,
)

__all__ = ["STATE_DIR", "DirLock", "Listen", "PrivateRedis", "start_private_redis", "state_dir"]

URL_FILE = "redis-url"
JOIN_URL_FILE = "join-url"
MAX_SOCKET_PATH = 100
"""sun_path holds 108 bytes with its NUL; a longer path gets a private directory in /tmp."""


@dataclass(frozen=True)
class Listen:
    """`--listen HOST[:PORT]`: where other hosts reach the run's Redis (TLS)."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Listen:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = text, ""
        if not host or (port and not port.isdigit()) or (port and not 0 < int(port) < 65536):
            raise ConfigError(f"--listen {text!r}: give HOST or HOST:PORT (e.g. 10.0.0.5:6380)")
        return cls(host, int(port) if port else None)

    @property
    def advertised(self) -> str:
        """The name the join URL gives: HOST, or this host's name for a wildcard bind."""
        return socket.getfqdn() if self.host in ("0.0.0.0", "::") else self.host


def _san(names: list[str]) -> str:
    parts = []
    for name in dict.fromkeys(names):
        try:
            ipaddress.ip_address(name)
            parts.append(f"IP:{name}")
        except ValueError:
            parts.append(f"DNS:{name}")
    return ",".join(parts)


def make_certificate(tls: Path, names: list[str]) -> tuple[Path, Path]:
    """A new self-signed certificate for `names` and its key, in `tls` (a private dir).
    Made at every start: the join URL pins it, so an old key is worth nothing."""
    cert, key = tls / "server.pem", tls / "server.key"
    for path in (cert, key):
        remove_private(path)
    os.close(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("--listen needs the openssl command (to make the run's certificate)")
    argv = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "3650", "-subj", "/CN=hsq-run-redis", "-addext",
            f"subjectAltName={_san(names)}", "-keyout", str(key), "-out", str(cert)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StoreError(f"openssl could not make the run's certificate: {done.stderr[-300:]}")
    return cert, key


def _wait_out_previous(state: Path, workdir: Path, timeout: float = 30.0) -> None:
    """A redis-server of a killed `hsq run` on this DIR gets SIGTERM with its parent's
    death and writes its AOF out: wait for it (it is ours only if its command line names
    our dir), so two servers never share the AOF."""
    try:
        pid = int((read_private(state / "redis.pid", 64) or "").strip())
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


class PrivateRedis:
    """OUT's redis-server while this process runs it; `stop` removes its URL files first."""

    def __init__(self, state: Path, *, run: str | None = None, listen: Listen | None = None):
        self.state = state
        workdir = private_dir(state / "redis", "hsq's Redis directory")
        _wait_out_previous(state, workdir)
        for name in (URL_FILE, JOIN_URL_FILE):
            remove_private(state / name)  # a stale one names a server that is gone
        self._tmp: Path | None = None
        sock = workdir / "redis.sock"
        if len(str(sock)) > MAX_SOCKET_PATH:  # private (0700) and checked on connect
            self._tmp = Path(tempfile.mkdtemp(prefix="hsq-redis-"))
            sock = self._tmp / "redis.sock"
        password = secrets.token_hex(24)  # new at every start
        tls, conf, self.join_url = None, [], None
        if listen is not None:
            if run is None:
                raise ConfigError("--listen serves one run: give the run")
            names = [listen.advertised, socket.gethostname(), "localhost"]
            cert, key = make_certificate(private_dir(state / "tls", "hsq's TLS directory"), names)
            port = listen.port or free_port(listen.host)
            tls = (port, listen.host, cert, key)
            keys, run_pw = RunKeys(run), secrets.token_hex(24)
            user = f"hsq-{run}"
            conf.append(keys.acl_user(user, run_pw))
            pem = quote(cert.read_text(), safe="")
            self.join_url = (f"rediss://{quote(user, safe='')}:{run_pw}@{listen.advertised}:"
                             f"{port}/0?ssl_ca_data={pem}")  # fmt: skip
        self.server = RedisServer(
            workdir,
            password=password,
            appendonly=True,
            unixsocket=sock,
            tls=tls,
            conf_lines=conf,
            # Its own session: a terminal's Ctrl-C reaches hsq and its workers, and the
            # workers hand their jobs back to a Redis that is still up; hsq stops it last.
            new_session=True,
            parent_death_signal=signal.SIGTERM,
        )
        self.socket = sock
        self.url = self.server.url
        write_private(state / "redis.pid", f"{self.server.pid}\n")
        try:
            self.server.wait_ready()
        except HsqError as exc:
            self.stop()
            raise StoreError(f"the private redis-server in {workdir} did not start: {exc}") from exc
        self.reserve = AofReserve(workdir)
        self.reserve.tend()
        write_private(state / URL_FILE, self.url + "\n")
        if self.join_url is not None:
            write_private(state / JOIN_URL_FILE, self.join_url + "\n")

    @property
    def where(self) -> str:
        tls = self.server.argv[self.server.argv.index("--tls-port") + 1] if self.join_url else ""
        return f"socket {self.socket}" + (f", TLS port {tls} (join-url)" if tls else "")

    def alive(self) -> bool:
        return self.server.alive()

    def stop(self) -> None:
        for name in (URL_FILE, JOIN_URL_FILE):
            remove_private(self.state / name)
        self.server.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def start_private_redis(
    state: Path, *, run: str | None = None, listen: Listen | None = None
) -> PrivateRedis:
    """Start (or restart, on the data a previous run left) this DIR's redis-server."""
    return PrivateRedis(state, run=run, listen=listen)


def is_private_url_file(path: Path) -> bool:
    """OUT/.hsq/redis-url: the URL file of an OUT's own Redis (which may be stopped)."""
    return path.name == URL_FILE and path.parent.name == STATE_DIR


def url_for_reader(url_file: Path) -> tuple[str, PrivateRedis | None, DirLock | None]:
    """The URL of OUT's Redis for a command given OUT/.hsq/redis-url: the running one's
    (its `hsq run` holds the lock), or, when none runs, OUT's Redis started now for this
    command (it holds the lock until it stops it: a later `hsq run` on OUT waits for it
    with a clear message instead of sharing the AOF)."""
    state = url_file.parent
    check_private_dir(state)  # before anything in it is read
    if not (state / "redis").is_dir():
        raise ConfigError(f"{state} holds no Redis data: is {state.parent} an `hsq run` --out?")
    lock = DirLock(state)
    if not lock.try_acquire():
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:  # its Redis may be starting
            text = read_private(state / URL_FILE)
            if text and text.strip():
                return text.strip(), None, None
            time.sleep(0.2)
        raise ConfigError(f"{url_file} is missing while {lock.holder()} holds {state.parent}")
    try:
        redis = start_private_redis(state)
    except BaseException:
        lock.release()
        raise
    return redis.url, redis, lock
