"""The class of every `hsq` command (`@hsq_command(NAME)`): hsq's own log options after the
command too, and a --help a person reads: the arguments described, the command's own
options, then the tuning ones (SettingDoc.section) folded into a line of names per heading
(`--help-all` describes them, with every environment variable), then the options every
command shares under headings of their own, so `hsq X --help` reads as X's options first.

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
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from hsq.cli.flags import TLS_HELP, LogFlags, RedisAccess, RedisFlags
from hsq.cli.options import option_names, settings_params

F = TypeVar("F", bound=Callable[..., Any])
_LOG_META = "hsq.log_flags"
_SECTION_COL = 25
"""The sections' option column: a longer row (the joined ones) stands on its own line."""
_OWN_COL = 24
"""The option column of a command's own options: a wider help column, fewer lines."""


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


_HELP_ALL = "hsq.help_all"
"""ctx.meta key: --help-all was asked for (every section described, not folded)."""


class HsqArgument(click.Argument):
    """A positional argument with a line of help, listed under "Arguments:" (click's own
    arguments have none); `rows` describes one that stands for several names (`hsq run`'s
    [DATASET] [-- SERVER_ARGS]), each with its line."""

    def __init__(
        self,
        decls: list[str],
        *,
        help: str = "",
        rows: tuple[tuple[str, str], ...] = (),
        **attrs: Any,
    ) -> None:
        super().__init__(decls, **attrs)
        self.help = help
        self.rows = rows

    def help_rows(self, ctx: click.Context) -> list[tuple[str, str]]:
        return list(self.rows) or [(self.make_metavar(ctx), self.help or "")]


def hsq_argument(name: str, *, help: str, **attrs: Any) -> Callable[[F], F]:
    """`@click.argument(NAME)` with a line of help (HsqArgument)."""
    return click.argument(name, cls=HsqArgument, help=help, **attrs)


def _show_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[_HELP_ALL] = True
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


def _help_all_option() -> click.Option:
    return click.Option(
        ["--help-all"],
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_show_all,
        help="every option described, with its variable",
    )


class HsqCommand(click.Command):
    """`open_sections`: the settings sections (SettingDoc.section) this command's --help
    describes in full, being its main business (`hsq tokenize`'s chat options); the others
    are folded into a line of names each until --help-all."""

    def __init__(self, *args: Any, open_sections: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_sections = open_sections
        if not self.context_settings.get("ignore_unknown_options"):
            self.params.extend(_log_params())
        self.params.append(_help_all_option())

    def invoke(self, ctx: click.Context) -> Any:
        configure_logs(ctx)
        return super().invoke(ctx)

    def format_arguments(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Nothing: format_options lists the arguments, described (HsqArgument)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        every = bool(ctx.meta.get(_HELP_ALL))
        section_of = {name: s for s in SECTIONS for name in s.names}
        arguments: list[tuple[str, str]] = []
        own: list[click.Parameter] = []
        eager: list[click.Parameter] = []
        grouped: dict[str, list[click.Parameter]] = {}
        params: dict[HelpSection, list[click.Parameter]] = {s: [] for s in SECTIONS}
        for p in self.get_params(ctx):
            s = section_of.get(p.name or "")
            title = getattr(p, "section", None)
            if isinstance(p, HsqArgument):
                arguments += p.help_rows(ctx)
            elif s is not None:
                params[s].append(p)
            elif isinstance(p, click.Option) and p.hidden:
                continue
            elif isinstance(p, click.Option) and p.is_eager:
                eager.append(p)
            elif isinstance(title, str):
                grouped.setdefault(title, []).append(p)
            else:
                own.append(p)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments, col_max=_OWN_COL)
        folded = {t: ps for t, ps in grouped.items() if not every and t not in self.open_sections}
        # A folded help describes the command's own options only, without their variables
        # (its heading says where they are); a short one is whole already.
        brief = bool(folded)
        with formatter.section("Options"):
            shown = [p for p in reversed(eager) if brief or every or p.name != "help_all"]
            formatter.write_dl(_records(ctx, [*own, *shown], envvar=not brief), col_max=_OWN_COL)
        for title, found in grouped.items():
            if title not in folded:
                with formatter.section(title):
                    formatter.write_dl(_records(ctx, found, envvar=not brief), col_max=_OWN_COL)
        if folded:  # the shared sections too: a line of names each
            folded.update({s.title: found for s, found in params.items() if found})
            with formatter.section("More options (--help-all: described, with their variables)"):
                _write_names(formatter, folded)
            return
        for s, found in params.items():
            if found:
                with formatter.section(s.title):
                    _write_section(ctx, formatter, s, found)


def _write_names(formatter: click.HelpFormatter, folded: dict[str, list[click.Parameter]]) -> None:
    """One row per folded section: its title, then its flags, wrapped between flags (click's
    own wrapping would break `--max-server-crashes` at a hyphen)."""
    width = max(len(t) for t in folded) + 3
    text_width = max(formatter.width - formatter.current_indent - width, 20)
    for title, params in folded.items():
        lines = textwrap.wrap(
            ", ".join(_flag(p) for p in params),
            text_width,
            break_on_hyphens=False,
            break_long_words=False,
        )
        for i, line in enumerate(lines):
            head = f"{title}:" if i == 0 else ""
            formatter.write(f"{'':>{formatter.current_indent}}{head:<{width}}{line}\n")


def _flag(p: click.Parameter) -> str:
    """The name a folded section lists an option by: its long flag, both halves of an on/off
    one (`--fsync/--no-fsync`: a recipe's `--no-fsync` is found in --help too)."""
    return "/".join([max(p.opts, key=len), *p.secondary_opts])


def _records(
    ctx: click.Context, params: list[click.Parameter], *, envvar: bool
) -> list[tuple[str, str]]:
    """--help rows of `params`, their environment variables only with `envvar`."""
    rows: list[tuple[str, str]] = []
    for p in params:
        shown = p
        if not envvar and isinstance(p, click.Option) and p.show_envvar:
            shown = copy.copy(p)
            shown.show_envvar = False
        if (record := shown.get_help_record(ctx)) is not None:
            rows.append(record)
    return rows


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
    """`@click.command(NAME)` with hsq's command class (`open_sections=` too)."""
    return click.command(name, cls=HsqCommand, **attrs)
