"""The command line's small edges: hsq's log options after the command
too, a bogus level refused there as well, `purge -y`, --help that reads short (the Redis
and log options under their own headings, still accepted), no issue numbers in --help.

Pure (click's parser, CliRunner) except the purge test, which runs the real command
against a real redis-server."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import structlog
from click.testing import CliRunner

from hsq.cli import main as cli
from hsq.cli.command import HsqArgument, HsqCommand
from hsq.producer.synthetic import write_synthetic
from hsq.store import connect
from tests.helpers import enqueue, hsq

PASSES_ON = {"launch-sglang", "launch-vllm"}
"""Commands whose unknown options go to the server they start (SGLang has --log-level)."""


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def renderer() -> str:
    return type(structlog.get_config()["processors"][-1]).__name__


def invoke(*args: str, env: dict[str, str] | None = None) -> click.testing.Result:
    return CliRunner().invoke(cli.cli, list(args), env=env)


def test_the_log_options_work_after_the_command_too() -> None:
    res = invoke("acl", "--run", "r1", "--log-format", "console")
    assert res.exit_code == 0, res.output
    assert renderer() == "ConsoleRenderer"
    res = invoke("--log-format", "console", "acl", "--run", "r1", "--log-format", "json")
    assert res.exit_code == 0 and renderer() == "JSONRenderer", res.output  # the later wins
    # The variable is read once, by the group: it does not undo the group's flag.
    res = invoke("--log-format", "console", "acl", "--run", "r1", env={"HSQ_LOG_FORMAT": "json"})
    assert res.exit_code == 0 and renderer() == "ConsoleRenderer", res.output


def test_a_bogus_log_level_after_the_command_is_refused() -> None:
    res = invoke("acl", "--run", "r1", "--log-level", "bogus")
    assert res.exit_code == 2 and "bogus" in res.output, res.output
    assert invoke("acl", "--run", "r1", "--log-level", "debug").exit_code == 0


def test_every_command_is_an_hsq_command_with_the_log_options_unless_it_passes_them_on() -> None:
    for name, command in cli.every_command().items():
        assert isinstance(command, HsqCommand), name
        names = {p.name for p in command.params}
        has_log = {"log_level", "log_format"} <= names
        assert has_log == (name not in PASSES_ON), name


def test_status_help_is_short_and_the_redis_options_are_under_their_heading() -> None:
    res = invoke("status", "--help")
    lines = res.output.splitlines()
    assert res.exit_code == 0 and len(lines) <= 42, res.output  # 46 with 19 of Redis before
    shared = lines[lines.index("Redis connection:") :]
    assert len(shared) <= 14, "\n".join(shared)
    own = lines[lines.index("Options:") : lines.index("Redis connection:")]
    assert not any("--redis" in line or "--log-" in line for line in own), own
    assert "--redis-ca, --redis-cert, --redis-key" in res.output
    assert "HSQ_REDIS_CA" in res.output and "HSQ_REDIS_URL_FILE" in res.output


def test_the_redis_options_are_still_accepted(tmp_path: Path) -> None:
    """The TLS files and the URL file reach the connection: a rediss:// URL to a closed
    port is a Redis error (exit 3), not a usage error."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    url_file = tmp_path / "url"
    url_file.write_text("rediss://:pw@127.0.0.1:1/0\n")
    url_file.chmod(0o600)
    res = invoke("status", "--redis-url-file", str(url_file), "--redis-ca", str(ca),
                 "--redis-cert", str(ca), "--redis-key", str(ca))  # fmt: skip
    assert res.exit_code != 2, res.output
    assert "No such option" not in res.output


def test_no_help_names_an_issue_number() -> None:
    texts = {"hsq": invoke("--help").output}
    for name in cli.every_command():
        res = invoke(name, "--help")
        assert res.exit_code == 0, (name, res.output)
        texts[name] = res.output
    found = {n: re.findall(r"issue \d+", t, re.IGNORECASE) for n, t in texts.items()}
    assert not {n: f for n, f in found.items() if f}


