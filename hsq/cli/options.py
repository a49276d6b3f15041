"""Click options built from a settings dataclass (hsq.settings): the flag, its type, its
default, its help text and its environment variables all come from the field.

`settings_options(Cls)` adds one option per field to a command (a field holding another
settings dataclass adds that one's fields, so `TokenizeSettings.options` brings the
`ChatOptions` flags); `take(Cls, values)` builds the instance back from what click parsed.
Every option of `hsq` is made here, so every one reads its environment variable the same
way (hsq.settings.env_names).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from hsq.settings import SettingDoc, base_name, env_names, setting_doc

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

F = Callable[..., Any]
T = TypeVar("T", bound="DataclassInstance")


def _plain_type(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), True
    return hint, False


def _click_type(hint: Any, doc: SettingDoc) -> Any:
    if doc.choices is not None:
        return click.Choice(doc.choices, case_sensitive=False)  # --log-level info too
    if hint is Path or (hint is str and doc.path is not None):
        return click.Path(
            exists=doc.exists,
            file_okay=doc.path != "dir",
            dir_okay=doc.path != "file",
            path_type=Path if hint is Path else str,
        )
    if hint is int and doc.minimum is not None:
        return click.IntRange(min=doc.minimum)
    if hint in (int, float, str) and doc.parse is None:
        return hint
    return str  # parsed by the field's `parse` (a size such as 64G for an int)


def _metavar(hint: Any, doc: SettingDoc) -> str | None:
    """--help's name for the value: the field's own, else a short one for the types whose
    click name is long (DIRECTORY, INTEGER RANGE); None: click's."""
    if doc.metavar is not None:
        return doc.metavar
    if doc.choices is None and doc.path == "dir":
        return "DIR"
    if hint is int and doc.parse is None:
        return "INTEGER"
    return None


def _nested(f: dataclasses.Field[Any], hint: Any) -> type | None:
    """The settings dataclass a field holds whole (its fields are flags of their own)."""
    if setting_doc(f) is None and isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    return None


def _decls(flag: str, aliases: tuple[str, ...]) -> list[str]:
    """The flag's names as --help lists them: a short one first (`-o, --output`)."""
    short = [a for a in aliases if not a.startswith("--")]
    return [*short, flag, *(a for a in aliases if a.startswith("--"))]


OptionSpec = tuple[type[click.Option], list[str], dict[str, Any]]
"""(option class, declarations, attributes): one click option, made by settings_params or
by settings_options' decorator."""


def field_specs(f: dataclasses.Field[Any], hint: Any) -> list[OptionSpec]:
    """The click options of one settings field: its own (the parameter name is the
    field's), then one hidden DeprecatedAlias per older name of its flag."""
    decls, attrs = option_args(f, hint)
    doc = setting_doc(f)
    assert doc is not None  # option_args refused a field without one
    new = flag_of(f.name, doc)
    aliases: list[OptionSpec] = [
        (DeprecatedAlias, [old, f"{f.name}__{old.strip('-').replace('-', '_')}"],
         {"type": attrs.get("type"), "new": new, "field": f.name, "parse": doc.parse})
        for old in doc.deprecated
    ]  # fmt: skip
    return [(SettingOption, decls, {**attrs, "section": doc.section}), *aliases]


class SettingOption(click.Option):
    """An option made from a settings field, with the --help heading it belongs under
    (SettingDoc.section; hsq/cli/command.py lists it there)."""

    def __init__(self, decls: list[str], *, section: str | None = None, **attrs: Any) -> None:
        super().__init__(decls, **attrs)
        self.section = section


