"""Training outputs: one safetensors file per sample, written durably, checked on demand.

- :mod:`hsq.outputs.format`: the layout, the metadata and the one reader (open_output).
- :mod:`hsq.outputs.transcode`: write_output, from a validated dump to the durable file.
- :mod:`hsq.outputs.publish`: the file takes its name without replacing another's.
- :mod:`hsq.outputs.check`: an output against its manifest entry (`hsq verify`).
- :mod:`hsq.outputs.manifest`: the manifest codec (ManifestEntry, the done entry's form).

Durable writes themselves are hsq.fsio's. The names below stay importable from
`hsq.outputs`, as the public API (`hsq.open_output`) and the docs of earlier versions
name them; hsq's own code imports from the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsq.extras import lazy_attributes

if TYPE_CHECKING:
    from hsq.outputs.check import check_output, checksum_matches, file_checksum
    from hsq.outputs.format import (
        OUTPUT_FORMAT,
        SUFFIX,
        OutputSample,
        open_output,
        output_relpath,
        read_header,
    )
    from hsq.outputs.manifest import ManifestEntry
    from hsq.outputs.transcode import write_output

# Loaded on first use (PEP 562), as hsq's own: `hsq status` and `hsq enqueue` read the
# manifest codec (manifest.py, format.py) without the writer's and the checker's modules.
_WHERE: dict[str, str] = {
    "check_output": "hsq.outputs.check",
    "checksum_matches": "hsq.outputs.check",
    "file_checksum": "hsq.outputs.check",
    "OUTPUT_FORMAT": "hsq.outputs.format",
    "SUFFIX": "hsq.outputs.format",
    "OutputSample": "hsq.outputs.format",
    "open_output": "hsq.outputs.format",
    "output_relpath": "hsq.outputs.format",
    "read_header": "hsq.outputs.format",
    "ManifestEntry": "hsq.outputs.manifest",
    "write_output": "hsq.outputs.transcode",
}

__all__ = [
    "OUTPUT_FORMAT",
    "SUFFIX",
    "ManifestEntry",
    "OutputSample",
    "check_output",
    "checksum_matches",
    "file_checksum",
    "open_output",
    "output_relpath",
    "read_header",
    "write_output",
]


if not TYPE_CHECKING:  # type checkers see the imports above; unknown names stay errors
    __getattr__ = lazy_attributes(__name__, _WHERE, globals())
