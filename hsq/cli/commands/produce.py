"""`hsq tokenize` and `hsq enqueue`: chat rows to tokens, a dataset to a run's queue."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hsq import extras
from hsq.cli.command import hsq_argument, hsq_command
from hsq.cli.dataset import dataset_options, take_dataset
from hsq.cli.flags import RedisFlags, RunName
from hsq.cli.options import settings_options, take
from hsq.producer.chat import CHAT_SECTION
from hsq.producer.settings import TokenizeSettings
from hsq.settings import setting


@dataclass(frozen=True)
class TokenizeFlags:
    output: Path = setting(
        path="file",
        aliases=("-o",),
        help="the tokens' JSONL; rows that cannot be used go to OUTPUT.rejects.jsonl",
    )
    no_progress: bool = setting(False, help="no progress bar")


@hsq_command("tokenize", open_sections=(CHAT_SECTION,))
@hsq_argument(
    "chats",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL of chat rows: ShareGPT `conversations` or OpenAI `messages`",
)
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
class EnqueueFlags:
    out: Path = setting(path="dir", help="output root; files go to OUT/RUN/")
    no_progress: bool = setting(False, help="no progress bar")


@hsq_command("enqueue")
@hsq_argument(
    "dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL: token rows (input_ids, loss_mask), or chat rows with --tokenizer",
)
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
    from hsq.producer.enqueue import enqueue_dataset
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
        echo=click.echo,
    )
    log_report(run, report)
    for line in report.lines_out():
        click.echo(line)
    for p in report.problems[:10]:
        click.echo(f"  invalid: {p}", err=True)
