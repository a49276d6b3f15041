"""Settings have one source: the CLI's options are built from the settings dataclasses
(hsq.settings, hsq.cli.options). Pure logic: click's own runner, no processes."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hsq.cli import main as cli
from hsq.cli.options import settings_options, take
from hsq.engines.reference.settings import ReferenceSettings
from hsq.errors import ConfigError
from hsq.keys import HEARTBEAT_TTL_S
from hsq.producer.settings import RUN_SETTINGS
from hsq.runconfig import RunConfig
from hsq.settings import env_names, setting_doc
from hsq.workers.settings import WorkerSettings, WorkerTuning

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
        seen.append(take(WorkerSettings, values, redis_url="redis://x"))

    res = CliRunner().invoke(cmd, args, env=env or {}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return seen[0]


def leaves(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    """The settings fields of `cls`, nested settings records flattened (as its flags are)."""
    hints = typing.get_type_hints(cls)
    out: list[dataclasses.Field[Any]] = []
    for f in dataclasses.fields(cls):
        out += [f] if setting_doc(f) is not None else leaves(hints[f.name])
    return out


def value(obj: object, name: str) -> object:
    """A setting of a (nested) settings record by its flat name."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if f.name == name:
            return getattr(obj, name)
        if setting_doc(f) is None:
            try:
                return value(getattr(obj, f.name), name)
            except KeyError:
                continue
    raise KeyError(name)


def test_every_worker_setting_is_described() -> None:
    names = [f.name for f in leaves(WorkerSettings)]
    assert len(names) == len(set(names)) > 20  # flat flags: no name twice
    for f in leaves(WorkerSettings):
        doc = setting_doc(f)
        assert doc is not None and doc.help, f.name


def test_defaults_come_from_the_dataclass() -> None:
    got = parse(REQUIRED)
    want = WorkerSettings(run="r", server="http://s", dump_dir=Path("/d"), redis_url="redis://x")
    assert got == want


def test_help_all_shows_every_setting_with_its_env_variable() -> None:
    res = CliRunner().invoke(cli.cli, ["worker", "--help-all"], terminal_width=200)
    assert res.exit_code == 0, res.output
    for flag in [*WORKER_FLAGS, "--reap-interval", "--heartbeat-interval", "--claim-timeout"]:
        assert flag in res.output, flag
    for f in leaves(WorkerSettings):
        if f.name != "redis_url":
            assert env_names(f)[0] in res.output, f.name
    assert "HSQ_REDIS_URL" in res.output and "REDIS_URL" in res.output


@pytest.mark.parametrize(
    ("args", "env", "field", "want"),
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
        ([], {}, "direct_io", True),
        (["--no-direct-io"], {}, "direct_io", False),
        ([], {"HSQ_DIRECT_IO": "0"}, "direct_io", False),  # read with the settings, once
    ],
)
def test_a_setting_from_a_flag_or_its_env_variable(
    args: list[str], env: dict[str, str], field: str, want: object
) -> None:
    assert value(parse(REQUIRED + args, env), field) == want


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
    bad = parse([*REQUIRED, "--reap-interval", "0"])
    with pytest.raises(ConfigError, match="--reap-interval must be > 0"):
        bad.validate()
    with pytest.raises(ConfigError, match="--request-timeout must be > 0"):
        parse([*REQUIRED, "--request-timeout", "0"]).validate()


def test_a_heartbeat_interval_the_store_ttl_cannot_keep_up_with_is_refused() -> None:
    """Heartbeats 12 s apart passed validation while a heartbeat expires after
    HEARTBEAT_TTL_S (10 s): a reaper would take a live worker's jobs back every cycle."""
    slow = WorkerTuning(heartbeat_interval_s=12)
    with pytest.raises(ConfigError, match="--heartbeat-interval must be at most 5 s"):
        slow.validate()
    dataclasses.replace(slow, heartbeat_interval_s=HEARTBEAT_TTL_S / 2).validate()
    assert parse([*REQUIRED, "--heartbeat-interval", "0.5"]).tuning.heartbeat_interval_s == 0.5


REFERENCE_FLAGS = [
    "--model", "--device", "--dtype", "--dump-dtype", "--layers", "--dump-dir", "--host",
    "--port", "--max-tokens", "--max-batch-requests", "--max-batch-tokens", "--warmup-shapes",
    "--warmup", "--counter-start", "--fault", "--seed", "--writer-depth", "--no-fsync",
    "--threads",
]  # fmt: skip


def parse_reference(args: list[str], env: dict[str, str] | None = None) -> ReferenceSettings:
    seen: list[ReferenceSettings] = []

    @click.command()
    @settings_options(ReferenceSettings)
    def cmd(**values: Any) -> None:
        seen.append(ReferenceSettings(**values))

    res = CliRunner().invoke(cmd, ["--dump-dir", "/d", *args], env=env or {})
    assert res.exit_code == 0, res.output
    return seen[0]


