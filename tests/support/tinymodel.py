"""A tiny seeded Llama checkpoint with an LM head, the target model of the CPU training
walkthrough and of tests/test_training.py.

The decoder has the reference server's `tiny` shape with the toy tokenizer's vocabulary
(tests.support.toytok, 1024 ids), so `hsq serve-reference --model DIR` extracts from it and
`hsq export --target-model DIR` reads its embedding and LM head. The LM head is drawn with
std 0.5 instead of the usual 0.02 init: an untrained head makes every next-token
distribution nearly uniform, which leaves a drafter nothing to learn; this one is peaked
(about 2 nats per token) like a trained model's.

    python -m tests.support.tinymodel DIR [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hsq.engines.reference.shapes import TINY_CONFIG
from tests.support.toytok import VOCAB_SIZE

HEAD_STD = 0.5


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_CONFIG, "vocab_size": VOCAB_SIZE})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, HEAD_STD)
    model.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(build(args.out, args.seed))


if __name__ == "__main__":
    main()
