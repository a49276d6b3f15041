"""hsq's public API: `hsq.__all__` is pinned here, every name resolves, and `import hsq`
stays cheap (operator commands must not pay for torch or Redis)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hsq

PUBLIC = {
    "__version__",
    # the dump protocol
    "Dump",
    "DumpMeta",
    "Expected",
    "ReadyMarker",
    "fingerprint",
    "read_dump",
    "read_ready",
    "wait_for_dump",
    "write_dump",
    "write_ready",
    # the exception tree
    "HsqError",
    "ConfigError",
    "HookInactiveError",
    "DatasetError",
    "StoreError",
    "StoreUnavailableError",
    "RunChangedError",
    "OutputError",
    "DumpError",
    "NoDumpError",
    "MultipleDumpsError",
    "IncompleteDumpError",
    "StaleDumpError",
    "WrongLengthError",
    "CachedTokensError",
    "MetaMismatchError",
    "CorruptDumpError",
    "NonFiniteDumpError",
    "ServerError",
    "ServerUnavailableError",
    "ServerRejectedError",
    # datasets, runs and outputs
    "Sample",
    "RunConfig",
    "ManifestEntry",
    "OutputSample",
    "open_output",
    "output_relpath",
    "logical_tensors",
    "HiddenStateDataset",
    "collate",
}


def test_the_public_api_is_pinned() -> None:
    assert set(hsq.__all__) == PUBLIC
    assert len(hsq.__all__) == len(PUBLIC)  # no name twice


@pytest.mark.parametrize("name", sorted(PUBLIC - {"__version__"}))
def test_every_public_name_resolves_to_its_defining_module(name: str) -> None:
    value = getattr(hsq, name)
    assert value.__module__.startswith("hsq."), (name, value.__module__)
    assert name in dir(hsq)


def test_errors_share_one_root() -> None:
    errors = [getattr(hsq, n) for n in PUBLIC if n.endswith("Error")]
    assert all(issubclass(e, hsq.HsqError) for e in errors)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = hsq.no_such_thing  # type: ignore[attr-defined]


def test_import_hsq_loads_neither_torch_nor_redis() -> None:
    probe = "import sys, hsq; print(sorted({'torch', 'redis', 'rq'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
