"""StreamingDataLoader: the DataLoader that tells a StreamingHiddenStateDataset (stream.py)
which items the trainer received. Each batch carries its items' stream positions across
the worker pipe (_Marked); they are recorded in the trainer's process as the batch is
yielded, never when a worker prefetched it. Items handed over one by one cross from the
workers as a checked file's name and identity (CheckedFile), opened again here.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from hsq.data.reads import CheckedFile
from hsq.data.stream import POSITION, StreamingHiddenStateDataset
from hsq.errors import OutputError

_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters
"""torch >= 2.6: DataLoader(in_order=False) yields whichever worker's batch is ready."""


class _Marked:
    """A batch with the stream positions of its items (crosses the worker pipe)."""

    def __init__(self, value: Any, positions: list[tuple[str, str]]) -> None:
        self.value = value
        self.positions = positions

    def pin_memory(self) -> _Marked:
        """DataLoader(pin_memory=True)'s thread calls this (it would leave an unknown
        object as is): the value's tensors pinned, a CheckedFile opened first (one that
        fails its checks stays as it is: the loader's iterator rejects it)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        if isinstance(self.value, CheckedFile):
            try:
                self.value = self.value.open()
            except OutputError:
                return self
        self.value = pin_memory(self.value)  # type: ignore[no-untyped-call]
        return self


class _MarkingCollate:
    def __init__(self, inner: Callable[[Any], Any]) -> None:
        self.inner = inner

    def __call__(self, data: Any) -> _Marked:
        if isinstance(data, CheckedFile):
            return _Marked(data, [data.position])
        items = data if isinstance(data, list) else [data]
        positions = [(str(c), str(e)) for item in items if POSITION in item
                     for c, e in [item.pop(POSITION)]]  # fmt: skip
        return _Marked(self.inner(data), positions)


class StreamingDataLoader(DataLoader[Any]):
    """A DataLoader that tells its StreamingHiddenStateDataset which items the trainer
    received: each batch's positions are recorded in the main process as it is yielded,
    never when a worker prefetched it."""

    def __init__(self, dataset: StreamingHiddenStateDataset, *args: Any, **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingHiddenStateDataset):
            raise TypeError("StreamingDataLoader reads a StreamingHiddenStateDataset")
        from torch.utils.data._utils.collate import default_collate, default_convert

        batched = kwargs.get("batch_size", 1) is not None
        given = kwargs.pop("collate_fn", None)
        inner = given or (default_collate if batched else default_convert)
        # Items handed over one by one as they are (default_convert leaves a dict of
        # tensors as it is) cross from the workers by reference (CheckedFile).
        dataset._by_reference = not batched and given is None and kwargs.get("num_workers", 0) > 0
        if kwargs.get("num_workers", 0) > 0 and _HAS_IN_ORDER:
            # Not round-robin over the workers: one waiting for an entry (the spool full
            # until the trainer commits) would hold back the items the others have.
            kwargs.setdefault("in_order", False)
        dataset._marking = True
        kwargs["collate_fn"] = _MarkingCollate(inner)
        super().__init__(dataset, *args, **kwargs)
        self.stream = dataset

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        it = super().__iter__()
        asked = time.monotonic()
        while True:
            try:
                marked = next(it)
            except StopIteration:
                self.stream._end()  # every worker's stream ended: the trainer has it all
                return
            if isinstance(marked.value, CheckedFile):
                item = self.stream.opened(marked.value)
                if item is None:
                    continue  # rejected: never handed to the trainer, not recorded
                marked.value = item
            for consumer, entry_id in marked.positions:
                self.stream.record(consumer, entry_id)
            self.stream.waited(time.monotonic() - asked, len(marked.positions))
            yield marked.value
            asked = time.monotonic()
