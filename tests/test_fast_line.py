"""hsq.dataset.fastline.fast_line, the worker's read of its sample's line: None (parse_line decides)
or exactly parse_line's Sample, on crafted and randomly damaged lines."""

from __future__ import annotations

import random

import pytest

from hsq.dataset.fastline import fast_line
from hsq.dataset.jsonl import Sample, parse_line
from hsq.errors import DatasetError
from tests.support.lines import LINES, damaged

CRAFTED = [
    b'{"id": "a", "input_ids": [01, 2]}',
    b'{"id": "a", "input_ids": [1e3]}',
    b'{"id": "a", "input_ids": [-0]}',
    b'{"id": "a", "input_ids": [1.0]}',
    b'{"id": "a", "input_ids": [true]}',
    b'{"id": "a", "input_ids": []}',
    b'{"id": "a", "input_ids": [[1]]}',
    b'{"id": "a", "input_ids": [2147483648]}',
    b'{"id": "a", "input_ids": [1], "loss_mask": [2]}',
    b'{"id": "a", "input_ids": [1], "loss_mask": [true]}',
    b'{"id": "a", "input_ids": [1, 2], "loss_mask": [1]}',
    b'{"id": "a", "input_ids": [1], "loss_mask": null}',
    b'{"id": "a", "input_ids": [1], "extra": 1}',
    b'{"id": "a", "id": "b", "input_ids": [1]}',
    b'{"id": "../x", "input_ids": [1]}',
    b'{"id": true, "input_ids": [1]}',
    b'{"id": 18446744073709551616, "input_ids": [1]}',
    b'{"id": "a\\u0062", "input_ids": [1]}',
    b'{"input_ids": [1]}',
    b'{"id": "a",\t"input_ids":\r\n[1 , 2]}',
    b'["a", [1]]',
    b'{"id": "a", "input_ids": [1]} x',
    b'{"id": "\xc3\xa9", "input_ids": [1]}',
    b'{"id": "a", "input_ids": [1], "loss_mask": [1], "loss_mask": [0]}',
]


def same(line: bytes) -> bool:
    """fast_line agrees with parse_line on `line`; True if it took the line itself."""
    got = fast_line(line)
    if got is None:
        return False
    try:
        want: Sample = parse_line(line)
    except DatasetError as exc:
        raise AssertionError(f"fast_line took {line!r}; parse_line: {exc}") from None
    assert got == want and got.id_text == want.id_text, line
    assert type(got.input_ids) is list and all(type(t) is int for t in got.input_ids)
    return True


@pytest.mark.parametrize("line", [*CRAFTED, *(x.encode() for x in LINES)])
def test_fast_line_takes_only_what_parse_line_takes_as_it_does(line: bytes) -> None:
    same(line)


def test_fast_line_agrees_on_randomly_damaged_lines() -> None:
    rng = random.Random(3535)
    taken = sum(same(damaged(rng, i)) for i in range(20_000))
    assert taken > 1_000  # not vacuous: 1,597 of them survive their edits and go fast


def test_the_usual_line_goes_fast() -> None:
    assert same(b'{"id": "s1", "input_ids": [3, 1, 2], "loss_mask": [0, 1, 1]}')
    assert same(b'{"id": 7, "input_ids": [0]}')
