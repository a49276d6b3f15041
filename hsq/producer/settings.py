"""`hsq tokenize`'s settings (hsq.producer.tokenize), in a module of their own: the CLI
builds its flags from them, and `hsq enqueue --help` should not import the tokenizer's
process pool and logging to do it."""

from __future__ import annotations

from dataclasses import dataclass, field

from hsq.producer.chat import ChatOptions
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
        help="Jinja chat template file",
    )
    assistant_header: str | None = setting(
        None, default_text="read off the template", help="text opening an assistant turn"
    )
    end_of_turn: str | None = setting(
        None, default_text="read off the template", help="text closing an assistant turn"
    )
    options: ChatOptions = field(default_factory=ChatOptions)
    jobs: int | None = setting(None, default_text="every core", help="processes")

    def validate(self) -> None:
        self.options.validate()
