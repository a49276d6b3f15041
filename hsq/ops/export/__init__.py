"""`hsq export`: a run's outputs in the layout a trainer reads, one module per format
(specforge, speculators, manifest), what they share (common) and SpecForge's target-model
files (target)."""

from hsq.ops.export.common import (
    ExportReport,
    ExportRequest,
    check_complete,
    check_layers,
    checked_entry,
)
from hsq.ops.export.manifest import export_manifest
from hsq.ops.export.specforge import ckpt_path, export_specforge
from hsq.ops.export.speculators import export_speculators

__all__ = [
    "ExportReport",
    "ExportRequest",
    "check_complete",
    "check_layers",
    "checked_entry",
    "ckpt_path",
    "export_manifest",
    "export_specforge",
    "export_speculators",
]