def test_purge_takes_y(tmp_path: Path, redis_url: str) -> None:
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 3, seed=3, min_len=4, max_len=16)
    enqueue(ds, "purgey", tmp_path / "out", redis_url)
    res = hsq("purge", "--run", "purgey", "-y", "--redis", redis_url, env=dict(os.environ))
    assert res.returncode == 0 and "purged run purgey" in res.stdout, res.stderr
    assert connect(redis_url).keys("hsq:run:purgey:*") == []


# --- a help a person reads ---------------------------------------------------------------

RUN_HELP_LINES = 62
"""`hsq run --help` at 80 columns: a screen or two (222 lines when every option was
described; 60 now), the rest behind --help-all."""


LOG_OPTIONS = {"log_level", "log_format"}


def help_text(*args: str, columns: int = 80) -> str:
    res = CliRunner().invoke(cli.cli, list(args), terminal_width=columns, env={"COLUMNS": ""})
    assert res.exit_code == 0, res.output
    return res.output


def long_flags(param: click.Option) -> list[str]:
    return [o for o in [*param.opts, *param.secondary_opts] if o.startswith("--")]


def visible_options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


def test_run_help_fits_a_screen_or_two_at_80_columns() -> None:
    lines = help_text("run", "--help").splitlines()
    assert len(lines) <= RUN_HELP_LINES, "\n".join(lines)
    assert [line for line in lines if len(line) > 80] == []
    for first in ("--out", "--engine", "--servers", "--gpus", "--model", "--verify",
                  "--spool-budget", "--join", "--listen", "--json", "--prenorm"):  # fmt: skip
        described = [line for line in lines if line.lstrip().startswith(first + " ")]
        assert described, first  # its own row, with its help, not only a name in a list
    assert "More options (--help-all" in "\n".join(lines)


def test_every_option_is_named_by_help_and_described_by_help_all() -> None:
    """--help names every option (described, or in its section's line of names), so a
    recipe's flag is found there; --help-all describes each, with its variable."""
    for name, command in cli.every_command().items():
        short = help_text(name, "--help", columns=200)
        full = help_text(name, "--help-all", columns=200)
        for p in visible_options(command):
            if p.is_eager:  # --help-all: listed where --help folds something
                continue
            for flag in long_flags(p)[:1]:
                assert re.search(rf"{flag}(?![\w-])", short), (name, flag)
                assert re.search(rf"{flag}(?![\w-])", full), (name, flag)
            envs = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
            if envs and p.show_envvar and p.name not in LOG_OPTIONS:  # those: in hsq --help
                assert envs[0] in full, (name, envs[0])
        assert "More options" not in full, name


def test_every_positional_argument_is_described_under_arguments() -> None:
    for name, command in cli.every_command().items():
        args = [p for p in command.params if isinstance(p, click.Argument)]
        if not args or command.context_settings.get("ignore_unknown_options"):
            continue  # launch-*: what they do not know goes to the server, as it is
        text = help_text(name, "--help")
        assert "\nArguments:\n" in text, name
        block = text.split("\nArguments:\n", 1)[1].split("\n\n", 1)[0]
        options = text.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0]
        for arg in args:
            assert isinstance(arg, HsqArgument), (name, arg.name)
            for metavar, line in arg.help_rows(click.Context(command)):
                assert line.strip(), (name, metavar)
                assert metavar.strip("[]") in block, (name, metavar)
                rows = [line.split()[0] for line in options.splitlines() if line.strip()]
                assert metavar not in rows, (name, metavar)  # not an option's row


def test_one_name_per_option_and_per_concept() -> None:
    """Within a command, an option shows one long name (an older one is a hidden
    DeprecatedAlias, which warns); across commands, the same setting (its variable) has
    the same flag."""
    flags_of: dict[str, set[str]] = {}
    for name, command in cli.every_command().items():
        for p in visible_options(command):
            names = [o for o in p.opts if o.startswith("--")]  # not --no-X, X's other half
            assert len(names) == 1 or p.is_eager, (name, names)
            envs = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
            if envs:
                flags_of.setdefault(envs[0], set()).add(names[0])
    assert {env: f for env, f in flags_of.items() if len(f) > 1} == {}
