"""The `hsq` command's own start stays cheap: `hsq --version`, `hsq
--help` and every command's --help import none of the heavy libraries (the group loads a
command's module only when that command is asked for, structlog only when a command runs),
and the group's lazy table (hsq/cli/main.py COMMANDS) says what the commands say.

The import checks run the real `hsq` entry point in a fresh interpreter and read its
sys.modules; the table checks are pure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest

from hsq.cli import main as cli
from hsq.cli.group import LazyGroup

HEAVY = (
    "torch",
    "transformers",
    "numpy",
    "rich",
    "structlog",
    "redis",
    "rq",
    "httpx",
    "msgspec",
    "tqdm",
    "safetensors",
    "asyncio",
)
"""What a --help must not import: the model libraries, the wire and store clients, the
logging stack; each costs tens to hundreds of ms of CPU at every start."""

# Runs hsq's entry point for each argv in turn in one interpreter and prints, after each,
# the heavy top-level modules loaded so far: the first argv that brings one is named.
_PROBE = """
import json, sys
from hsq.cli.main import main
heavy = set(json.loads(sys.argv[1]))
for args in json.loads(sys.argv[2]):
    sys.argv = ["hsq", *args]
    try:
        main()
    except SystemExit as exc:
        assert exc.code in (0, None), (args, exc.code)
    loaded = sorted({m.split(".")[0] for m in sys.modules} & heavy)
    print(json.dumps([args, loaded]), file=sys.stderr)
"""


def loaded_by(*argvs: list[str]) -> list[tuple[list[str], list[str]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSQ_")}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(HEAVY), json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(rows) == len(argvs), proc.stderr[-3000:]
    return [(args, loaded) for args, loaded in rows]


def test_version_and_help_import_no_heavy_module() -> None:
    for args, loaded in loaded_by(["--version"], ["--help"], ["status", "--help"]):
        assert loaded == [], (args, loaded)


def test_no_command_help_imports_a_heavy_module() -> None:
    """Every command's --help, one after another in one interpreter: the first to import a
    heavy module is the one named."""
    names = sorted(cli.COMMANDS)
    for args, loaded in loaded_by(*([name, "--help"] for name in names)):
        assert loaded == [], (args, loaded)


def test_the_lazy_table_names_every_command_where_it_lives() -> None:
    commands = cli.every_command()
    assert sorted(commands) == sorted(cli.COMMANDS)
    for name, command in commands.items():
        assert command.name == name, (name, command.name)


@pytest.mark.parametrize("limit", [20, 45, 74, 200])
def test_the_lazy_table_short_help_is_the_commands_own(limit: int) -> None:
    for name, command in cli.every_command().items():
        stand_in = click.Command(name, help=cli.COMMANDS[name].short_help)
        assert stand_in.get_short_help_str(limit) == command.get_short_help_str(limit), name


@pytest.mark.parametrize("columns", ["60", "100"])
def test_hsq_help_reads_as_it_would_with_every_command_loaded(columns: str) -> None:
    """`hsq --help` from the table (nothing loaded: a fresh process) against the same help
    printed after every command was imported (the listing click makes from the commands)."""
    env = {**os.environ, "COLUMNS": columns}
    lazy = subprocess.run([sys.executable, "-m", "hsq", "--help"], capture_output=True,
                          text=True, env=env, check=True)  # fmt: skip
    eager_code = (
        "import sys\nfrom hsq.cli import main as cli\ncli.every_command()\n"
        "sys.argv = ['hsq', '--help']\ncli.main()\n"
    )
    eager = subprocess.run([sys.executable, "-c", eager_code], capture_output=True, text=True,
                           env=env, check=True)  # fmt: skip
    assert "Start here:" in lazy.stdout  # under hsq.cli.main.SECTIONS' headings
    assert lazy.stdout.replace("python -m hsq", "hsq") == eager.stdout


def test_an_unknown_command_is_a_usage_error() -> None:
    assert isinstance(cli.cli, LazyGroup)
    res = subprocess.run([sys.executable, "-m", "hsq", "nosuchcommand"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    assert res.returncode == 2 and "No such command" in res.stderr, res.stderr


def test_json_logs_load_structlog_without_rich_and_console_logs_still_show_tracebacks() -> None:
    code = (
        "import sys\nfrom hsq.logs import configure\n"
        "configure('INFO', sys.argv[1])\nimport structlog\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n"
        "    structlog.get_logger().exception('boom', x=1)\n"
        "print('rich' in sys.modules)\n"
    )
    for fmt in ("json", "console"):
        res = subprocess.run([sys.executable, "-c", code, fmt], capture_output=True, text=True,
                             check=True)  # fmt: skip
        assert res.stdout.strip() == "False", (fmt, res.stdout)
        assert "ZeroDivisionError" in res.stderr and "Traceback" in res.stderr, res.stderr
        if fmt == "json":
            event = json.loads(res.stderr.splitlines()[-1])
            assert event["event"] == "boom" and event["x"] == 1


def test_a_worker_loads_structlog_and_httpx_without_their_pretty_printers() -> None:
    """`hsq worker` configures logging (HsqCommand.invoke), then imports the worker: rich and
    pygments, which structlog and httpx would pull in, stay out (hsq.extras)."""
    code = (
        "import sys\nfrom hsq.logs import configure\nconfigure()\n"
        "import hsq.workers.worker\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'pygments'}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert res.stdout.strip() == "[]", res.stdout


def test_a_hidden_module_imports_again_after_the_block() -> None:
    code = (
        "import importlib, sys\nfrom hsq.extras import hidden\n"
        "with hidden('os', 'csv'):\n"  # os is loaded already: it stays
        "    import os\n"
        "    try:\n        import csv\n    except ImportError:\n        print('hidden')\n"
        "import csv\nprint(csv.__name__)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert res.stdout.split() == ["hidden", "csv"], res.stdout


def test_a_plain_http_server_client_loads_no_ca_bundle_and_an_https_one_the_default() -> None:
    """The worker's client of an http:// server makes no TLS context (loading the CA bundle
    cost 30-50 ms of CPU at each start); an https:// one verifies with the default store."""
    import ssl

    from hsq.workers.send.client import ServerClient
    from hsq.workers.send.http import StdlibTransport

    plain = StdlibTransport("http://127.0.0.1:30000", request_timeout=1, connect_timeout=1)
    assert plain._tls is None
    tls = StdlibTransport("HTTPS://server:443", request_timeout=1, connect_timeout=1)
    assert tls._tls is not None
    assert tls._tls.verify_mode == ssl.CERT_REQUIRED and tls._tls.check_hostname
    ServerClient("http://127.0.0.1:1").close()
