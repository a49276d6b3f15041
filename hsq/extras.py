"""The optional dependencies, by the role that needs them (pyproject's extras).

The base install serves the roles that run no model: the queue commands, a worker of a
bf16 run copying server-made dumps (numpy, xxhash), `hsq verify` (--deep too), `hsq
recover`, the exporter. What runs a model or writes torch files needs an extra; a command
asks for its extra before it does anything, and a missing one is one line naming the
`pip install` to run (exit 2), never a traceback from deep inside an import.

The other half of the same concern, importing less at start: libraries without the
optional extras hsq never uses, and a package's names resolved on first use.

structlog (structlog.dev, structlog.tracebacks: pretty tracebacks) and httpx (httpx._main:
its own command line, with click, pygments and rich) import rich or pygments when they are
installed, and treat them as optional: where the import fails they do without. hsq calls
neither feature (its log chain formats exceptions itself), so it imports both libraries
with those modules hidden: some 60 ms of CPU for structlog and 70 ms for httpx at every
start of a worker or a command.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from hsq.errors import MissingExtraError

DIST = "hidden-state-queue"
"""The distribution name pip installs (the import name is hsq)."""

EXTRAS: dict[str, tuple[str, ...]] = {
    # the reference server (a transformer on CPU or CUDA), `hsq demo`, `hsq run` with it,
    # `hsq audit` (it compares tensors), and what `chat` brings
    "reference": ("torch", "safetensors", "transformers", "tokenizers"),
    # chat tokenization without a model: `hsq tokenize`, `hsq enqueue --tokenizer`
    "chat": ("transformers", "tokenizers"),
    # `hsq export --format specforge` (torch.save), --target-model (safetensors)
    "export": ("torch", "safetensors"),
    # `hsq export --format speculators` (an Arrow dataset)
    "speculators": ("torch", "safetensors", "datasets"),
    # a worker of an fp8-e4m3 run: it quantizes (or checks a server's fp8) with torch
    "fp8": ("torch",),
}
"""extra -> the import names it brings (keep in step with pyproject.toml)."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (found, not imported: cheap)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Refuse `what` (e.g. "hsq serve-reference") when `extra` is not installed."""
    absent = missing(extra)
    if absent:
        raise MissingExtraError(
            f"{what} needs {', '.join(absent)}, not installed here: pip install '{DIST}[{extra}]'"
        )


def extra_error(exc: ModuleNotFoundError) -> MissingExtraError | None:
    """For an import of an optional dependency that failed anyway (a path no command
    checked first): the same one line, naming every extra that brings the module."""
    top = (exc.name or "").split(".")[0]
    extras = [e for e, mods in EXTRAS.items() if top in mods]
    if not extras:
        return None
    options = " or ".join(f"'{DIST}[{e}]'" for e in extras)
    return MissingExtraError(f"{top} is not installed here: pip install {options}")


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
