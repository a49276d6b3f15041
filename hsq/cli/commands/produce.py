"""`hsq tokenize` and `hsq enqueue`: chat rows to tokens, a dataset to a run's queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hsq import extras
from hsq.cli.command import hsq_command
from hsq.cli.flags import RedisFlags, RunName
from hsq.cli.options import given, settings_options, take
from hsq.producer.settings import TokenizeSettings
from hsq.runconfig import RunConfig
from hsq.settings import setting

if TYPE_CHECKING:
    from hsq.producer.report import EnqueueReport
    from hsq.runstore import RunStore

RUN_SETTINGS = (
    "max_attempts",
    "chunk_size",
    "layer_ids",
    "model_id",
    "max_tokens",
    "store_dtype",
    "prenorm",
    "spool_budget",
    "consumers",
    "keep_after_commit",
)
"""RunConfig fields `hsq enqueue` takes as options (the rest: arguments or recorded later)."""


@dataclass(frozen=True)
class TokenizeFlags:
    output: Path = setting(
        path="file",
        aliases=("-o",),
        help="the tokens' JSONL; rows that cannot be used go to OUTPUT.rejects.jsonl",
    )
    no_progress: bool = setting(False, help="no progress bar")


@hsq_command("tokenize")
@click.argument("chats", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@settings_options(TokenizeSettings)
@settings_options(TokenizeFlags)
def tokenize(chats: Path, **values: Any) -> None:
    """Tokenize chat rows (ShareGPT / OpenAI messages) into `hsq enqueue`'s JSONL.

    input_ids and loss_mask (1 on assistant turns, end-of-turn token included) equal
    SpecForge 0.2.0's GeneralParser on the same tokenizer and template. Unusable rows go
    to OUTPUT.rejects.jsonl with a reason; `hsq enqueue OUTPUT` dead-letters them.

    \b
    Example:
      hsq tokenize chats.jsonl --tokenizer /models/qwen3-8b -o tokens.jsonl --max-length 4096
    """
    extras.require("chat", "hsq tokenize")
    from hsq.producer.tokenize import rejects_path, tokenize_file

    settings = take(TokenizeSettings, values)
    flags = take(TokenizeFlags, values)
    settings.validate()
    report, _ = tokenize_file(chats, flags.output, settings, progress=not flags.no_progress)
    for line in report.lines_out():
        click.echo(line)
    click.echo(f"wrote {flags.output} and {rejects_path(flags.output)}")


@dataclass(frozen=True)
class DatasetFlags:
    """How `hsq enqueue` and `hsq run` read DATASET."""

    strict: bool = setting(False, help="refuse the whole dataset if any line is bad")
    # Flag only: HSQ_TOKENIZER, set for `hsq tokenize`, must not turn the token rows of a
    # later `hsq enqueue` into chat rows to tokenize (and reject).
    tokenizer: Path | None = setting(
        None,
        path="dir",
        exists=True,
        flag_only=True,
        help="DATASET holds chat rows: tokenize them with this local HF tokenizer first",
    )
    tokens: Path | None = setting(
        None,
        path="file",
        flag_only=True,
        default_text="DATASET's name with .tokens.jsonl, next to it",
        help="with --tokenizer: where the tokenized JSONL goes (on storage every worker reads)",
    )


@dataclass(frozen=True)
class DatasetInput:
    """What dataset_options parsed: the flags, the RUN_SETTINGS given, and the tokenizer's
    settings when DATASET holds chat rows."""

    flags: DatasetFlags
    settings: dict[str, Any]
    chat: TokenizeSettings | None


def dataset_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options of a command that enqueues DATASET (enqueue, run): DatasetFlags, the
    run's RUN_SETTINGS and the chat rows' tokenize settings; take_dataset reads them."""
    fn = settings_options(TokenizeSettings, skip=("tokenizer",))(fn)
    fn = settings_options(RunConfig, only=RUN_SETTINGS)(fn)
    return settings_options(DatasetFlags)(fn)


def take_dataset(values: dict[str, Any], command: str) -> DatasetInput:
    """What dataset_options parsed for `command` (named in the message when --tokenizer
    needs an extra that is not installed)."""
    flags = take(DatasetFlags, values)
    settings = {name: values.pop(name) for name in RUN_SETTINGS}
    chat = None
    if flags.tokenizer is not None:
        extras.require("chat", f"{command} --tokenizer")
        chat = take(TokenizeSettings, values, tokenizer=str(flags.tokenizer))
    return DatasetInput(flags, settings, chat)


@dataclass(frozen=True)
class EnqueueFlags:
    out: Path = setting(path="dir", help="output root; files go to OUT/RUN/")
    no_progress: bool = setting(False, help="no progress bar")


@hsq_command("enqueue")
@click.argument("dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@settings_options(RunName)
@settings_options(EnqueueFlags)
@dataset_options
@settings_options(RedisFlags)
def enqueue(dataset: Path, **values: Any) -> None:
    """Validate DATASET (JSONL) and enqueue the samples that are neither done nor queued.

    \b
    Example:
      export HSQ_REDIS_URL=redis://:PASSWORD@head:6379/0   # or --redis-url-file FILE
      hsq enqueue data.jsonl --run kimi-v1 --out /shared/hs
      hsq enqueue chats.jsonl --tokenizer /models/qwen3-8b --run q3 --out /shared/hs
    Running it again enqueues nothing; after a partial run it enqueues only the rest.
    With --tokenizer, DATASET holds chat rows (see `hsq tokenize`); rows that cannot be
    used go to the dead letter. Without it, the rejects file `hsq tokenize` wrote next to
    DATASET (DATASET.rejects.jsonl), if any, is dead-lettered too.
    """
    from hsq.producer.report import log_report
    from hsq.runstore import RunStore

    run = take(RunName, values).run
    flags = take(EnqueueFlags, values)
    redis = take(RedisFlags, values)
    report = enqueue_dataset(
        RunStore(redis.client(), run),
        dataset,
        flags.out,
        take_dataset(values, "hsq enqueue"),
        progress=not flags.no_progress,
    )
    log_report(run, report)
    for line in report.lines_out():
        click.echo(line)
    for p in report.problems[:10]:
        click.echo(f"  invalid: {p}", err=True)


def enqueue_dataset(
    store: RunStore,
    dataset: Path,
    out: Path,
    data: DatasetInput,
    *,
    progress: bool,
) -> EnqueueReport:
    """What `hsq enqueue` does (also `hsq run`'s enqueue): with chat settings (--tokenizer),
    tokenize DATASET's chat rows first (its rejects dead-lettered), else take the rejects
    file `hsq tokenize` left next to it; then enqueue what is neither done nor queued. The
    RUN_SETTINGS not given on the command line are recorded as defaulted."""
    from hsq.producer.enqueue import enqueue_run
    from hsq.producer.tokenize import read_rejects, rejects_path, tokenize_file, tokens_path

    chat, tokens = data.chat, data.flags.tokens
    if chat is not None:
        chat.validate()
        target = tokens or tokens_path(dataset)
        tok_report, rejects = tokenize_file(dataset, target, chat, progress=progress)
        for line in tok_report.lines_out():
            click.echo(line)
        dataset = target
    else:
        rejects = read_rejects(rejects_path(dataset))
    cfg = RunConfig(
        run=store.run,
        dataset=str(dataset.resolve()),
        out=str(out.resolve()),
        **data.settings,
    )
    return enqueue_run(
        store,
        cfg,
        strict=data.flags.strict,
        progress=progress,
        rejected=[r.dead_letter() for r in rejects],
        defaulted=[name for name in RUN_SETTINGS if not given(name)],
    )