def test_reference_help_keeps_every_flag() -> None:
    res = CliRunner().invoke(cli.cli, ["serve-reference", "--help-all"], terminal_width=200)
    assert res.exit_code == 0, res.output
    for flag in REFERENCE_FLAGS:
        assert flag in res.output, flag
    for f in dataclasses.fields(ReferenceSettings):
        doc = setting_doc(f)
        assert doc is not None and doc.help, f.name
        if not doc.hidden:
            assert env_names(f)[0] in res.output, f.name


def test_reference_defaults_come_from_the_dataclass() -> None:
    assert parse_reference([]) == ReferenceSettings(dump_dir=Path("/d"))


@pytest.mark.parametrize(
    ("args", "env", "field", "value"),
    [
        (["--no-fsync"], {}, "fsync", False),
        ([], {"HSQ_FSYNC": "0"}, "fsync", False),
        (["--no-ready-marker"], {}, "ready_marker", False),
        (
            ["--fault", "slow:seconds=1", "--fault", "error"],
            {},
            "faults",
            ("slow:seconds=1", "error"),
        ),
        (["--layers", "2,4,5"], {}, "layers", (2, 4, 5)),
        ([], {"HSQ_LAYERS": "1,3"}, "layers", (1, 3)),
        ([], {"HSQ_PORT": "31000"}, "port", 31000),
        (["--max-batch-requests", "4"], {}, "max_batch_requests", 4),
    ],
)
def test_a_reference_setting_from_a_flag_or_its_env_variable(
    args: list[str], env: dict[str, str], field: str, value: object
) -> None:
    assert getattr(parse_reference(args, env), field) == value


def test_bad_layers_are_a_usage_error() -> None:
    @click.command()
    @settings_options(ReferenceSettings)
    def cmd(**_values: Any) -> None:
        raise AssertionError("not reached")

    res = CliRunner().invoke(cmd, ["--dump-dir", "/d", "--layers", "2,x"], env={})
    assert res.exit_code == 2 and "comma-separated integers" in res.output


def test_the_compute_dtype_follows_the_device_unless_given() -> None:
    assert ReferenceSettings(dump_dir=Path("/d")).compute_dtype == "float32"
    assert ReferenceSettings(dump_dir=Path("/d"), device="cuda").compute_dtype == "bfloat16"
    assert ReferenceSettings(dump_dir=Path("/d"), dtype="float16").compute_dtype == "float16"


def parse_run(args: list[str], env: dict[str, str] | None = None) -> RunConfig:
    seen: list[RunConfig] = []

    @click.command()
    @settings_options(RunConfig, only=RUN_SETTINGS)
    def cmd(**values: Any) -> None:
        seen.append(RunConfig(run="r", dataset="/d", out="/o", created=0.0, **values))

    res = CliRunner().invoke(cmd, args, env=env or {})
    assert res.exit_code == 0, res.output
    return seen[0]


def test_run_defaults_come_from_the_run_config() -> None:
    assert parse_run([]) == RunConfig(run="r", dataset="/d", out="/o", created=0.0)


@pytest.mark.parametrize(
    ("args", "env", "field", "value"),
    [
        (["--layers", "2,4,5"], {}, "layer_ids", [2, 4, 5]),
        ([], {"HSQ_LAYER_IDS": "1,3"}, "layer_ids", [1, 3]),
        ([], {"HSQ_CHUNK_SIZE": "4"}, "chunk_size", 4),
        (["--max-attempts", "5"], {}, "max_attempts", 5),
        ([], {"HSQ_STORE_DTYPE": "fp8-e4m3"}, "store_dtype", "fp8-e4m3"),
        (["--model-id", "m@abc"], {}, "model_id", "m@abc"),
        ([], {"HSQ_MAX_TOKENS": "4096"}, "max_tokens", 4096),
    ],
)
def test_a_run_setting_from_a_flag_or_its_env_variable(
    args: list[str], env: dict[str, str], field: str, value: object
) -> None:
    assert getattr(parse_run(args, env), field) == value


@pytest.mark.parametrize("command", ["enqueue", "recover"])
def test_run_commands_help_all_shows_their_settings_with_env_variables(command: str) -> None:
    res = CliRunner().invoke(cli.cli, [command, "--help-all"], terminal_width=200)
    assert res.exit_code == 0, res.output
    names = RUN_SETTINGS if command == "enqueue" else ("chunk_size", "store_dtype")
    for f in dataclasses.fields(RunConfig):
        if f.name in names:
            doc = setting_doc(f)
            assert doc is not None and doc.help, f.name
            assert env_names(f)[0] in res.output, f.name


def test_an_unknown_store_dtype_is_a_usage_error() -> None:
    @click.command()
    @settings_options(RunConfig, only=("store_dtype",))
    def cmd(**_values: Any) -> None:
        raise AssertionError("not reached")

    res = CliRunner().invoke(cmd, ["--store-dtype", "int4"], env={})
    assert res.exit_code == 2 and "fp8-e4m3" in res.output