def option_args(f: dataclasses.Field[Any], hint: Any) -> tuple[list[str], dict[str, Any]]:
    """click.Option's declarations and attributes for one settings field."""
    doc = setting_doc(f)
    if doc is None:
        raise TypeError(f"settings field {f.name} has no setting() description")
    flag = flag_of(f.name, doc)
    names = _decls(flag, doc.aliases)
    required = f.default is dataclasses.MISSING
    kind, _optional = _plain_type(hint)
    envs = list(env_names(f))
    common: dict[str, Any] = {
        "envvar": envs or None,
        "show_envvar": bool(envs),
        "hidden": doc.hidden,
        "help": doc.help,
    }
    if doc.deprecated or doc.deprecated_env:
        if required or kind is bool or typing.get_origin(kind) is tuple:
            raise TypeError(f"{f.name}: deprecated names need a single value with a default")
        common["callback"] = _Renamed(doc, flag)
    if kind is bool:
        if f.default is True:  # on by default: `--no-fsync` turns it off (HSQ_FSYNC=0 too)
            name = flag.removeprefix("--")
            return [f"--{name}/--no-{name}", f.name], {"default": True, **common}
        return [*names, f.name], {"is_flag": True, "default": False, **common}
    if typing.get_origin(kind) is tuple and doc.parse is None:  # repeatable: --fault A --fault B
        item = typing.get_args(kind)[0]
        return [*names, f.name], {
            "multiple": True,
            "default": (),
            "type": _click_type(item, doc),
            "metavar": _metavar(item, doc),
            **common,
        }
    show: Any = doc.default_text if doc.default_text is not None else not required
    if f.default is None and doc.default_text is None:
        show = False
    if not required:  # click (>= 8.3) takes an explicit default=None as a given value
        common["default"] = f.default
    if doc.parse is not None and "callback" not in common:
        common["callback"] = _Parse(doc.parse)
    return [*names, f.name], {
        "type": _click_type(kind, doc),
        "metavar": _metavar(kind, doc),
        "required": required,
        "show_default": show,
        **common,
    }


def flag_of(name: str, doc: SettingDoc) -> str:
    """A field's flag: its own name (`--dump-timeout` for dump_timeout_s) unless it names one."""
    return doc.flag or "--" + base_name(name).replace("_", "-")


