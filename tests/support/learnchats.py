"""Chat rows a drafter can learn from, for the trainer tests (tests/test_specforge_train.py,
tests/test_stream_train.py): a question with a sum and a few words, an answer with the sum
and more words, from a small word list, seeded. `start` numbers the rows, so a held-out set
is `chats(8, start=64)`: other rows, the same distribution."""

from __future__ import annotations

import random
from typing import Any

WORDS = [
    *("apple", "river", "stone", "cloud", "green", "quick", "seven", "over"),
    *("under", "light", "music", "table", "window", "garden", "paper"),
]


def chats(n: int, start: int = 0) -> list[dict[str, Any]]:
    r = random.Random(0)
    rows = []
    for i in range(start + n):
        a, b = r.randint(1, 50), r.randint(1, 50)
        q = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 12)))
        ans = " ".join(r.choice(WORDS) for _ in range(r.randint(8, 30)))
        if i < start:
            continue
        rows.append(
            {
                "id": f"c{i}",
                "conversations": [
                    {"from": "human", "value": f"Q{i}: what is {a} + {b}? {q}"},
                    {"from": "gpt", "value": f"{a} + {b} = {a + b}. {ans}"},
                ],
            }
        )
    return rows
