"""How hsq starts a child process: the port (Spawner) and the one production uses, a fresh
fork and exec (FreshSpawner). `hsq run` and `hsq demo` start every server and worker
through it; the tests pass a spawner of their own (tests/support/spawner.py forks from a
zygote that imported torch once) where a start's cost matters more than its freshness.
Nothing here is looked up from a global: a caller passes its spawner or gets FRESH.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol


class ChildProcess(Protocol):
    """What ManagedProcess needs of its child: subprocess.Popen's subset."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class SpawnRequest:
    argv: list[str]
    log_path: Path
    """The child's stdout, and its stderr unless `stderr_path` is given."""
    env: dict[str, str]
    """The child's whole environment."""
    new_session: bool = False
    parent_death_signal: int | None = None
    stderr_path: Path | None = None


class Spawner(Protocol):
    name: str

    def spawn(self, req: SpawnRequest) -> ChildProcess: ...


class FreshSpawner:
    """fork and exec (subprocess.Popen): the child starts from nothing."""

    name = "fresh"

    def spawn(self, req: SpawnRequest) -> ChildProcess:
        # The child keeps its own copies of the descriptors.
        with open(req.log_path, "ab") as log, _stderr_file(req) as err:
            return subprocess.Popen(
                req.argv,
                stdout=log,
                stderr=subprocess.STDOUT if err is None else err,
                env=req.env,
                start_new_session=req.new_session,
                preexec_fn=None
                if req.parent_death_signal is None
                else on_parent_death(req.parent_death_signal),
            )


FRESH = FreshSpawner()


@contextlib.contextmanager
def _stderr_file(req: SpawnRequest) -> Iterator[BinaryIO | None]:
    if req.stderr_path is None:
        yield None
        return
    with open(req.stderr_path, "ab") as err:
        yield err


def on_parent_death(sig: int) -> Callable[[], None]:
    """A preexec function: prctl(PR_SET_PDEATHSIG, sig), where the platform has it. The
    signal comes when the *thread* that started the child ends (Linux's rule)."""

    def arm() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # 1: PR_SET_PDEATHSIG

    return arm
