"""Tokenizing chat rows: `hsq tokenize`'s rate with one process and with every core.

Synthetic ShareGPT rows (1-4 user/assistant exchanges of 20-200 words each), the offline
ChatML tokenizer from tests.support.toytok; the same file through tokenize_file with --jobs 1 and
with --jobs = cores, checking that both outputs are byte-identical.

    python -m bench.chat_tokenize --rows 100000 --single-rows 20000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

from hsq.producer.settings import TokenizeSettings
from hsq.producer.tokenize import tokenize_file
from tests.support.toytok import build_chatml_tokenizer

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "hot",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
]


def write_chats(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "."

    with open(path, "w") as f:
        for i in range(rows):
            conv = []
            for _ in range(rng.randint(1, 4)):
                conv += [{"from": "human", "value": text()}, {"from": "gpt", "value": text()}]
            f.write(json.dumps({"id": f"r{i}", "conversations": conv}) + "\n")


def run(src: Path, dst: Path, tok: Path, jobs: int) -> tuple[float, int, int]:
    settings = TokenizeSettings(tokenizer=str(tok), jobs=jobs)
    report, _ = tokenize_file(src, dst, settings, progress=True)
    return report.seconds, report.written, report.tokens


def head(src: Path, dst: Path, n: int) -> None:
    with open(src) as f, open(dst, "w") as out:
        for _, line in zip(range(n), f, strict=False):
            out.write(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--single-rows", type=int, default=20_000, help="rows for the 1-job run")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = build_chatml_tokenizer(tmp / "tok")
        src = tmp / "chats.jsonl"
        write_chats(src, args.rows)
        mb = src.stat().st_size / 2**20
        secs, rows, tokens = run(src, tmp / "all.jsonl", tok, cores)
        print(
            f"jobs={cores}: {rows} rows ({mb:.0f} MB, {tokens} tokens) in {secs:.1f} s: "
            f"{rows / secs:.0f} rows/s, {tokens / secs / 1e3:.0f}k tokens/s"
        )
        small = tmp / "small.jsonl"
        head(src, small, args.single_rows)
        s1, r1, _ = run(small, tmp / "one.jsonl", tok, 1)
        sn, rn, _ = run(small, tmp / "many.jsonl", tok, cores)
        same = (tmp / "one.jsonl").read_bytes() == (tmp / "many.jsonl").read_bytes()
        print(
            f"{r1} rows: jobs=1 {s1:.1f} s ({r1 / s1:.0f} rows/s), jobs={cores} {sn:.1f} s "
            f"({rn / sn:.0f} rows/s): {s1 / sn:.2f}x; outputs identical: {same}"
        )


if __name__ == "__main__":
    main()
