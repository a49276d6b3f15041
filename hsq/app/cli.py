"""The `hsq` command line: the group, its commands (hsq/app/commands/) and the exit codes.

Every option of every command is built from a settings dataclass (hsq.settings.setting,
hsq/app/options.py), so each is a flag and an environment variable the same way. A command
parses, calls a service or hsq/app/ops/, and formats.

Exit codes (hsq/app/exits.py): 0 ok, 1 problems found, 2 usage or configuration error,
3 Redis unreachable.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from hsq import __version__
from hsq.app.command import apply_log_flags
from hsq.app.commands import (
    admin,
    demo,
    export,
    produce,
    recover,
    run,
    serve,
    sglang,
    status,
    verify,
    vllm,
)
from hsq.app.exits import EXIT_PROBLEMS, EXIT_REDIS, EXIT_USAGE
from hsq.app.flags import LogFlags
from hsq.app.options import settings_options, take
from hsq.errors import ConfigError, HsqError, StoreError
from hsq.extras import extra_error


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hsq")
@settings_options(LogFlags)
@click.pass_context
def cli(ctx: click.Context, /, **values: Any) -> None:
    """hsq: extract an LLM's hidden states at scale to train EAGLE-3 drafters."""
    apply_log_flags(ctx, take(LogFlags, values))


for _command in (
    serve.serve_reference,
    serve.worker,
    serve.exporter,
    sglang.launch_sglang,
    vllm.launch_vllm,
    produce.tokenize,
    produce.enqueue,
    recover.recover,
    status.status,
    status.runs,
    admin.requeue,
    admin.purge,
    admin.acl,
    verify.verify,
    verify.audit,
    export.export,
    demo.demo,
    run.run,
):
    cli.add_command(_command)

# Expected failures: one line on stderr and an exit code (docs/operations.md), never a
# traceback. The first matching class wins: ConfigError and StoreError are HsqErrors.
_EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    (ConfigError, EXIT_USAGE),
    (StoreError, EXIT_REDIS),
    (HsqError, EXIT_PROBLEMS),
    (OSError, EXIT_PROBLEMS),
)


def main() -> None:
    try:
        cli(standalone_mode=False)
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
