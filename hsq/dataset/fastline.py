"""A dataset line of the usual shape, decoded and range-checked by msgspec in C: the
producer's scan (hsq/producer/fastscan.py) and the worker's read of its sample
(`fast_line`: parse_line's Sample, 157 against 31 us for 290 tokens) take it;
anything it refuses is hsq.dataset.jsonl.parse_line's to judge. A module of its own so that
hsq.dataset.jsonl, which `hsq ... --help` imports, loads no msgspec."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from hsq.dataset.jsonl import MAX_TOKEN_ID, Sample, check_sample_id, id_text
from hsq.errors import DatasetError


class Line(msgspec.Struct, forbid_unknown_fields=True):
    """The usual line's one shape. An unknown key (whose values msgspec would skip
    unchecked) or anything else msgspec refuses is parse_line's."""

    id: str | int
    input_ids: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]], Meta(min_length=1)]
    loss_mask: list[Annotated[int, Meta(ge=0, le=1)]] | None = None


decode_line = msgspec.json.Decoder(Line).decode
"""bytes -> Line; msgspec.MsgspecError for anything else."""


def fast_line(line: bytes) -> Sample | None:
    """What msgspec accepts here json.loads accepts the same way (the last of a repeated
    key, escapes, UTF-8; no float or bool as an int); tests/test_fast_line.py fuzzes it."""
    try:
        row = decode_line(line)
    except msgspec.MsgspecError:
        return None
    if row.loss_mask is not None and len(row.loss_mask) != len(row.input_ids):
        return None
    try:
        sid = check_sample_id(row.id)
    except DatasetError:
        return None
    return Sample(id=sid, input_ids=row.input_ids, loss_mask=row.loss_mask, id_text=id_text(row.id))
