"""A worker started beside its server waits for the dump dir the server makes, creating
nothing; a server that answers while the dir is still missing means a mistyped --dump-dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsq.errors import ConfigError
from hsq.workers.startup import require_dump_dir


def test_waits_for_the_servers_dump_dir_while_the_server_starts(tmp_path: Path) -> None:
    d = tmp_path / "dumps"
    polls = []

    def healthy() -> bool:  # the server comes up after making its dir
        polls.append(1)
        if len(polls) == 3:
            d.mkdir(mode=0o700)
        return len(polls) > 3

    require_dump_dir(d, False, healthy, poll_s=0.0)
    assert d.is_dir() and len(polls) == 3


def test_a_server_up_without_the_dir_is_a_typo_and_nothing_is_created(tmp_path: Path) -> None:
    d = tmp_path / "no" / "such"
    with pytest.raises(ConfigError, match="does not exist"):
        require_dump_dir(d, False, lambda: True, poll_s=0.0)
    assert not (tmp_path / "no").exists()


def test_a_dir_that_never_comes_ends_at_the_deadline(tmp_path: Path) -> None:
    t = iter(range(100))
    with pytest.raises(ConfigError, match="does not exist"):
        require_dump_dir(tmp_path / "x", False, lambda: False, timeout_s=5, poll_s=0.0,
                         clock=lambda: float(next(t)))  # fmt: skip