class _Parse:
    """A field's `parse` as a click callback: from the flag's text to the field's value."""

    def __init__(self, parse: Callable[[str], Any]) -> None:
        self.parse = parse

    def __call__(self, _ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc


_ALIASED = "hsq.deprecated_aliases"
"""ctx.meta key: {parameter name: (the old flag, the value)} given through a DeprecatedAlias."""


def deprecation(old: str, new: str) -> None:
    """The one line on stderr a deprecated name prints (scripts keep working meanwhile)."""
    click.echo(f"warning: {old} is deprecated and will be removed: use {new}", err=True)


class _Renamed:
    """The callback of a field with older names: a value given through a DeprecatedAlias
    (on the command line) or an older variable (when none of the field's is set) becomes
    the field's, announced once; the new flag and the old one together are refused."""

    def __init__(self, doc: SettingDoc, flag: str) -> None:
        self.doc = doc
        self.flag = flag

    def __call__(self, ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        assert param.name is not None
        source = ctx.get_parameter_source(param.name)
        given = ctx.meta.get(_ALIASED, {})
        if param.name in given:
            if source is ParameterSource.COMMANDLINE:
                raise click.UsageError(f"give {self.flag} once ({given[param.name][0]} is it)")
            ctx.set_parameter_source(param.name, ParameterSource.COMMANDLINE)
            return given[param.name][1]
        if source is ParameterSource.DEFAULT:
            for env in self.doc.deprecated_env:
                raw = os.environ.get(env)
                if raw:
                    deprecation(env, (list(param.envvar or []) or [self.flag])[0])
                    ctx.set_parameter_source(param.name, ParameterSource.ENVIRONMENT)
                    value = param.type_cast_value(ctx, raw)
                    break
        return value if self.doc.parse is None else _Parse(self.doc.parse)(ctx, param, value)


class DeprecatedAlias(click.Option):
    """An older name of a settings option (SettingDoc.deprecated): hidden from --help, no
    variable of its own; its value, checked as the option's, goes to that option (`field`,
    whose flag is now `new`) with a line on stderr. Only on the command line: a default or
    variable is read by the option itself."""

    def __init__(
        self,
        decls: list[str],
        *,
        new: str,
        field: str,
        parse: Callable[[str], Any] | None,
        **attrs: Any,
    ) -> None:
        super().__init__(decls, hidden=True, expose_value=False, callback=self._given, **attrs)
        self.new, self.field = new, field
        self.parse = None if parse is None else _Parse(parse)

    def _given(self, ctx: click.Context, param: click.Parameter, value: Any) -> None:
        assert self.name is not None
        if ctx.get_parameter_source(self.name) is not ParameterSource.COMMANDLINE:
            return
        old = self.opts[0]
        if ctx.get_parameter_source(self.field) is ParameterSource.COMMANDLINE:
            raise click.UsageError(f"give {self.new} once ({old} is it)")
        deprecation(old, self.new)
        if self.parse is not None:
            value = self.parse(ctx, param, value)
        ctx.meta.setdefault(_ALIASED, {})[self.field] = (old, value)


def settings_params(cls: type) -> list[click.Option]:
    """The options settings_options(cls) adds, as click.Option objects (for a command
    class that adds them itself: hsq/cli/command.py)."""
    return [
        kind(decls, **attrs)
        for f, hint in _option_fields(cls)
        for kind, decls, attrs in field_specs(f, hint)
    ]


def option_names(cls: type) -> tuple[str, ...]:
    """The parameter names of the options settings_options(cls) adds."""
    return tuple(f.name for f, _ in _option_fields(cls))


def _option_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, type) of every option `cls` makes, nested settings flattened, in order."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[dataclasses.Field[Any], Any]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        inner = _nested(f, hints[f.name])
        out += _option_fields(inner) if inner is not None else [(f, hints[f.name])]
    return out


def settings_options(
    cls: type, *, skip: Iterable[str] = (), only: Iterable[str] | None = None
) -> Callable[[F], F]:
    """Decorate a command with one option per field of `cls` (in field order), except
    `skip` (fields the command provides otherwise, e.g. the shared --redis option); with
    `only`, just those fields (a command that sets a few fields of a larger record)."""
    skipped = set(skip)
    fields = [(f, hint) for f, hint in _option_fields(cls) if f.name not in skipped]
    if only is not None:
        wanted = set(only)
        if unknown := wanted - {f.name for f, _ in fields}:
            raise TypeError(f"{cls.__name__} has no settings {sorted(unknown)}")
        fields = [(f, hint) for f, hint in fields if f.name in wanted]

    specs = [spec for f, hint in fields for spec in field_specs(f, hint)]

    def decorate(fn: F) -> F:
        for kind, decls, attrs in reversed(specs):  # click lists options bottom up
            fn = click.option(*decls, cls=kind, **attrs)(fn)
        return fn

    return decorate


def take(cls: type[T], values: dict[str, Any], **fixed: Any) -> T:
    """The `cls` that settings_options(cls) parsed: its fields are taken out of `values`
    (nested settings rebuilt); `fixed` gives fields the command set otherwise (a skipped
    one); a field in neither keeps its default."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        inner = _nested(f, hints[f.name])
        if f.name in fixed:
            kwargs[f.name] = fixed[f.name]
        elif inner is not None:
            kwargs[f.name] = take(inner, values)
        elif f.name in values:
            kwargs[f.name] = values.pop(f.name)
    return cls(**kwargs)


def given(param: str) -> bool:
    """Whether the user gave `param` (flag or env var), not click's default. Inside a
    command only."""
    source = click.get_current_context().get_parameter_source(param)
    return source not in (None, click.core.ParameterSource.DEFAULT)


def on_command_line(param: str) -> bool:
    """Whether `param` was given as a flag (not through its environment variable)."""
    source = click.get_current_context().get_parameter_source(param)
    return source is click.core.ParameterSource.COMMANDLINE


def as_argv(obj: DataclassInstance, *, skip: Iterable[str] = ()) -> list[str]:
    """The flags that give a command the fields of `obj` that differ from their defaults
    (the inverse of `take`): how `hsq run` hands its worker settings to each `hsq worker`."""
    skipped = set(skip)
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not f.init or f.name in skipped or value == f.default:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            argv += as_argv(value, skip=skip)
            continue
        doc = setting_doc(f)
        if doc is None:
            raise TypeError(f"settings field {f.name} has no setting() description")
        flag = flag_of(f.name, doc)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif value is None:
            continue  # a None that differs from a default: not expressible as a flag
        elif isinstance(value, tuple) and doc.parse is None:
            for item in value:
                argv += [flag, str(item)]
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv
