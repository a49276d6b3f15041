"""The tests' dump servers: hsq's own (hsq.node.procs) started from the session's zygote
by default (tests/support/spawner.py), and the two that exist only for tests and
benchmarks, the null-model server and the vLLM-shaped one.

Each holds its port from the moment it is chosen until its server answers on it, and then
checks that the server answering is its own. hsq.node.procs.free_port lets the port go
before the child binds it: in that gap another test's server (tests run two at a time)
or a sibling started beside it could take it; the child then fails to bind, while
wait_ready's /health is answered by the other server, and a worker sent there waited for
dumps that went elsewhere (seen once: `hook_inactive`, "no dump at all appeared in
.../b/dumps", in tests/test_persist_procs.py's woken-worker test)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import httpx

from hsq.errors import HsqError
from hsq.node import procs
from hsq.node.procs import DumpServer
from hsq.node.spawn import Spawner
from tests.support.spawner import installed


def hold_port() -> socket.socket:
    """A free loopback port, bound but not listening, with SO_REUSEADDR: no bind(0) and no
    outgoing connection gets it while this socket is open, and a server that binds it with
    SO_REUSEADDR too (every server here does: http.server's and hsq's ApiServer) can still
    listen on it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class _OwnPort(DumpServer):
    """A dump server forked from the installed zygote unless a spawner is given, on a port
    held for it (hold_port) until it answers there, and checked to be the one answering
    (its /server_info names its dump dir, where it has one)."""

    _hold: socket.socket | None = None

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
        super().__init__(
            dump_dir,
            log_path,
            port=self._held(port),
            args=args,
            env=env,
            parent_death_signal=parent_death_signal,
            spawner=spawner or installed(),
        )

    def _held(self, port: int | None) -> int:
        if port is not None:  # given (e.g. a restart on its old port): the caller's
            return port
        self._hold = hold_port()
        return int(self._hold.getsockname()[1])

    def _release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.close()

    def wait_ready(self, timeout: float = 120.0) -> Self:
        try:
            super().wait_ready(timeout)
        finally:
            self._release()
        self._check_ours()
        return self

    def _check_ours(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            info = httpx.get(self.url + "/server_info", timeout=5.0).json()
            theirs = info.get("dump_dir") if isinstance(info, dict) else None
            if theirs is not None and os.path.realpath(theirs) != os.path.realpath(self.dump_dir):
                raise HsqError(
                    f"port {self.port} is answered by another server (dumping to {theirs}, "
                    f"not {self.dump_dir}):\n{self.log_tail()}"
                )

    def stop(self, timeout: float = 10.0) -> int | None:
        self._release()
        return super().stop(timeout)


class ReferenceServer(_OwnPort, procs.ReferenceServer):
    """`hsq serve-reference` as _OwnPort starts it, with its /admin/* endpoints on unless
    `admin` is False (tests pause it and set fault rules)."""

    def __init__(
        self,
        dump_dir: Path,
        log_path: Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        parent_death_signal: int | None = None,
        admin: bool = True,
        spawner: Spawner | None = None,
    ) -> None:
        super().__init__(
            dump_dir,
            log_path,
            port=port,
            args=["--admin", *args] if admin and "--admin" not in args else args,
            env=env,
            parent_death_signal=parent_death_signal,
            spawner=spawner,
        )


class NullServer(_OwnPort):
    """The null-model server (tests.support.nullserver) as a child process on a free port:
    valid dumps of a chosen shape at once, so a worker runs at its own ceiling."""

    module = ("tests.support.nullserver",)


class FakeVllmServer(_OwnPort):
    """The vLLM-shaped server (tests.support.fakevllm: completions API, hsq's connector core)
    as a child process on a free port; args take --model and --layers."""

    module = ("tests.support.fakevllm",)
