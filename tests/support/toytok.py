"""A small ChatML tokenizer built offline, for tests, the walkthrough and benchmarks.

A byte-level BPE trained with the `tokenizers` library on a built-in corpus: any text
encodes, nothing is downloaded, and its ids (< VOCAB_SIZE = 1024) fit in the reference
server's tiny model (vocab 32000) as they are, with no mapping. The chat template is
ChatML as Qwen uses it (`<|im_start|>role\\n...<|im_end|>\\n`), with tools, tool calls and
`reasoning_content`; like many real templates it refuses a system message after the first.

    python -m tests.support.toytok DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB_SIZE = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message may only come first') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n' }}{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\n<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a Python function that adds two numbers: def add(a, b): return a + b",
    "Hidden states of a transformer train a speculative decoding drafter.",
    "user assistant system tool tool_call think reasoning answer question",
    "Can you help me with my homework? Sure, what is the problem?",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" \n\t",
]


def build_chatml_tokenizer(out: Path) -> Path:
    """Train the tokenizer and save it with its chat template as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.toytok DIR")
    print(build_chatml_tokenizer(Path(sys.argv[1])))
