"""Every option of `hsq` reads its environment variable the same way: the shared
flags (--run, --redis, --redis-url-file, the TLS files, --out) read the same variables in
every command, and `acl --run`, `purge --run` and `demo`'s Redis, which did not, do now.

The first three tests are pure (click's own parser); the others run the real command in a
subprocess against a real redis-server."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from hsq.cli import main as cli
from hsq.cli.options import DeprecatedAlias
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect, list_runs
from tests.helpers import enqueue, hsq, hsq_process

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


DEPRECATED = {
    # Renamed flags: the old name still works (with a line on stderr), hidden from --help.
    ("run", "--server"): "--engine",  # a kind here, a URL in `hsq worker`
    ("worker", "--server-kind"): "--engine",
    ("audit", "--server-kind"): "--engine",
    # One name per concept: the exporter's port and address are metrics ones, as a worker's
    # (`--port`/`--host` are where a server serves requests).
    ("exporter", "--port"): "--metrics-port",
    ("exporter", "--host"): "--metrics-host",
    ("export", "--jobs"): "--write-threads",  # threads; `--jobs` is processes elsewhere
}


def options() -> dict[tuple[str, str], list[str]]:
    """(command, flag) -> the environment variables the option reads, for every option
    (not the deprecated names: they are the options they name)."""
    found: dict[tuple[str, str], list[str]] = {}
    commands: dict[str, click.Command] = {"hsq": cli.cli, **cli.every_command()}
    for name, command in commands.items():
        for param in command.params:
            if isinstance(param, DeprecatedAlias):
                continue
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
    res = hsq_process("demo", "--samples", "3", "--out", str(tmp_path / "demo"), timeout=300,
              env={**env, "HSQ_REDIS_URL": redis_url})  # fmt: skip
    assert res.returncode == 0 and "demo OK" in res.stdout, res.stdout + res.stderr[-2000:]
    assert "redis-server" not in res.stdout  # none started: the given Redis is used
    made = set(list_runs(connect(redis_url))) - before
    assert len(made) == 1 and next(iter(made)).startswith("demo-"), made


@pytest.mark.timeout(600)  # the demo starts its reference server before it connects
def test_demo_reads_redis_url_file(tmp_path: Path) -> None:
    """--redis-url-file did not exist for `hsq demo`."""
    env = _env_without_redis()
    url_file = tmp_path / "url"
    url_file.write_text("redis://127.0.0.1:1/0\n")  # nothing listens there
    url_file.chmod(0o600)
    down = hsq_process("demo", "--samples", "1", "--out", str(tmp_path / "demo"),
               "--redis-url-file", str(url_file), timeout=300, env=env)  # fmt: skip
    assert down.returncode == 3 and "cannot reach Redis" in down.stderr, down.stderr[-2000:]
    assert "redis-server" not in down.stdout


def test_a_bogus_log_level_is_refused_and_any_case_of_a_real_one_accepted() -> None:
    bad = CliRunner().invoke(cli.cli, ["--log-level", "bogus", "runs", "--help"])
    assert bad.exit_code == 2 and "bogus" in bad.output
    ok = CliRunner().invoke(cli.cli, ["--log-level", "debug", "runs", "--help"])
    assert ok.exit_code == 0, ok.output


# --- renamed flags: the old spelling works and says so ---------------------------------------


def test_the_renamed_flags_keep_their_old_names_out_of_help() -> None:
    found = {
        (name, p.opts[0]): p.new
        for name, command in cli.every_command().items()
        for p in command.params
        if isinstance(p, DeprecatedAlias)
    }
    assert found == DEPRECATED
    for (command, old), new in DEPRECATED.items():
        out = CliRunner().invoke(cli.cli, [command, "--help-all"], terminal_width=200).output
        assert new in out and "HSQ_SERVER_KIND" not in out
        assert new != "--engine" or "HSQ_ENGINE" in out
        assert not re.search(rf"{old}(?![\w-])", out), (command, old)  # not --servers


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The service each command calls, replaced by a recorder: what the command parsed."""
    seen: dict[str, Any] = {}

    def record(key: str) -> Any:
        def fake(*args: Any, **kw: Any) -> int:
            # the audit's keywords, or the settings, the job; several arguments: all of them
            seen[key] = kw or (args[0] if len(args) == 1 else args)
            sys.exit(0)

        return fake

    import hsq.cli.commands.serve
    import hsq.node.node
    import hsq.ops.audit
    import hsq.ops.export
    import hsq.ops.prometheus
    import hsq.workers.worker

    monkeypatch.setattr(hsq.workers.worker, "run_worker", record("worker"))
    monkeypatch.setattr(hsq.cli.commands.serve, "_exit_now", lambda rc: sys.exit(rc))
    monkeypatch.setattr(hsq.node.node, "run_node", record("run"))
    monkeypatch.setattr(hsq.ops.audit, "run_audit", record("audit"))
    monkeypatch.setattr(hsq.ops.prometheus, "run_exporter", record("exporter"))
    monkeypatch.setattr(hsq.ops.export, "export_specforge", record("export"))
    return seen


WORKER = ["worker", "--run", "r", "--server", "http://127.0.0.1:1", "--dump-dir", "/d"]
WARNING = "warning: {} is deprecated and will be removed: use {}\n"


def invoke(args: list[str], **env: str) -> Any:
    base = {k: None for k in ("HSQ_ENGINE", "HSQ_SERVER_KIND", "HSQ_SERVER")}
    return CliRunner().invoke(cli.cli, args, env={**base, **env})


