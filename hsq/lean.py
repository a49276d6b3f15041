"""Importing less at start: libraries without the optional extras hsq never uses, and a
package's names resolved on first use (one place for each trick).

structlog (structlog.dev, structlog.tracebacks: pretty tracebacks) and httpx (httpx._main:
its own command line, with click, pygments and rich) import rich or pygments when they are
installed, and treat them as optional: where the import fails they do without. hsq calls
neither feature (its log chain formats exceptions itself), so it imports both libraries
with those modules hidden: some 60 ms of CPU for structlog and 70 ms for httpx at every
start of a worker or a command.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

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


def lazy_attributes(
    package: str, where: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module-level `__getattr__` (PEP 562) for `package`: a name of `where` is imported
    from its module on first use and kept in `namespace` (the package's globals), so a
    package can name its public API without importing all of it at start."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # resolved once
        return value

    return __getattr__
