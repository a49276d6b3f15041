"""The optional dependencies, by the role that needs them (pyproject's extras).

The base install serves the roles that run no model: the queue commands, a worker of a
bf16 run copying server-made dumps (numpy, xxhash), `hsq verify` (--deep too), `hsq
recover`, the exporter. What runs a model or writes torch files needs an extra; a command
asks for its extra before it does anything, and a missing one is one line naming the
`pip install` to run (exit 2), never a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util

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
