"""`hsq ARGS` called in the test's own process (tests/support/inproc.py, tests/helpers.py
`hsq`) gives back what the same command as a real process gives, and leaves nothing behind
for the next call or test: its logging set-up, its cached loggers, its environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner

from hsq.cli import main as cli
from hsq.producer.synthetic import write_synthetic
from tests.helpers import hsq, hsq_process
from tests.support import inproc


@pytest.mark.realproc  # under `make test-fresh`, against a fresh exec rather than a fork
@pytest.mark.parametrize(
    "args",
    [
        ("acl", "--run", "r1"),  # stdout, exit 0
        ("status", "--bogus"),  # click's usage error, with the program's name: exit 2
        ("status", "--run", "x", "--redis", "redis://127.0.0.1:1/0"),  # Redis down: exit 3
        ("--version",),
        ("worker", "--help"),
    ],
)
def test_a_call_in_process_gives_what_the_process_gives(args: tuple[str, ...]) -> None:
    here, there = hsq(*args), hsq_process(*args)
    assert (here.returncode, here.stdout, here.stderr) == (
        there.returncode,
        there.stdout,
        there.stderr,
    )


def test_a_call_leaves_no_logging_behind(tmp_path: Path, redis_url: str) -> None:
    """The first call logs at WARNING in console format; the next, at the defaults, still
    logs `enqueued` as JSON into its own stderr (structlog caches each module's logger at
    its first use: kept, the second call's line would go to the first call's stream at the
    first call's level)."""
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 3, seed=1, min_len=4, max_len=8)
    before = structlog.get_config()
    base = ["enqueue", str(ds), "--out", str(tmp_path / "out"), "--redis", redis_url]
    quiet = hsq(*base, "--run", "a", "--log-format", "console", "--log-level", "warning")
    assert quiet.returncode == 0 and "enqueued" not in quiet.stderr, quiet.stderr
    assert structlog.get_config() == before
    loud = hsq(*base, "--run", "b", "--no-progress")
    assert loud.returncode == 0, loud.stderr
    lines = [json.loads(x) for x in loud.stderr.splitlines() if x.startswith("{")]
    assert any(x.get("event") == "enqueued" and x.get("run") == "b" for x in lines), loud.stderr
    assert structlog.get_config() == before


def test_a_call_is_not_bound_by_a_logger_cached_before_it(tmp_path: Path, redis_url: str) -> None:
    """A command run through CliRunner directly (as tests/test_cli_help.py does) leaves its
    modules' loggers cached, at its level, on its stream; a call after it still logs."""
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 3, seed=2, min_len=4, max_len=8)
    base = ["enqueue", str(ds), "--out", str(tmp_path / "out"), "--redis", redis_url]
    quiet = [*base, "--run", "a", "--log-level", "warning", "--no-progress"]
    try:
        assert CliRunner().invoke(cli.cli, quiet).exit_code == 0
        loud = hsq(*base, "--run", "b", "--no-progress")
    finally:
        structlog.reset_defaults()
    assert loud.returncode == 0, loud.stderr
    assert '"event": "enqueued"' in loud.stderr, loud.stderr


def test_a_call_gets_the_environment_given_and_leaves_the_tests_alone() -> None:
    env_before = dict(os.environ)
    res = hsq("acl", env={**os.environ, "HSQ_RUN": "from-env"})
    assert res.returncode == 0 and "hsq-from-env" in res.stdout, res.stdout + res.stderr
    assert dict(os.environ) == env_before
    # `env` replaces the environment whole, as subprocess's does: without HSQ_RUN, no run.
    bare = hsq("acl", env={k: v for k, v in os.environ.items() if k != "HSQ_RUN"})
    assert bare.returncode == 2, bare.stdout + bare.stderr


def test_the_commands_that_are_processes_are_refused_in_process() -> None:
    for command in sorted(inproc.PROCESS_COMMANDS):
        with pytest.raises(ValueError, match="hsq_process"):
            hsq(command, "--run", "x")
