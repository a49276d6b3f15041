"""The producer's settings, in a module of their own: the CLI builds its flags from them,
and `hsq enqueue --help` should not import the tokenizer's process pool and logging to do
it. `hsq tokenize`'s (hsq.producer.tokenize), and what a command that enqueues a dataset
(`hsq enqueue`, `hsq run`: hsq.producer.enqueue.enqueue_dataset) was given."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsq.producer.chat import CHAT_SECTION, ChatOptions
from hsq.runconfig import RUN_SECTION
from hsq.settings import setting


@dataclass(frozen=True)
class TokenizeSettings:
    """Each field a flag of `hsq tokenize` and `hsq enqueue --tokenizer` (hsq.settings);
    `options` brings ChatOptions' flags."""

    tokenizer: str = setting(
        path="dir",
        exists=True,
        help="local Hugging Face tokenizer directory (nothing is downloaded)",
    )
    template: str | None = setting(
        None,
        path="file",
        exists=True,
        default_text="the tokenizer's own",
        section=CHAT_SECTION,
        help="Jinja chat template file",
    )
    assistant_header: str | None = setting(
        None,
        default_text="read off the template",
        section=CHAT_SECTION,
        help="text opening an assistant turn",
    )
    end_of_turn: str | None = setting(
        None,
        default_text="read off the template",
        section=CHAT_SECTION,
        help="text closing an assistant turn",
    )
    options: ChatOptions = field(default_factory=ChatOptions)
    jobs: int | None = setting(
        None, default_text="every core", section=CHAT_SECTION, help="processes tokenizing rows"
    )

    def validate(self) -> None:
        self.options.validate()


RUN_SETTINGS = (
    "max_attempts",
    "chunk_size",
    "layer_ids",
    "model_id",
    "hidden_size",
    "max_tokens",
    "store_dtype",
    "prenorm",
    "spool_budget",
    "consumers",
    "keep_after_commit",
)
"""RunConfig fields a command that enqueues takes as options (the rest: arguments, or
recorded later)."""


@dataclass(frozen=True)
class DatasetFlags:
    """How `hsq enqueue` and `hsq run` read DATASET."""

    strict: bool = setting(
        False, section=RUN_SECTION, help="refuse the whole dataset if any line is bad"
    )
    # Flag only: HSQ_TOKENIZER, set for `hsq tokenize`, must not turn the token rows of a
    # later `hsq enqueue` into chat rows to tokenize (and reject).
    tokenizer: Path | None = setting(
        None,
        path="dir",
        exists=True,
        flag_only=True,
        help="tokenize DATASET's chat rows with this tokenizer",
    )
    tokens: Path | None = setting(
        None,
        path="file",
        flag_only=True,
        default_text="DATASET's name with .tokens.jsonl, next to it",
        section=CHAT_SECTION,
        help="with --tokenizer: where the tokenized JSONL goes (on storage every worker reads)",
    )


@dataclass(frozen=True)
class DatasetInput:
    """What a command that enqueues DATASET was given: its flags, the RUN_SETTINGS values,
    which of those the user left at their defaults (a later enqueue of the run follows what
    the run recorded for them: hsq.producer.enqueue.FOLLOW_RUN), and the tokenizer's
    settings when DATASET holds chat rows."""

    flags: DatasetFlags
    settings: Mapping[str, Any]
    defaulted: frozenset[str]
    chat: TokenizeSettings | None = None
