"""Trainer processes the streaming tests start (tests/support/streamtrainer.py): each in
its own process group, dying with the test process (a parent-death signal), and killed by
`no_trainer_left` after a failed test. A trainer waits for its stream through Redis
outages, so an orphan would wait for ever."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from hsq.node.spawn import on_parent_death

STARTED: list[subprocess.Popen[bytes]] = []


def start_trainer(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv), stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=cwd,
            env=None if env is None else dict(env), start_new_session=True,
            preexec_fn=on_parent_death(signal.SIGKILL),
        )  # fmt: skip
    STARTED.append(proc)
    return proc


@pytest.fixture
def no_trainer_left() -> Iterator[None]:
    yield
    while STARTED:
        proc = STARTED.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