def test_worker_server_kind_is_engine_with_a_warning(captured: dict[str, Any]) -> None:
    res = invoke([*WORKER, "--server-kind", "vllm"])
    assert res.exit_code == 0, res.output
    assert captured["worker"].api.engine == "vllm"
    assert res.stderr == WARNING.format("--server-kind", "--engine")
    new = invoke([*WORKER, "--engine", "vllm"])
    assert new.exit_code == 0 and new.stderr == "" and captured["worker"].api.engine == "vllm"
    env = invoke(WORKER, HSQ_SERVER_KIND="vllm")  # the old variable, when the new one is unset
    assert env.exit_code == 0 and captured["worker"].api.engine == "vllm"
    assert env.stderr == WARNING.format("HSQ_SERVER_KIND", "HSQ_ENGINE")
    both = invoke(WORKER, HSQ_SERVER_KIND="vllm", HSQ_ENGINE="sglang")  # the new one wins
    assert both.exit_code == 0 and both.stderr == "" and captured["worker"].api.engine == "sglang"
    flag = invoke([*WORKER, "--server-kind", "vllm"], HSQ_ENGINE="sglang")  # a flag wins
    assert flag.exit_code == 0 and captured["worker"].api.engine == "vllm"
    twice = invoke([*WORKER, "--engine", "vllm", "--server-kind", "vllm"])
    assert twice.exit_code == 2 and "give --engine once (--server-kind is it)" in twice.output
    bad = invoke([*WORKER, "--server-kind", "tgi"])  # checked as --engine is
    assert bad.exit_code == 2 and "'tgi' is not one of 'sglang', 'vllm'" in bad.output


def test_run_server_is_engine_with_a_warning(captured: dict[str, Any], tmp_path: Path) -> None:
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 2)
    args = ["run", str(ds), "--out", str(tmp_path / "out"), "--inflight", "2"]
    res = invoke([*args, "--server", "reference"])
    assert res.exit_code == 0, res.output
    assert res.stderr == WARNING.format("--server", "--engine")
    job = captured["run"]
    assert job.plan.kind == "reference" and "--inflight" in job.worker_argv
    res = invoke([*args, "--engine", "reference"], HSQ_SERVER_KIND="sglang")  # the flag wins
    assert res.exit_code == 0 and res.stderr == "" and captured["run"].plan.kind == "reference"


def test_audit_server_kind_is_engine_with_a_warning(
    captured: dict[str, Any], tmp_path: Path, redis_url: str
) -> None:
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 2)
    enqueue(ds, "a", tmp_path / "out", redis_url)
    args = ["audit", "--run", "a", "--redis", redis_url, "--sample-fraction", "1",
            "--server", "http://127.0.0.1:1", "--dump-dir", str(tmp_path), "--no-progress",
            "--request-timeout", "7"]  # fmt: skip
    res = invoke([*args, "--server-kind", "vllm"])
    assert res.exit_code == 0, res.output
    assert res.stderr == WARNING.format("--server-kind", "--engine")
    assert captured["audit"]["api"].engine == "vllm"
    assert captured["audit"]["exchange"].request_timeout_s == 7.0  # a worker's flag, shared


def test_the_exporter_port_and_host_are_metrics_ones_with_a_warning(
    captured: dict[str, Any],
) -> None:
    res = invoke(["exporter", "--port", "9641", "--host", "0.0.0.0"])
    assert res.exit_code == 0, res.output
    assert captured["exporter"][1:] == ("0.0.0.0", 9641)
    assert res.stderr == WARNING.format("--port", "--metrics-port") + WARNING.format(
        "--host", "--metrics-host"
    )
    new = invoke(["exporter", "--metrics-port", "9642", "--metrics-host", "0.0.0.0"])
    assert new.exit_code == 0 and new.stderr == "", new.output
    assert captured["exporter"][1:] == ("0.0.0.0", 9642)
    twice = invoke(["exporter", "--metrics-port", "9642", "--port", "9643"])
    assert twice.exit_code == 2 and "give --metrics-port once (--port is it)" in twice.output


def test_export_jobs_is_write_threads_with_a_warning(
    captured: dict[str, Any], tmp_path: Path, redis_url: str
) -> None:
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 2)
    enqueue(ds, "ex", tmp_path / "out", redis_url)
    args = ["export", "--run", "ex", "--redis", redis_url, "--format", "specforge",
            "--to", str(tmp_path / "sf"), "--no-progress"]  # fmt: skip
    res = invoke([*args, "--jobs", "3"])
    assert res.exit_code == 0, res.output
    assert captured["export"][1].jobs == 3
    assert res.stderr == WARNING.format("--jobs", "--write-threads")
    new = invoke([*args, "--write-threads", "5"])
    assert new.exit_code == 0 and new.stderr == "" and captured["export"][1].jobs == 5
    bad = invoke([*args, "--jobs", "0"])  # checked as --write-threads is
    assert bad.exit_code == 2, bad.output


@pytest.mark.realproc
def test_a_bad_tuning_value_stops_hsq_run_before_anything_starts(tmp_path: Path) -> None:
    """`hsq run` checks every worker's settings itself (it once built a WorkerSettings with
    placeholders to do it): one line, exit 2, nothing made under --out."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 2)
    out = tmp_path / "out"
    res = hsq_process("run", str(ds), "--out", str(out), "--inflight", "0")
    assert res.returncode == 2 and res.stderr == "error: --inflight must be within [1, 256]\n"
    assert res.stdout == "" and not out.exists()
    res = hsq_process("run", str(ds), "--out", str(out), "--request-timeout", "0")
    assert res.returncode == 2 and res.stderr == "error: --request-timeout must be > 0\n"
