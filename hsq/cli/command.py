"""The class of every `hsq` command (`@hsq_command(NAME)`): hsq's own log options after the
command too, and --help with the options every command shares under headings of their
own, after the command's own, so `hsq X --help` reads as X's options first.

`hsq status --log-format console` and `hsq --log-format console status` are the same: the
group keeps its log options (apply_log_flags), a command's log option given on its command
line replaces the group's, and logging is configured once, from the result, when the
command runs (not for its --help: structlog is not even imported then). Commands that hand
unknown options to another program (launch-sglang, launch-vllm: SGLang has a --log-level
of its own) take them only before the command.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from hsq.cli.flags import TLS_HELP, LogFlags, RedisAccess, RedisFlags
from hsq.cli.options import option_names, settings_params

_LOG_META = "hsq.log_flags"
_SECTION_COL = 25
"""The sections' option column: a longer row (the joined ones) stands on its own line."""


@dataclass(frozen=True)
class HelpSection:
    """A heading in --help and the options under it, their environment variables in one
    line at the end; `joined` options share one row."""

    title: str
    names: tuple[str, ...]
    joined: tuple[str, ...] = ()
    joined_help: str = ""
    env_line: bool = True


SECTIONS = (
    HelpSection(
        "Redis connection",
        (*option_names(RedisFlags), *option_names(RedisAccess)),
        joined=("redis_ca", "redis_cert", "redis_key"),
        joined_help=TLS_HELP,
    ),
    HelpSection(
        "Logging",
        option_names(LogFlags),
        joined=option_names(LogFlags),
        joined_help="hsq's, here or before the command (hsq --help)",
        env_line=False,
    ),
)


def apply_log_flags(ctx: click.Context, flags: LogFlags) -> None:
    """Keep `flags` as the log options the command runs with (HsqCommand.invoke)."""
    ctx.meta[_LOG_META] = flags


def configure_logs(ctx: click.Context) -> None:
    """Configure logging from the log options kept so far (the defaults if none were)."""
    from hsq.logs import configure

    flags = ctx.meta.get(_LOG_META, LogFlags())
    configure(flags.log_level, flags.log_format)


def _given_log_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # Only a flag on this command's line overrides the group's: the environment variable
    # is the same one the group has read already.
    source = ctx.get_parameter_source(param.name) if param.name else None
    if param.name and source is click.core.ParameterSource.COMMANDLINE:
        current = ctx.meta.get(_LOG_META, LogFlags())
        apply_log_flags(ctx, dataclasses.replace(current, **{param.name: value}))
    return value


def _log_params() -> list[click.Option]:
    params = settings_params(LogFlags)
    for p in params:
        p.expose_value = False
        p.callback = _given_log_option
    return params


class HsqCommand(click.Command):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.context_settings.get("ignore_unknown_options"):
            self.params.extend(_log_params())

    def invoke(self, ctx: click.Context) -> Any:
        configure_logs(ctx)
        return super().invoke(ctx)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        section_of = {name: s for s in SECTIONS for name in s.names}
        own: list[tuple[str, str]] = []
        params: dict[HelpSection, list[click.Parameter]] = {s: [] for s in SECTIONS}
        for p in self.get_params(ctx):
            s = section_of.get(p.name or "")
            if s is not None:
                params[s].append(p)
            elif (record := p.get_help_record(ctx)) is not None:
                own.append(record)
        with formatter.section("Options"):
            formatter.write_dl(own)
        for s, found in params.items():
            if found:
                with formatter.section(s.title):
                    _write_section(ctx, formatter, s, found)


def _write_section(
    ctx: click.Context,
    formatter: click.HelpFormatter,
    section: HelpSection,
    params: list[click.Parameter],
) -> None:
    """The section's rows without their environment variables, then those in one line."""
    rows: list[tuple[str, str]] = []
    joined = [p for p in params if p.name in section.joined]
    envs: list[str] = []
    for p in params:
        if p.hidden if isinstance(p, click.Option) else False:
            continue
        env = p.envvar
        envs += [env] if isinstance(env, str) else list(env or [])
        if p in joined:
            if p is joined[0]:  # the row stands where the first of them stood
                rows.append((", ".join(max(q.opts, key=len) for q in joined), section.joined_help))
            continue
        quiet = copy.copy(p)
        if isinstance(quiet, click.Option):
            quiet.show_envvar = False
        if (record := quiet.get_help_record(ctx)) is not None:
            rows.append(record)
    formatter.write_dl(rows, col_max=_SECTION_COL)
    if envs and section.env_line:
        formatter.write_text("environment: " + ", ".join(envs))


def hsq_command(name: str, **attrs: Any) -> Callable[[Callable[..., Any]], HsqCommand]:
    """`@click.command(NAME)` with hsq's command class."""
    return click.command(name, cls=HsqCommand, **attrs)
