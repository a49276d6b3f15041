"""Every option of `hsq` reads its environment variable the same way: the shared
flags (--run, --redis, --redis-url-file, the TLS files, --out) read the same variables in
every command, and `acl --run`, `purge --run` and `demo`'s Redis, which did not, do now.

The first three tests are pure (click's own parser); the others run the real command in a
subprocess against a real redis-server."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hsq.cli import main as cli
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect, list_runs
from tests.helpers import enqueue, hsq

FLAG_ONLY = {
    # Per-invocation choices that delete, rewrite or requeue, or change what the input is:
    # a variable left in a shell must not make them for the next command (hsq.settings).
    ("purge", "--yes"),
    ("export", "--prune"),
    ("verify", "--requeue"),
    ("audit", "--requeue"),
    ("requeue", "--failed"),
    ("requeue", "--reason"),
    ("requeue", "--sample"),
    ("requeue", "--missing"),
    ("enqueue", "--tokenizer"),
    ("enqueue", "--tokens"),
    ("run", "--tokenizer"),
    ("run", "--tokens"),
    ("run", "--join"),  # adds servers to a run instead of enqueueing a dataset
    ("run", "--redis-only"),  # serves the Redis instead of running anything
}
SHARED = ("--run", "--redis", "--redis-url-file", "--redis-ca", "--redis-cert", "--redis-key")


def options() -> dict[tuple[str, str], list[str]]:
    """(command, flag) -> the environment variables the option reads, for every option."""
    found: dict[tuple[str, str], list[str]] = {}
    commands: dict[str, click.Command] = {"hsq": cli.cli, **cli.every_command()}
    for name, command in commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.is_eager:  # --help, --version
                envvar = param.envvar
                envs = [envvar] if isinstance(envvar, str) else list(envvar or [])
                found[(name, max(param.opts, key=len))] = envs
    return found


def test_every_option_reads_its_environment_variable_but_the_per_invocation_choices() -> None:
    without = {key for key, envs in options().items() if not envs}
    assert without == FLAG_ONLY


def test_the_shared_flags_read_the_same_variables_in_every_command() -> None:
    by_flag: dict[str, dict[str, list[str]]] = {}
    for (command, flag), envs in options().items():
        by_flag.setdefault(flag, {})[command] = envs
    for flag in SHARED:
        seen = {tuple(envs) for envs in by_flag[flag].values()}
        assert len(seen) == 1, (flag, by_flag[flag])
    assert set(by_flag["--run"]) >= {"acl", "purge", "enqueue", "status", "worker", "export"}
    assert by_flag["--redis"]["demo"] == ["HSQ_REDIS_URL", "REDIS_URL"]
    assert "demo" in by_flag["--redis-url-file"]
    assert {tuple(envs) for envs in by_flag["--out"].values()} == {("HSQ_OUT",)}


def test_acl_takes_the_run_from_hsq_run() -> None:
    res = CliRunner().invoke(cli.cli, ["acl"], env={"HSQ_RUN": "kimi-v1"})
    assert res.exit_code == 0, res.output
    assert res.output.startswith("user hsq-kimi-v1 on ")


def test_purge_takes_the_run_from_hsq_run(tmp_path: Path, redis_url: str) -> None:
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 3, seed=3, min_len=4, max_len=16)
    enqueue(ds, "envpurge", tmp_path / "out", redis_url)
    res = hsq("purge", "--yes", "--redis", redis_url, env={**os.environ, "HSQ_RUN": "envpurge"})
    assert res.returncode == 0 and "purged run envpurge" in res.stdout, res.stderr
    assert connect(redis_url).keys("hsq:run:envpurge:*") == []


def _env_without_redis() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "HSQ_REDIS_URL")}


@pytest.mark.timeout(600)  # a whole demo: a reference server, a worker, a deep verify
def test_demo_uses_the_redis_hsq_redis_url_names(tmp_path: Path, redis_url: str) -> None:
    """`hsq demo` read only REDIS_URL: with HSQ_REDIS_URL set it started a private
    redis-server anyway."""
    before = set(list_runs(connect(redis_url)))
    env = _env_without_redis()
    res = hsq("demo", "--samples", "3", "--out", str(tmp_path / "demo"), timeout=300,
              env={**env, "HSQ_REDIS_URL": redis_url})  # fmt: skip
    assert res.returncode == 0 and "demo OK" in res.stdout, res.stdout + res.stderr[-2000:]
    assert "private redis-server" not in res.stdout
    made = set(list_runs(connect(redis_url))) - before
    assert len(made) == 1 and next(iter(made)).startswith("demo-"), made


@pytest.mark.timeout(600)  # the demo starts its reference server before it connects
def test_demo_reads_redis_url_file(tmp_path: Path) -> None:
    """--redis-url-file did not exist for `hsq demo`."""
    env = _env_without_redis()
    url_file = tmp_path / "url"
    url_file.write_text("redis://127.0.0.1:1/0\n")  # nothing listens there
    url_file.chmod(0o600)
    down = hsq("demo", "--samples", "1", "--out", str(tmp_path / "demo"),
               "--redis-url-file", str(url_file), timeout=300, env=env)  # fmt: skip
    assert down.returncode == 3 and "cannot reach Redis" in down.stderr, down.stderr[-2000:]
    assert "private redis-server" not in down.stdout


def test_a_bogus_log_level_is_refused_and_any_case_of_a_real_one_accepted() -> None:
    bad = CliRunner().invoke(cli.cli, ["--log-level", "bogus", "runs", "--help"])
    assert bad.exit_code == 2 and "bogus" in bad.output
    ok = CliRunner().invoke(cli.cli, ["--log-level", "debug", "runs", "--help"])
    assert ok.exit_code == 0, ok.output
