"""`hsq ARGS` called in this process: hsq.cli.main.main inside click's CliRunner isolation,
with what a subprocess would have given back (stdout and stderr apart, the exit code).

For the many command tests that check only a command's output and exit code, a fork of
the zygote costs more than the command (tests/helpers.py `hsq`). What a fresh process would
start with and end with, a call here restores around itself, so no call leaks into the
next test or the test around it:

- stdin empty (prompts refuse, as with stdin=DEVNULL), stdout and stderr captured, and the
  terminal size a child whose stdout is a pipe gets (COLUMNS and LINES, else 80x24), so
  --help wraps as it does in a subprocess, whatever terminal runs pytest;
- the environment exactly as the caller gives it (`env` replaces it whole, as
  subprocess's does), then restored whole: a command may set variables
  (TOKENIZERS_PARALLELISM) that click's isolation would not undo;
- logging: hsq.logs.configure sets structlog up with the stream it finds in sys.stderr
  and caches each module's logger at its first use, so the configuration before the call
  is put back and the loggers hsq's modules cached during it are dropped (else the next
  call would log into this call's closed stream, at this call's level and format);
- signal handlers, the working directory, sys.argv.

An exception the CLI does not turn into an exit code ends the call as it ends the
interpreter: its traceback on stderr, exit code 1. Commands that end their process with
os._exit or serve until signalled (worker, serve-reference, exporter, run, demo,
launch-*) are refused here, but for their --help: tests/helpers.py `hsq_process` starts
those.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from click import formatting
from click.testing import CliRunner

PROCESS_COMMANDS = frozenset(
    {"worker", "serve-reference", "exporter", "run", "demo", "launch-sglang", "launch-vllm"}
)
"""Commands whose process is the point: they serve until signalled or end in os._exit."""
PROG_NAME = "python -m hsq"
"""What click calls the program when hsq runs as `python -m hsq` (usage lines, errors)."""
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1)


def command_of(args: Sequence[str]) -> str | None:
    """The command `hsq ARGS` runs: the first word that is not a group option or its value."""
    it = iter(args)
    for a in it:
        if a in ("--log-format", "--log-level"):
            next(it, None)
        elif not a.startswith("-"):
            return a
    return None


def call(
    argv: Sequence[str], env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`hsq ARGV` in this process, as subprocess.run(capture_output=True, text=True) gives it
    back (args: the argv a process would have had)."""
    command = command_of(argv)
    if command in PROCESS_COMMANDS and not {"--help", "-h"} & set(argv):
        raise ValueError(f"`hsq {command}` is a process: start it with tests.helpers.hsq_process")
    runner = CliRunner()
    cpu = resource.getrusage(resource.RUSAGE_THREAD)
    with _restored(env), runner.isolation() as (out, err, _):
        formatting.FORCED_WIDTH = None  # click's isolation forces 80; the child's size wins
        code = _run(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    args = [sys.executable, "-m", "hsq", *argv]
    _census(args, code, cpu)
    return subprocess.CompletedProcess(args, code, stdout.decode(), stderr.decode())


def _run(argv: Sequence[str]) -> int:
    from hsq.cli.main import main

    sys.argv = ["hsq", *argv]
    try:
        main(list(argv), prog_name=PROG_NAME)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # as the interpreter does with sys.exit("text")
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def _census(args: list[str], code: int, before: resource.struct_rusage) -> None:
    """One line for scripts/test_census.py when it runs the suite (HSQ_CENSUS set)."""
    path = os.environ.get("HSQ_CENSUS")
    if path is None:
        return
    now = resource.getrusage(resource.RUSAGE_THREAD)
    line = {
        "inproc": True,
        "argv": args[1:13],
        "code": code,
        "forked": False,
        "user": round(now.ru_utime - before.ru_utime, 3),
        "sys": round(now.ru_stime - before.ru_stime, 3),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@contextlib.contextmanager
def _restored(env: Mapping[str, str] | None) -> Iterator[None]:
    saved_env = dict(os.environ)
    saved_argv = list(sys.argv)
    saved_cwd = os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    saved_logs = _structlog_config()
    saved_size = shutil.get_terminal_size
    shutil.get_terminal_size = _pipe_terminal_size
    _drop_cached_loggers()
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        shutil.get_terminal_size = saved_size
        os.chdir(saved_cwd)
        for s, handler in saved_signals.items():
            if handler is not None:
                signal.signal(s, handler)
        _restore_structlog(saved_logs)


def _pipe_terminal_size(fallback: tuple[int, int] = (80, 24)) -> os.terminal_size:
    """shutil.get_terminal_size in a process whose stdout is not a terminal."""

    def env(name: str) -> int:
        try:
            return int(os.environ.get(name, "0"))
        except ValueError:
            return 0

    return os.terminal_size((env("COLUMNS") or fallback[0], env("LINES") or fallback[1]))


def _structlog_config() -> dict[str, Any] | None:
    structlog = sys.modules.get("structlog")
    return None if structlog is None else dict(structlog.get_config())


def _restore_structlog(saved: dict[str, Any] | None) -> None:
    structlog = sys.modules.get("structlog")
    if structlog is None:
        return
    if saved is None:
        structlog.reset_defaults()
    else:
        structlog.configure(**saved)
    _drop_cached_loggers()


def _drop_cached_loggers() -> None:
    """A lazy proxy (structlog.get_logger() at a module's top) that cached its logger keeps
    that logger, with the stream and level of its day, in its own `bind`: deleting it makes
    the next use build one anew from the configuration of the moment. Before a call too:
    a test that ran a command through CliRunner itself may have left one cached."""
    structlog = sys.modules.get("structlog")
    if structlog is None:
        return
    proxy = structlog._config.BoundLoggerLazyProxy
    # A copy in one step: another thread (a log reader's lazy import) may add a module
    # while a loop over the live dict runs ("dictionary changed size during iteration").
    for name, module in sys.modules.copy().items():
        if not name.startswith("hsq") or module is None:
            continue
        for value in vars(module).copy().values():
            if isinstance(value, proxy) and "bind" in vars(value):
                del value.bind
