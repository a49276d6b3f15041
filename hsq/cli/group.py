"""The `hsq` group's lazy command table: a command's module is imported only when that
command runs (or its --help is asked for), so `hsq status` does not pay for the worker's,
the producer's and the servers' imports, and `hsq --help` imports none of them.

Each entry names the command's `module:attribute` and its short help (the first sentence
of its docstring, what `hsq --help` lists); tests/test_cli_start.py holds the table to
the commands themselves: the same names, the same short help, the same `hsq --help`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from gettext import gettext as _
from typing import Any

import click


@dataclass(frozen=True)
class LazyCommand:
    target: str
    """`module:attribute` of the click command."""
    short_help: str
    """The command's help up to the end of its first sentence, as `hsq --help` lists it."""

    def load(self) -> click.Command:
        module, _, attr = self.target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.target} is not a click command")
        return command


_WHOLE = 1000
"""A limit no first sentence reaches: `hsq --help` wraps a command's help, never cuts it."""


class LazyGroup(click.Group):
    """A click group whose commands come from `table`, each imported on first use."""

    def __init__(
        self,
        *args: Any,
        table: Mapping[str, LazyCommand],
        sections: tuple[tuple[str, tuple[str, ...]], ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.table = dict(table)
        self.sections = sections
        """(heading, command names) in the order --help lists them; a command in none is
        listed under "Commands"."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.table, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.table:
            self.add_command(self.table[cmd_name].load(), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands under their headings (`sections`), in one column, each with its first
        sentence, wrapped rather than cut; the table's short help stands in for a command not loaded
        yet (a stand-in click shortens exactly as it would the real help)."""
        shown: dict[str, click.Command] = {}
        for name in self.list_commands(ctx):
            command = self.commands.get(name)
            if command is None:
                command = click.Command(name, help=self.table[name].short_help)
            if not command.hidden:
                shown[name] = command
        placed = {name for _, names in self.sections for name in names}
        groups = [*self.sections, (_("Commands"), tuple(n for n in shown if n not in placed))]
        width = max((len(name) for name in shown), default=0)
        for heading, names in groups:
            rows = [
                (n.ljust(width), shown[n].get_short_help_str(_WHOLE)) for n in names if n in shown
            ]
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows, col_max=width)

    def every_command(self) -> dict[str, click.Command]:
        """Every command, loaded (tests and tools that walk all of them)."""
        ctx = click.Context(self)
        found = {name: self.get_command(ctx, name) for name in self.list_commands(ctx)}
        return {name: c for name, c in found.items() if c is not None}
