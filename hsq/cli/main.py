"""The `hsq` command line: the group, its commands (hsq/cli/commands/, named in COMMANDS and
imported only when asked for: hsq/cli/group.py) and the exit codes.

Every option of every command is built from a settings dataclass (hsq.settings.setting,
hsq/cli/options.py), so each is a flag and an environment variable the same way. A command
parses, calls a service or hsq/ops/, and formats.

Exit codes (hsq/errors.py): 0 ok, 1 problems found, 2 usage or configuration error,
3 Redis unreachable.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from hsq import __version__
from hsq.cli.command import apply_log_flags
from hsq.cli.flags import LogFlags
from hsq.cli.group import LazyCommand, LazyGroup
from hsq.cli.options import settings_options, take
from hsq.errors import EXIT_PROBLEMS, EXIT_REDIS, EXIT_USAGE, ConfigError, HsqError, StoreError
from hsq.extras import extra_error


def _entry(target: str, short_help: str) -> LazyCommand:
    return LazyCommand("hsq.cli.commands." + target, short_help)


# name -> where the command lives and what `hsq --help` says of it (hsq/cli/group.py): a
# command's module is imported when that command runs, not before.
COMMANDS: dict[str, LazyCommand] = {
    "serve-reference": _entry(
        "serve:serve_reference",
        "Serve a real transformer with SGLang's HTTP API, dumping hidden states per request.",
    ),
    "worker": _entry("serve:worker", "Extract samples of a run through one inference server."),
    "exporter": _entry(
        "serve:exporter", "Serve queue-level Prometheus metrics for every run in a Redis."
    ),
    "launch-sglang": _entry(
        "sglang:launch_sglang",
        "Start a stock SGLang server that dumps hidden states, then check that it does.",
    ),
    "launch-vllm": _entry(
        "vllm:launch_vllm",
        "Start a stock vLLM server whose connector writes hsq dumps into the dump dir.",
    ),
    "tokenize": _entry(
        "produce:tokenize",
        "Tokenize chat rows (ShareGPT / OpenAI messages) into `hsq enqueue`'s JSONL.",
    ),
    "enqueue": _entry(
        "produce:enqueue",
        "Validate DATASET (JSONL) and enqueue the samples that are neither done nor queued.",
    ),
    "recover": _entry(
        "recover:recover",
        "Rebuild a run's Redis state from its output files (after a Redis loss).",
    ),
    "status": _entry(
        "status:status",
        "How far along a run is: counts, rate, ETA, workers, dead letter by reason.",
    ),
    "runs": _entry("status:runs", "List runs with their progress."),
    "requeue": _entry(
        "admin:requeue", "Put failed, chosen or lost samples back in the queue (idempotent)."
    ),
    "purge": _entry("admin:purge", "Delete a run's Redis state (queues, done, dead letter)."),
    "acl": _entry("admin:acl", "Print a Redis ACL user that can work on one run only."),
    "verify": _entry(
        "verify:verify",
        "Check every output file against the run's manifest; exit 1 if anything is wrong.",
    ),
    "audit": _entry(
        "verify:audit",
        "Re-extract a random subset of done samples alone and compare with the stored states.",
    ),
    "export": _entry("export:export", "Write a run's outputs in the layout a trainer reads."),
    "demo": _entry(
        "demo:demo",
        "Extract a synthetic dataset end to end on this machine, then verify every output.",
    ),
    "run": _entry(
        "run:run", "Run a whole node's share of a run: Redis, servers, workers, live view."
    ),
}


_BY_HAND = ("tokenize", "enqueue", "launch-sglang", "launch-vllm", "serve-reference", "worker")
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Start here", ("run", "demo")),
    ("Watch and repair a run", ("status", "runs", "verify", "audit", "requeue", "recover")),
    ("Use the outputs, then clean up", ("export", "purge")),
    ("A run by hand, one part at a time", (*_BY_HAND, "exporter", "acl")),
)
"""`hsq --help`'s headings: what a first hour needs first, the parts of a run last."""


@click.group(
    cls=LazyGroup,
    table=COMMANDS,
    sections=SECTIONS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="hsq")
@settings_options(LogFlags)
@click.pass_context
def cli(ctx: click.Context, /, **values: Any) -> None:
    """hsq: extract an LLM's hidden states at scale to train EAGLE-3 drafters."""
    apply_log_flags(ctx, take(LogFlags, values))


def every_command() -> dict[str, click.Command]:
    """Every `hsq` command by name, loaded (for tests that walk all of them)."""
    assert isinstance(cli, LazyGroup)
    return cli.every_command()


# Expected failures: one line on stderr and an exit code (docs/operations.md), never a
# traceback. The first matching class wins: ConfigError and StoreError are HsqErrors.
_EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    (ConfigError, EXIT_USAGE),
    (StoreError, EXIT_REDIS),
    (HsqError, EXIT_PROBLEMS),
    (OSError, EXIT_PROBLEMS),
)


def main(args: Sequence[str] | None = None, prog_name: str | None = None) -> None:
    """`hsq ARGS` (sys.argv's by default), ending in SystemExit for any exit code but 0.
    The tests call it in process too (tests/support/inproc.py), with the program name a
    `python -m hsq` would show."""
    try:
        cli(args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_PROBLEMS)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except (HsqError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(next(code for kind, code in _EXIT_CODES if isinstance(exc, kind)))
    except ModuleNotFoundError as exc:  # an optional dependency a command did not check
        missing = extra_error(exc)
        if missing is None:
            raise
        click.echo(f"error: {missing}", err=True)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
