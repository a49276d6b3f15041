"""JSON from outside (dataset and chat lines, files a server wrote, Redis values, HTTP
bodies), parsed so that no input can crash the reader.

The C parser recurses once per nesting level: `[[[[...]]]]` a thousand levels deep raises
RecursionError, which no `except ValueError` catches, so one such line stopped `hsq enqueue`
with a traceback and `hsq tokenize` wrote nothing. `loads` turns it into a
ValueError (what every caller already handles as malformed JSON). `too_deep` bounds what a
parsed value may hold before code that recurses over it (a Jinja template, json.dumps) sees it.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""Nesting a chat row may have (a message's tool call arguments sit at depth 6)."""


class TooDeepError(ValueError):
    """JSON nested deeper than hsq reads."""


def loads(text: str | bytes | bytearray) -> Any:
    """json.loads; nesting too deep for the parser is a TooDeepError (a ValueError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise TooDeepError("JSON nested too deeply to parse") from None


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether lists and objects nest more than `limit` levels (iterative: never recurses)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if not isinstance(item, (dict, list)):
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
