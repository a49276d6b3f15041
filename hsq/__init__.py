"""hsq: hidden-state queue. Extract an LLM's hidden states at scale for EAGLE-3 drafters.

The public API is `__all__`: the dump protocol (what a server writes and a worker reads),
the exception tree, and the readers of a run's outputs. Names load on first use (PEP 562),
so `import hsq` stays cheap: operator commands start without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsq.extras import lazy_attributes

__version__ = "0.2.0"

if TYPE_CHECKING:
    from hsq.data import (
        HiddenStateDataset,
        collate,
    )
    from hsq.dataset.jsonl import Sample
    from hsq.dump.find import wait_for_dump
    from hsq.dump.format import DumpMeta, fingerprint
    from hsq.dump.read import Dump, Expected, read_dump
    from hsq.dump.ready import ReadyMarker, read_ready, write_ready
    from hsq.dump.write import write_dump
    from hsq.errors import (
        CachedTokensError,
        ConfigError,
        CorruptDumpError,
        DatasetError,
        DumpError,
        HookInactiveError,
        HsqError,
        IncompleteDumpError,
        MetaMismatchError,
        MultipleDumpsError,
        NoDumpError,
        NonFiniteDumpError,
        OutputError,
        RunChangedError,
        ServerError,
        ServerRejectedError,
        ServerUnavailableError,
        StaleDumpError,
        StoreError,
        StoreUnavailableError,
        WrongLengthError,
    )
    from hsq.outputs.format import OutputSample, open_output, output_relpath
    from hsq.outputs.manifest import ManifestEntry
    from hsq.quant import (
        logical_tensors,
    )
    from hsq.runconfig import (
        RunConfig,
    )

# public name -> the module that defines it
_WHERE: dict[str, str] = {
    "DumpMeta": "hsq.dump.format",
    "Expected": "hsq.dump.read",
    "Dump": "hsq.dump.read",
    "fingerprint": "hsq.dump.format",
    "write_dump": "hsq.dump.write",
    "read_dump": "hsq.dump.read",
    "wait_for_dump": "hsq.dump.find",
    "ReadyMarker": "hsq.dump.ready",
    "write_ready": "hsq.dump.ready",
    "read_ready": "hsq.dump.ready",
    "HsqError": "hsq.errors",
    "ConfigError": "hsq.errors",
    "DatasetError": "hsq.errors",
    "StoreError": "hsq.errors",
    "StoreUnavailableError": "hsq.errors",
    "RunChangedError": "hsq.errors",
    "OutputError": "hsq.errors",
    "DumpError": "hsq.errors",
    "NoDumpError": "hsq.errors",
    "MultipleDumpsError": "hsq.errors",
    "IncompleteDumpError": "hsq.errors",
    "StaleDumpError": "hsq.errors",
    "WrongLengthError": "hsq.errors",
    "CachedTokensError": "hsq.errors",
    "MetaMismatchError": "hsq.errors",
    "CorruptDumpError": "hsq.errors",
    "NonFiniteDumpError": "hsq.errors",
    "ServerError": "hsq.errors",
    "ServerUnavailableError": "hsq.errors",
    "ServerRejectedError": "hsq.errors",
    "HookInactiveError": "hsq.errors",
    "ManifestEntry": "hsq.outputs.manifest",
    "OutputSample": "hsq.outputs.format",
    "open_output": "hsq.outputs.format",
    "output_relpath": "hsq.outputs.format",
    "HiddenStateDataset": "hsq.data",
    "collate": "hsq.data",
    "logical_tensors": "hsq.quant",
    "Sample": "hsq.dataset.jsonl",
    "RunConfig": "hsq.runconfig",
}

__all__ = [
    "CachedTokensError",
    "ConfigError",
    "CorruptDumpError",
    "DatasetError",
    "Dump",
    "DumpError",
    "DumpMeta",
    "Expected",
    "HiddenStateDataset",
    "HookInactiveError",
    "HsqError",
    "IncompleteDumpError",
    "ManifestEntry",
    "MetaMismatchError",
    "MultipleDumpsError",
    "NoDumpError",
    "NonFiniteDumpError",
    "OutputError",
    "OutputSample",
    "ReadyMarker",
    "RunChangedError",
    "RunConfig",
    "Sample",
    "ServerError",
    "ServerRejectedError",
    "ServerUnavailableError",
    "StaleDumpError",
    "StoreError",
    "StoreUnavailableError",
    "WrongLengthError",
    "__version__",
    "collate",
    "fingerprint",
    "logical_tensors",
    "open_output",
    "output_relpath",
    "read_dump",
    "read_ready",
    "wait_for_dump",
    "write_dump",
    "write_ready",
]


if not TYPE_CHECKING:  # type checkers see the imports above; unknown names stay errors
    __getattr__ = lazy_attributes(__name__, _WHERE, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
