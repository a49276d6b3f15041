"""The tests' dump servers: hsq's own (hsq.node.procs) started from the session's zygote
by default (tests/support/spawner.py), and the two that exist only for tests and
benchmarks, the null-model server and the vLLM-shaped one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hsq.node import procs
from hsq.node.procs import DumpServer
from hsq.node.spawn import Spawner
from tests.support.spawner import installed


class ReferenceServer(procs.ReferenceServer):
    """`hsq serve-reference`, forked from the installed zygote unless a spawner is given,
    with its /admin/* endpoints on unless `admin` is False (tests pause it and set fault
    rules)."""

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
            spawner=spawner or installed(),
        )


class _TestServer(DumpServer):
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
            port=port,
            args=args,
            env=env,
            parent_death_signal=parent_death_signal,
            spawner=spawner or installed(),
        )


class NullServer(_TestServer):
    """The null-model server (tests.support.nullserver) as a child process on a free port:
    valid dumps of a chosen shape at once, so a worker runs at its own ceiling."""

    module = ("tests.support.nullserver",)


class FakeVllmServer(_TestServer):
    """The vLLM-shaped server (tests.support.fakevllm: completions API, hsq's connector core)
    as a child process on a free port; args take --model and --layers."""

    module = ("tests.support.fakevllm",)
