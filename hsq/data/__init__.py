"""hsq's readers for trainers: a finished run's outputs read in place (files.py:
HiddenStateDataset, collate), and a streamed run's outputs as they are published
(stream.py: StreamingHiddenStateDataset; loader.py: StreamingDataLoader).

    from hsq.data import HiddenStateDataset, StreamingHiddenStateDataset

Each name loads its module on first use: the streaming dataset imports torch and the store,
the offline one neither until it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsq.extras import lazy_attributes

if TYPE_CHECKING:
    from hsq.data.files import MANIFEST, HiddenStateDataset, collate
    from hsq.data.loader import StreamingDataLoader
    from hsq.data.stream import StreamingHiddenStateDataset

__all__ = [
    "MANIFEST",
    "HiddenStateDataset",
    "StreamingDataLoader",
    "StreamingHiddenStateDataset",
    "collate",
]
_WHERE = {
    "MANIFEST": "hsq.data.files",
    "HiddenStateDataset": "hsq.data.files",
    "collate": "hsq.data.files",
    "StreamingHiddenStateDataset": "hsq.data.stream",
    "StreamingDataLoader": "hsq.data.loader",
}
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _WHERE, globals())
