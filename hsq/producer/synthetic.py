"""Synthetic JSONL datasets of varied lengths, for the demo, the tests and the benchmarks."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def synthetic_lengths(n: int, seed: int, min_len: int, max_len: int) -> list[int]:
    rng = random.Random(seed)
    lo, hi = math.log(min_len), math.log(max_len)
    return [round(math.exp(rng.uniform(lo, hi))) for _ in range(n)]  # log-uniform


def write_synthetic(
    path: Path,
    n: int,
    *,
    seed: int = 0,
    min_len: int = 16,
    max_len: int = 1024,
    vocab: int = 32000,
    prefix: str = "s",
) -> int:
    """Write n samples; returns the total token count."""
    rng = random.Random(seed + 1)
    total = 0
    with open(path, "w") as f:
        for i, length in enumerate(synthetic_lengths(n, seed, min_len, max_len)):
            ids = [rng.randrange(vocab) for _ in range(length)]
            # Loss on the second half, like an assistant turn after a prompt.
            mask = [0] * (length // 2) + [1] * (length - length // 2)
            f.write(json.dumps({"id": f"{prefix}{i:06d}", "input_ids": ids, "loss_mask": mask}))
            f.write("\n")
            total += length
    return total
