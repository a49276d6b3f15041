"""A safetensors file's tensors as numpy arrays over a private mapping, without torch.

The readers that need every value but no model (`hsq verify --deep`, `hsq recover`) run in
the base install, which has numpy and no torch. Dtypes numpy lacks are handed back as their
raw bits: bfloat16 and float16 as uint16, float8_e4m3fn as uint8 (hsq.quant reads those).
The header is parsed strictly first (hsq.stfile.header), so every view lies inside the file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq.stfile.header import FormatError, Header, map_file, read_header

if TYPE_CHECKING:
    import numpy as np

# safetensors' code -> the numpy dtype of its values (or of its bits where numpy has none)
NUMPY_DTYPES = {
    "BF16": "<u2",
    "F16": "<u2",
    "F32": "<f4",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "F8_E4M3": "u1",
}
BITS_ONLY = frozenset({"BF16", "F16", "F8_E4M3"})
"""Codes whose arrays hold bits, not values."""


@dataclass(frozen=True)
class TensorFile:
    """An open file: its strictly parsed `header` and `array(name)` views of its mapping.
    The mapping closes when the last view and this object are gone (no explicit close: a
    view handed out keeps its bytes alive, so none can outlive them)."""

    header: Header
    buf: mmap.mmap

    def array(self, name: str) -> np.ndarray[Any, Any]:
        import numpy as np

        info = self.header.tensors[name]
        view = memoryview(self.buf)[info.start : info.start + info.nbytes]
        return np.frombuffer(view, dtype=NUMPY_DTYPES[info.dtype]).reshape(info.shape)


def open_tensors(path: Path) -> TensorFile:
    """Map `path` and parse its header; FormatError (a ValueError) for a damaged file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = read_header(fd)
        buf = map_file(fd)  # read_header refused a file too short to hold a header
    finally:
        os.close(fd)
    return TensorFile(header, buf)


__all__ = ["BITS_ONLY", "NUMPY_DTYPES", "FormatError", "TensorFile", "open_tensors"]
