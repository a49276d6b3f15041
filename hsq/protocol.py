"""The dump protocol's names in one module, as earlier versions and their docs named them.

The protocol lives in the hsq.dump package (format, write, read, find, ready; the shared
tensor names and encodings in hsq.states); this module only re-exports what a server or a
tool outside hsq may import (`from hsq.protocol import write_dump`), so such code keeps
working. hsq's own code imports from the homes.
"""

from __future__ import annotations

from hsq.dump.find import Scan, clear_dump_dir, remove_dump, scan, scan_by_rid, wait_for_dump
from hsq.dump.format import (
    DONE_FILE,
    DUMP_PREFIX,
    FORMAT_VERSION,
    LAYER_CONVENTION,
    META_FILE,
    READ_VERSIONS,
    TENSOR_FILE,
    TMP_SUFFIX,
    DumpMeta,
    ModelIdentity,
    dtype_name,
    expected_shapes,
    fingerprint,
)
from hsq.dump.read import Dump, Expected, check_meta, open_dump_tensors, read_dump, read_meta
from hsq.dump.ready import READY_FILE, ReadyMarker, read_ready, write_ready
from hsq.dump.write import write_dump
from hsq.fsio import open_regular
from hsq.states import (
    AUX_TENSOR,
    ENCODINGS,
    FP8,
    LAST_TENSOR,
    PLAIN,
    PRENORM_TENSOR,
    SCALE_SUFFIX,
    scale_name,
    state_tensors,
)

__all__ = [
    "AUX_TENSOR",
    "DONE_FILE",
    "DUMP_PREFIX",
    "ENCODINGS",
    "FORMAT_VERSION",
    "FP8",
    "LAST_TENSOR",
    "LAYER_CONVENTION",
    "META_FILE",
    "PLAIN",
    "PRENORM_TENSOR",
    "READY_FILE",
    "READ_VERSIONS",
    "SCALE_SUFFIX",
    "TENSOR_FILE",
    "TMP_SUFFIX",
    "Dump",
    "DumpMeta",
    "Expected",
    "ModelIdentity",
    "ReadyMarker",
    "Scan",
    "check_meta",
    "clear_dump_dir",
    "dtype_name",
    "expected_shapes",
    "fingerprint",
    "open_dump_tensors",
    "open_regular",
    "read_dump",
    "read_meta",
    "read_ready",
    "remove_dump",
    "scale_name",
    "scan",
    "scan_by_rid",
    "state_tensors",
    "wait_for_dump",
    "write_dump",
    "write_ready",
]
