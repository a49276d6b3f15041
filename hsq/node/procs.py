"""Child processes that hsq manages itself: the demo, the benchmarks and the tests use them.

Real processes only: a project-owned redis-server on a free port and reference servers
started through the `hsq` CLI, each logging to its own file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

import httpx

from hsq.errors import ConfigError, HsqError
from hsq.node.spawn import FRESH, ChildProcess, Spawner, SpawnRequest


def python_module(*module: str) -> list[str]:
    """`python -m MODULE...` by this interpreter. For hsq's own modules with -P (safe path):
    the current directory is not put first on sys.path, so a directory that holds a clone
    named `hsq/` (where a user naturally starts `hsq run`) cannot shadow the installed
    package in every server and worker. PYTHONPATH and the venv's site-packages still
    apply. Other modules (the tests' servers, `python -m tests.support...`) are found from
    the current directory as before."""
    safe = ["-P"] if module[:1] == ("hsq",) else []
    return [sys.executable, *safe, "-m", *module]


def hsq_command(*args: str) -> list[str]:
    """`hsq ARGS...` run by this interpreter (works without the console script on PATH)."""
    return [*python_module("hsq"), *args]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def low_port() -> int:
    """A free port below 50000: SGLang 0.5.15 derives its gRPC port as port + 10000 and
    refuses one above 65535 (seen live with a random port of 57905)."""
    while True:
        port = free_port()
        if port < 50000:
            return port


class ManagedProcess:
    """A child process with its own log file; stopped (TERM, then KILL) on exit.

    ``new_session``: the child leads its own process group (a server that forks children,
    as SGLang forks its schedulers): `signal_group` reaches all of them, and `stop` ends
    the whole group. ``parent_death_signal`` (Linux): the signal the child gets when this
    process dies, even by SIGKILL, so a supervisor's crash leaves no orphan behind.
    ``spawner``: where the child comes from (tests.support.spawner); a fresh exec unless given.
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        new_session: bool = False,
        parent_death_signal: int | None = None,
        spawner: Spawner | None = None,
    ):
        self.argv = list(argv)
        self.log_path = log_path
        self.new_session = new_session
        log_path.parent.mkdir(parents=True, exist_ok=True)
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        request = SpawnRequest(self.argv, log_path, child_env, new_session, parent_death_signal)
        self.proc: ChildProcess = (spawner or FRESH).spawn(request)

    @property
    def spawned_by(self) -> str:
        """ "zygote" (forked from the session's zygote) or "fresh" (exec'd)."""
        return str(getattr(self.proc, "spawned_by", "fresh"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """`sig` to the child's whole process group (``new_session`` children only)."""
        if not self.new_session:
            raise HsqError("signal_group needs a child started with new_session=True")
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.new_session:  # children that outlived their leader
            self.signal_group(signal.SIGKILL)
        return self.proc.returncode

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def wait_http_ok(url: str, proc: ManagedProcess, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise HsqError(f"{proc.argv[0]} exited with {proc.proc.returncode}:\n{proc.log_tail()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise HsqError(f"{url} not healthy after {timeout:.0f}s:\n{proc.log_tail()}")


class DumpServer(ManagedProcess):
    """A server that writes dumps, as a child process on a free port; `module` is what
    `python -m` runs (it takes --dump-dir and --port). ``spawner`` None: a fresh exec
    (hsq.node.spawn.FRESH); the tests pass their zygote's."""

    module: tuple[str, ...] = ()

    def __init__(
        self,
        dump_dir: Path,
        log_path: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        parent_death_signal: int | None = None,
        spawner: Spawner | None = None,
    ) -> None:
        self.port = port or free_port()
        self.dump_dir = dump_dir
        self.url = f"http://127.0.0.1:{self.port}"
        dump_dir.mkdir(parents=True, exist_ok=True)
        argv = [*python_module(*self.module), "--dump-dir", str(dump_dir)]
        super().__init__(
            [*argv, "--port", str(self.port), *args],
            log_path,
            env,
            parent_death_signal=parent_death_signal,
            spawner=spawner or FRESH,
        )

    def wait_ready(self, timeout: float = 120.0) -> Self:
        wait_http_ok(self.url + "/health", self, timeout)
        return self


class ReferenceServer(DumpServer):
    """`hsq serve-reference` as a child process on a free port, bound to loopback. Its
    /admin/* endpoints stay off unless `args` holds --admin: a run's server takes fault
    rules from no one (another user's would change the run's states)."""

    module = ("hsq", "serve-reference")


class RedisServer(ManagedProcess):
    """A private redis-server: its own directory, optional password and AOF; on a free
    loopback port, or (``unixsocket``) on a Unix socket only, with no TCP port at all.

    ``tls``: (port, bind address, certificate, key): a TLS listener besides, the only
    TCP one (clients are not asked for certificates; they authenticate with a password).
    ``conf_lines``: more redis.conf lines (ACL users), in the mode-600 config file."""

    def __init__(
        self,
        workdir: Path,
        *,
        password: str | None = None,
        appendonly: bool = False,
        port: int | None = None,
        bind: Sequence[str] = ("127.0.0.1",),
        unixsocket: Path | None = None,
        tls: tuple[int, str, Path, Path] | None = None,
        conf_lines: Sequence[str] = (),
        new_session: bool = False,
        parent_death_signal: int | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError(
                "redis-server not found: run `make setup` (installs it) or set "
                "REDIS_URL to an existing Redis"
            )
        self.port = 0 if unixsocket is not None else (port or free_port())
        workdir.mkdir(parents=True, exist_ok=True)
        if tls is not None:
            bind = (tls[1],)
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            *bind,
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if appendonly else "no",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "yes",
        ]
        if unixsocket is not None:
            argv += ["--unixsocket", str(unixsocket), "--unixsocketperm", "700"]
        if tls is not None:
            tls_port, _host, cert, key = tls
            argv += ["--tls-port", str(tls_port), "--tls-cert-file", str(cert)]
            argv += ["--tls-key-file", str(key), "--tls-auth-clients", "no"]
        lines = [*conf_lines]
        if password:
            lines.insert(0, f'requirepass "{_conf_quote(password)}"')
        if lines:
            # In a mode-600 config file, never on the command line (`ps` shows argv to all).
            conf = workdir / "auth.conf"
            with contextlib.suppress(FileNotFoundError):
                conf.unlink()
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(line + "\n" for line in lines))
            argv.insert(1, str(conf))  # redis-server CONF [--options]
        auth = f":{quote(password, safe='')}@" if password else ""
        if unixsocket is not None:
            self.url = f"unix://{auth}{quote(str(unixsocket))}?db=0"
        else:
            self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        super().__init__(
            argv,
            workdir / "redis.log",
            new_session=new_session,
            parent_death_signal=parent_death_signal,
        )

    def wait_ready(self, timeout: float = 20.0) -> RedisServer:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url)
        while time.monotonic() < deadline:
            if not self.alive():
                raise HsqError(f"redis-server exited:\n{self.log_tail()}")
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
            finally:
                client.close()
        raise HsqError(f"redis-server not ready after {timeout:.0f}s:\n{self.log_tail()}")


def _conf_quote(text: str) -> str:
    """A redis.conf double-quoted string's body."""
    return "".join(c if c.isalnum() else f"\\x{ord(c):02x}" for c in text)


def worker_process(
    run: str,
    server_url: str,
    dump_dir: Path,
    redis_url: str,
    log_path: Path,
    *extra: str,
    prefix: Sequence[str] = (),
    parent_death_signal: int | None = None,
    spawner: Spawner | None = None,
) -> ManagedProcess:
    """`hsq worker` for one server; `prefix` runs it elsewhere (e.g. `ip netns exec NS`).
    The Redis URL (a password) goes in the environment, never on the command line.
    ``spawner``: a fresh exec unless given (the tests pass their zygote's)."""
    argv = hsq_command(
        "worker", "--run", run, "--server", server_url, "--dump-dir", str(dump_dir), *extra
    )
    return ManagedProcess(
        [*prefix, *argv],
        log_path,
        env={"HSQ_REDIS_URL": redis_url},
        parent_death_signal=parent_death_signal,
        spawner=spawner,
    )


def exporter_process(redis_url: str, port: int, log_path: Path) -> ManagedProcess:
    return ManagedProcess(
        hsq_command("exporter", "--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
        log_path,
        env={"HSQ_REDIS_URL": redis_url},
    )
