"""Settings fields that describe themselves: one default, one help text, one flag name.

A settings dataclass (workers.settings.WorkerSettings, the reference server's
ReferenceSettings, hsq.runconfig.RunConfig, the tokenizer's TokenizeSettings and ChatOptions,
the shell's own flag records in hsq/cli/) declares each field with :func:`setting`; the CLI
builds every one of its options from these fields (hsq.cli.options), so a default lives in
one place. Every setting can be given as a flag or as an environment variable,
``HSQ_<FIELD>`` (plus any older names the field lists), the same rule in every command, so
fields are named for what they mean (`audit_server`, not `server`, which is the worker's).
A renamed flag or variable keeps its old name as a deprecated alias (`deprecated`,
`deprecated_env`): it still works, and says once on stderr what replaced it.
The only exceptions are `flag_only` fields: per-invocation choices that delete, rewrite or
requeue (`purge --yes`, `export --prune`, `requeue --failed`) or that change what a
command's input is (`enqueue --tokenizer`), which a variable left in a shell must not make
for the next command.
No click here: contracts and services may import this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "HSQ_"


@dataclasses.dataclass(frozen=True)
class SettingDoc:
    """What the CLI needs to know about one field besides its type and default."""

    help: str
    flag: str | None = None
    """The flag's name when it is not the field's (`dump_timeout_s` -> `--dump-timeout`)."""
    env: tuple[str, ...] = ()
    """Environment variables read when the flag is not given, first found wins; empty:
    ``HSQ_<FIELD>`` with any `_s` unit suffix dropped."""
    hidden: bool = False
    parse: Callable[[str], Any] | None = None
    """From the flag's text to the field's value (e.g. "2,4,5" -> (2, 4, 5))."""
    default_text: str | None = None
    """How --help shows a default computed later (None: the field's default)."""
    choices: tuple[str, ...] | None = None
    """The only values allowed (shown by --help)."""
    aliases: tuple[str, ...] = ()
    """More names of the flag (`-o`; `--host`, an older spelling of `--metrics-host`)."""
    path: str | None = None
    """For a path: "file" or "dir", what it must be where it exists (None: either)."""
    exists: bool = False
    """For a path: it must exist when the command starts."""
    minimum: int | None = None
    """For an int: the smallest value allowed."""
    flag_only: bool = False
    """No environment variable: a per-invocation choice (module docstring)."""
    deprecated: tuple[str, ...] = ()
    """Older names of the flag that still work, hidden from --help; using one prints a
    line on stderr naming the new one (`--server-kind`, now `--engine`)."""
    deprecated_env: tuple[str, ...] = ()
    """Older environment variables, read when none of `env_names` is set (not listed by
    --help); likewise announced when used."""
    section: str | None = None
    """The heading --help lists the option under, folded into one line of names unless the
    command shows that section in full or --help-all is asked for (None: the command's own
    options, always described): tuning a first run does not need stays out of the way."""
    metavar: str | None = None
    """What --help shows for the value (None: from the type, e.g. DIR, N)."""


def int_tuple(text: str) -> tuple[int, ...]:
    """ "2,4,5" -> (2, 4, 5)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, not {text!r}") from None


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    env: tuple[str, ...] = (),
    hidden: bool = False,
    parse: Callable[[str], Any] | None = None,
    default_text: str | None = None,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    path: str | None = None,
    exists: bool = False,
    minimum: int | None = None,
    flag_only: bool = False,
    deprecated: tuple[str, ...] = (),
    deprecated_env: tuple[str, ...] = (),
    section: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field carrying its CLI description (no default: a required setting)."""
    if path not in (None, "file", "dir"):
        raise ValueError(f"path must be 'file', 'dir' or None, not {path!r}")
    doc = SettingDoc(
        help, flag, env, hidden, parse, default_text, choices, aliases, path, exists, minimum,
        flag_only, deprecated, deprecated_env, section, metavar,
    )  # fmt: skip
    return dataclasses.field(default=default, metadata={"setting": doc})


def int_list_or_none(text: str) -> list[int] | None:
    """ "2,4,5" -> [2, 4, 5]; "" -> None (not given)."""
    return list(int_tuple(text)) or None


def int_tuple_or_none(text: str) -> tuple[int, ...] | None:
    """ "2,4,5" -> (2, 4, 5); "" -> None (not given)."""
    return int_tuple(text) or None


def setting_doc(f: dataclasses.Field[Any]) -> SettingDoc | None:
    doc = f.metadata.get("setting")
    return doc if isinstance(doc, SettingDoc) else None


def base_name(field_name: str) -> str:
    """`dump_timeout_s` -> `dump_timeout`: units stay in the field, not in flags."""
    return field_name.removesuffix("_s")


def env_names(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """The variables a setting is read from when its flag is not given (none: flag_only)."""
    doc = setting_doc(f)
    if doc is not None and doc.flag_only:
        return ()
    own = ENV_PREFIX + base_name(f.name).upper()
    if doc is None or not doc.env:
        return (own,)
    return doc.env if own in doc.env else (own, *doc.env)
