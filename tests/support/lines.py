"""Dataset lines the fast decoder (hsq/dataset/fastline.py) and the judging parser
(hsq/dataset/jsonl.py parse_line) must read alike: a fixed list of the shapes and mistakes
that tell JSON readers apart, and seeded random damage to valid lines."""

from __future__ import annotations

import json
import random
from typing import Any

LINES = [
    '{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}',
    '{"id":"b","input_ids":[1,2,3],"loss_mask":[0,1,1]}',
    '{"id": 7, "input_ids": [0], "loss_mask": [1]}',
    '{"id": "c", "input_ids": [5, 6]}',
    '{"id": "d", "input_ids": [2147483647, 1], "loss_mask": [1, 1]}',
    '{"id": "e", "input_ids": [2147483648], "loss_mask": [1]}',
    '{"id": "f", "input_ids": [01, 2], "loss_mask": [1, 1]}',
    '{"id": "g", "input_ids": [1, 2, ], "loss_mask": [1, 1]}',
    '{"id": "h", "input_ids": [1,, 2], "loss_mask": [1, 1]}',
    '{"id": "i", "input_ids": [1, 2], "loss_mask": [01, 1]}',
    '{"id": "j", "input_ids": [1, 2], "loss_mask": [1, 11]}',
    '{"id": "k", "input_ids": [1, 2], "loss_mask": [1]}',
    '{"id": "l", "input_ids": [-1, 2], "loss_mask": [1, 1]}',
    '{"id": "m", "input_ids": [1.0, 2], "loss_mask": [1, 1]}',
    '{"id": "n", "input_ids": [], "loss_mask": []}',
    '{"id": "o", "input_ids": [true], "loss_mask": [1]}',
    '{"id": "p", "input_ids": [1], "loss_mask": [true]}',
    '{"id": "../x", "input_ids": [1], "loss_mask": [1]}',
    '{"id": "a", "input_ids": [9], "loss_mask": [1]}',
    '{"id": "q", "input_ids": [1], "loss_mask": [1], "extra": 1}',
    '{"id": "r", "id": "s", "input_ids": [1], "loss_mask": [1]}',
    '{"id": "t\\u0041", "input_ids": [1], "loss_mask": [1]}',
    '{"id": "u", "input_ids": [1 2], "loss_mask": [1]}',
    '{"id": "v", "input_ids": [1, 2], "loss_mask": [1,  1]}',
    '{"id": "w", "input_ids": [1,2, 3], "loss_mask": [1, 1, 1]}',
    '{"id": "x", "input_ids": [1, 2], "loss_mask": null}',
    '{"id": 007, "input_ids": [1], "loss_mask": [1]}',
    '{"id": "y", "input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [1, 1, 1, 1, 1, 1]}',
    '  {"id": "z", "input_ids": [1], "loss_mask": [1]}',
    "",
    "not json",
    '{"id": "aa", "input_ids": [9999999999], "loss_mask": [1]}',
    '{"id": "ab", "input_ids": [1], "loss_mask": [1]}\r',
    # Lines msgspec (the fast path's decoder) could read otherwise than json.loads:
    '{"id": "ac", "input_ids": [1], "loss_mask": [1], "input_ids": [1, 2]}',  # last key wins
    '{"id": "ad", "input_ids": [1], "id": "ae"}',
    '{"id": "af", "input_ids": [1], "loss_mask": null, "loss_mask": [1]}',
    '{"id": "ag", "input_ids": [1, 2], "input_ids": []}',
    '{"\\u0069d": "ah", "input_\\u0069ds": [1]}',  # escapes in keys
    '{"id": "ai", "input_ids": [-0], "loss_mask": [-0]}',
    '{"id": 123456789012345678901234567890, "input_ids": [1]}',
    '{"id": ' + "9" * 128 + ', "input_ids": [1]}',
    '{"id": ' + "9" * 129 + ', "input_ids": [1]}',
    '{"id": ' + "9" * 5000 + ', "input_ids": [1]}',  # past int's str() limit
    '{"id": -5, "input_ids": [1]}',
    '{"id": 0, "input_ids": [1]}',
    '{"id": "aj", "input_ids": [1], "loss_mask": [1.0]}',
    '{"id": "ak", "input_ids": [NaN]}',
    '{"id": Infinity, "input_ids": [1]}',
    '{"id": "al", "input_ids": [1e0]}',
    '{"id": "\\ud800", "input_ids": [1]}',
    '{"id": "am\\u0000", "input_ids": [1]}',
    '{"id": "an\\n", "input_ids": [1]}',
    '\ufeff{"id": "ao", "input_ids": [1]}',
    '{"id": "ap", "input_ids": [[1]]}',
    '{"id": "aq", "input_ids": {"0": 1}}',
    '{"id": "ar", "input_ids": [1], "loss_mask": [1], }',
    '{"id": "as",\t"input_ids":\t[1 ,2]\t, "loss_mask" : [0,0] }',
    '{"id": "at", "input_ids": "1"}',
    '{"id": ["au"], "input_ids": [1]}',
    '{"id": "av", "input_ids": [1], "loss_mask": [2]}',
    '{"id": "aw", "input_ids": [1], "loss_mask": []}',
    '{"id": "ax", "input_ids": [1], "loss_mask": true}',
    '{"id": "ay", "input_ids": [1]} {"id": "az"}',
    '[{"id": "ba", "input_ids": [1]}]',
    "null",
    '{"id": "\u00e9", "input_ids": [1]}',
    '{"id": "bb", "input_ids": [1, 2, 3, 4, 5]}',
    '{"id": "bc", "input_ids": [1], "loss_mask": [0, 1]}',
    '{"id": "bd", "input_ids": [1], "extra": "x"}',
    '{"id": 7, "input_ids": [1]}',
    '{"id": "7", "input_ids": [1]}',
    '{"input_ids": [1]}',
    '{"id": "be"}',
    '{"id": "", "input_ids": [1]}',
    '{"id": "bf", "input_ids": [4294967296]}',
    '{"id": "bg", "input_ids": [' + "1" * 30 + "]}",
    # Numbers, whitespace, nesting and mask values at the edges of what the fast path takes
    # (a decoder reading the lists' text instead of their ints was tried against these):
    '{"id": "bh", "input_ids": [1e3], "loss_mask": [1]}',
    '{"id": "bi", "input_ids": [1E3]}',
    '{"id": "bj", "input_ids": [1.5]}',
    '{"id": "bk", "input_ids": [00]}',
    '{"id": "bl", "input_ids": [-0, 1], "loss_mask": [1, 1]}',
    '{"id": "bm", "input_ids": [+1]}',
    '{"id": "bn", "input_ids": [ ]}',
    '{"id": "bo", "input_ids": [ 0 ], "loss_mask": [ 0 ]}',
    '{"id": "bp", "input_ids": [[]]}',
    '{"id": "bq", "input_ids": [1, [2]], "loss_mask": [1, 1]}',
    '{"id": "br", "input_ids": ["1"]}',
    '{"id": "bs", "input_ids": ["]"]}',
    '{"id": "bt", "input_ids": [null]}',
    '{"id": "bu", "input_ids": null}',
    '{"id": "bv", "input_ids": 5}',
    '{"id": "bw", "input_ids": [1,\t2,\r3]}',
    '{"id": "bx", "input_ids": [1,\x0b2]}',
    '{"id": "by", "input_ids": [1,\x0c2]}',
    '{"id": "bz", "input_ids": [1,\u00a02]}',
    '{"id": "ca", "input_ids": [999999999, 1000000000], "loss_mask": [1, 0]}',
    '{"id": "cb", "input_ids": [1, 2147483648], "loss_mask": [1, 0]}',
    '{"id": "cc", "input_ids": [0000000001]}',
    '{"id": "cd", "input_ids": [1, 2], "loss_mask": [10, 1]}',
    '{"id": "ce", "input_ids": [1, 2], "loss_mask": [00, 1]}',
    '{"id": "cf", "input_ids": [1, 2], "loss_mask": [0, 1, ]}',
    '{"id": "cg", "input_ids": [1], "loss_mask": [ ]}',
    '{"id": "ch", "input_ids": [1], "loss_mask": "1"}',
    '{"id": "ci", "input_ids": [1], "loss_mask": {}}',
    '{"id": "cj", "input_ids": [1], "loss_mask": [-1]}',
    '{"id": "ck", "input_ids": [1], "loss_mask": [1e0]}',
    '{"id": "cl", "input_ids": [1], "loss_mask": [false]}',
    '{"id": "cm", "input_ids": [1], "loss_mask": [[1]]}',
    '{"id": "cn", "input_ids": [1, 2], "loss_mask": [1 ,\t0 ]}',
    '{"id": "co", "input_ids": [7], "loss_mask": [9]}',
    '{"id": "cp", "input_ids": [1], "loss_mask": [1], "loss_mask": [5]}',
    '{"id": "cq", "input_ids": [2147483647, 2147483647], "loss_mask": [1, 1]}',
]


BYTE_EDITS = [*b'0123456789,-+.eE[]{}:"\\ut n', 0, 9, 0xFF, 0xC3, 0xA9, 0xED, 0xEF]


def damaged(rng: random.Random, i: int) -> bytes:
    """A valid line of some shape, then up to three random byte edits (msgspec's view of
    JSON against json.loads's: escapes, numbers, UTF-8, structure)."""
    n = rng.randint(1, 6)
    row: dict[str, Any] = {"id": rng.choice([f"r{i}", i, f"r{i}\u00e9"])}
    row["input_ids"] = [rng.choice([0, 1, 255, 2147483647, 2147483648]) for _ in range(n)]
    if rng.random() < 0.8:
        row["loss_mask"] = [rng.randint(0, 1) for _ in range(n)]
    if rng.random() < 0.1:
        row["x"] = "y"
    sep = rng.choice([(", ", ": "), (",", ":")])
    line = bytearray(json.dumps(row, separators=sep, ensure_ascii=rng.random() < 0.5).encode())
    for _ in range(rng.randint(0, 3)):
        pos = rng.randrange(len(line))
        line[pos : pos + rng.randint(0, 1)] = bytes([rng.choice(BYTE_EDITS)])
    return bytes(line).replace(b"\n", b"")
