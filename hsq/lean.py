"""Importing libraries without the optional extras hsq never uses (one place for the trick).

structlog (structlog.dev, structlog.tracebacks: pretty tracebacks) and httpx (httpx._main:
its own command line, with click, pygments and rich) import rich or pygments when they are
installed, and treat them as optional: where the import fails they do without. hsq calls
neither feature (its log chain formats exceptions itself), so it imports both libraries
with those modules hidden: some 60 ms of CPU for structlog and 70 ms for httpx at every
start of a worker or a command.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

PRETTY = ("rich", "pygments")
"""The pretty-printers structlog and httpx would import and hsq never uses."""


@contextmanager
def hidden(*names: str) -> Iterator[None]:
    """Within the block, `import NAME` (and its submodules) fails with ImportError for each
    of `names`, as where it is not installed: a None in sys.modules stops the import. A
    module loaded already stays as it is; afterwards, each imports normally again."""
    hide = [n for n in names if n not in sys.modules]
    for n in hide:
        sys.modules[n] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for n in hide:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]
