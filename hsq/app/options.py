"""Click options built from a settings dataclass (hsq.settings): the flag, its type, its
default, its help text and its environment variables all come from the field."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from hsq.settings import base_name, env_names, setting_doc

F = Callable[..., Any]


def _plain_type(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), True
    return hint, False


def _click_type(hint: Any, choices: tuple[str, ...] | None) -> Any:
    if choices is not None:
        return click.Choice(choices)
    if hint is Path:
        return click.Path(path_type=Path)
    if hint in (int, float, str):
        return hint
    return str  # parsed by the field's `parse`


def field_option(f: dataclasses.Field[Any], hint: Any) -> Callable[[F], F]:
    """One click option for one settings field; the parameter name is the field's name."""
    doc = setting_doc(f)
    if doc is None:
        raise TypeError(f"settings field {f.name} has no setting() description")
    flag = doc.flag or "--" + base_name(f.name).replace("_", "-")
    required = f.default is dataclasses.MISSING
    kind, _optional = _plain_type(hint)
    envs = list(env_names(f))
    common: dict[str, Any] = {
        "envvar": envs,
        "show_envvar": True,
        "hidden": doc.hidden,
        "help": doc.help,
    }
    if kind is bool:
        if f.default is True:  # on by default: `--no-fsync` turns it off (HSQ_FSYNC=0 too)
            name = flag.removeprefix("--")
            return click.option(f"--{name}/--no-{name}", f.name, default=True, **common)
        return click.option(flag, f.name, is_flag=True, default=False, **common)
    if typing.get_origin(kind) is tuple and doc.parse is None:  # repeatable: --fault A --fault B
        return click.option(flag, f.name, multiple=True, default=(), **common)
    callback = None
    if doc.parse is not None:
        parse = doc.parse

        def callback(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
            if value is None or not isinstance(value, str):
                return value
            try:
                return parse(value)
            except ValueError as exc:
                raise click.BadParameter(str(exc)) from exc

    show: Any = doc.default_text if doc.default_text is not None else not required
    if f.default is None and doc.default_text is None:
        show = False
    if not required:  # click (>= 8.3) takes an explicit default=None as a given value
        common["default"] = f.default
    return click.option(
        flag,
        f.name,
        type=_click_type(kind, doc.choices),
        required=required,
        show_default=show,
        callback=callback,
        **common,
    )


def settings_options(
    cls: type, *, skip: Iterable[str] = (), only: Iterable[str] | None = None
) -> Callable[[F], F]:
    """Decorate a command with one option per field of `cls` (in field order), except
    `skip` (fields the command provides otherwise, e.g. the shared --redis option); with
    `only`, just those fields (a command that sets a few fields of a larger record)."""
    hints = typing.get_type_hints(cls)
    skipped = set(skip)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skipped and f.init]
    if only is not None:
        wanted = set(only)
        if unknown := wanted - {f.name for f in fields}:
            raise TypeError(f"{cls.__name__} has no settings {sorted(unknown)}")
        fields = [f for f in fields if f.name in wanted]

    def decorate(fn: F) -> F:
        for f in reversed(fields):  # click lists options in decoration order, bottom up
            fn = field_option(f, hints[f.name])(fn)
        return fn

    return decorate
