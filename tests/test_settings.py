"""Settings have one source: the CLI's options are built from the settings dataclasses
(hsq.settings, hsq.app.options). Pure logic: click's own runner, no processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hsq.app import cli
from hsq.app.options import settings_options
from hsq.settings import env_names, setting_doc
from workers.settings import WorkerSettings

# Flags that docs, compose files, Slurm recipes and tests already use: they must keep working.
WORKER_FLAGS = [
    "--run", "--server", "--dump-dir", "--redis", "--name", "--burst", "--dump-timeout",
    "--request-timeout", "--persist-depth", "--persist-threads", "--max-server-crashes",
    "--metrics-port", "--metrics-host", "--inflight", "--max-inflight-tokens",
    "--dump-dir-force",
]  # fmt: skip
REQUIRED = ["--run", "r", "--server", "http://s", "--dump-dir", "/d"]


def parse(args: list[str], env: dict[str, str] | None = None) -> WorkerSettings:
    seen: list[WorkerSettings] = []

    @click.command()
    @settings_options(WorkerSettings, skip=("redis_url",))
    def cmd(**values: Any) -> None:
        seen.append(WorkerSettings(redis_url="redis://x", **values))

    res = CliRunner().invoke(cmd, args, env=env or {}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return seen[0]


def test_every_worker_setting_is_described() -> None:
    for f in dataclasses.fields(WorkerSettings):
        doc = setting_doc(f)
        assert doc is not None and doc.help, f.name


def test_defaults_come_from_the_dataclass() -> None:
    got = parse(REQUIRED)
    want = WorkerSettings(run="r", server="http://s", dump_dir=Path("/d"), redis_url="redis://x")
    assert got == want


def test_help_shows_every_setting_with_its_env_variable() -> None:
    res = CliRunner().invoke(cli.cli, ["worker", "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    for flag in [*WORKER_FLAGS, "--reap-interval", "--heartbeat-interval", "--claim-timeout"]:
        assert flag in res.output, flag
    for f in dataclasses.fields(WorkerSettings):
        if f.name != "redis_url":
            assert env_names(f)[0] in res.output, f.name
    assert "HSQ_REDIS_URL" in res.output and "REDIS_URL" in res.output


@pytest.mark.parametrize(
    ("args", "env", "field", "value"),
    [
        (["--reap-interval", "0.5"], {}, "reap_interval_s", 0.5),
        ([], {"HSQ_REAP_INTERVAL": "7"}, "reap_interval_s", 7.0),
        (["--reap-interval", "0.5"], {"HSQ_REAP_INTERVAL": "7"}, "reap_interval_s", 0.5),
        (["--dump-timeout", "9"], {}, "dump_timeout_s", 9.0),
        ([], {"HSQ_INFLIGHT": "2"}, "inflight", 2),
        ([], {"HSQ_MAX_INFLIGHT_TOKENS": "100"}, "max_inflight_tokens", 100),
        (["--burst"], {}, "burst", True),
        ([], {"HSQ_BURST": "1"}, "burst", True),
        (["--metrics-port", "9100"], {}, "metrics_port", 9100),
    ],
)
def test_a_setting_from_a_flag_or_its_env_variable(
    args: list[str], env: dict[str, str], field: str, value: object
) -> None:
    assert getattr(parse(REQUIRED + args, env), field) == value


def test_older_env_names_still_work() -> None:
    got = parse(["--run", "r", "--server", "http://s"], {"SGLANG_HS_DUMP_DIR": "/legacy"})
    assert got.dump_dir == Path("/legacy")
    got = parse(["--run", "r", "--server", "http://s"], {"HSQ_DUMP_DIR": "/new"})
    assert got.dump_dir == Path("/new")


def test_a_missing_required_setting_is_a_usage_error() -> None:
    @click.command()
    @settings_options(WorkerSettings, skip=("redis_url",))
    def cmd(**_values: Any) -> None:
        raise AssertionError("not reached")

    res = CliRunner().invoke(cmd, ["--server", "http://s", "--dump-dir", "/d"], env={})
    assert res.exit_code == 2 and "--run" in res.output


def test_bad_worker_settings_are_refused_by_name() -> None:
    bad = dataclasses.replace(parse(REQUIRED), reap_interval_s=0)
    with pytest.raises(Exception, match="--reap-interval must be > 0"):
        bad.validate()
