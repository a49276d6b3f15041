"""The options of a command that enqueues DATASET (`hsq enqueue`, `hsq run`): how DATASET
is read (hsq.producer.settings.DatasetFlags), the run's RUN_SETTINGS and the chat rows'
tokenize settings; `take_dataset` turns what click parsed into the producer's
DatasetInput, with which settings the user left at their defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hsq import extras
from hsq.cli.options import given, settings_options, take
from hsq.producer.settings import RUN_SETTINGS, DatasetFlags, DatasetInput, TokenizeSettings
from hsq.runconfig import RunConfig


def dataset_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a command with DatasetFlags, RUN_SETTINGS and TokenizeSettings' options."""
    fn = settings_options(TokenizeSettings, skip=("tokenizer",))(fn)
    fn = settings_options(RunConfig, only=RUN_SETTINGS)(fn)
    return settings_options(DatasetFlags)(fn)


def take_dataset(values: dict[str, Any], command: str) -> DatasetInput:
    """What dataset_options parsed for `command` (named in the message when --tokenizer
    needs an extra that is not installed). Inside the command only (it asks click which
    settings were given)."""
    flags = take(DatasetFlags, values)
    settings = {name: values.pop(name) for name in RUN_SETTINGS}
    defaulted = frozenset(name for name in RUN_SETTINGS if not given(name))
    chat = None
    if flags.tokenizer is not None:
        extras.require("chat", f"{command} --tokenizer")
        chat = take(TokenizeSettings, values, tokenizer=str(flags.tokenizer))
    return DatasetInput(flags, settings, defaulted, chat)
