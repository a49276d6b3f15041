"""How the stream's delivered files are read (hsq.data.stream's iterator): ahead of the
trainer in threads, and across processes by name (CheckedFile).

Ahead: a read batch's files are read and checked in threads while the trainer works on
the item before. One core checks ~4-5 GB/s of outputs (xxh3 over the file's mapping, and
the page faults that mapping takes); the stream must outrun the extraction, which runs on
many. xxh3 leaves the GIL, so the checks of the next files run on other cores. Only the
pure part goes ahead (open under the run's directory, size, checksum, structure:
read_checked): what follows from a read (a stale entry skipped, a bad file rejected and
requeued) is still done by the iterating thread, in the order the trainer gets the items.
A batch's entries are already this consumer's when their reads begin, so nothing waits on
a read ahead: the trainer gets each item as soon as its own read is done.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hsq.data.files import item_of
from hsq.errors import OutputError
from hsq.outputs.check import FileIdentity, read_checked
from hsq.outputs.format import OutputSample
from hsq.outputs.manifest import MANIFEST_CODEC
from hsq.store import Delivery

READ_THREADS = 4
"""Threads reading a sole reader's batch ahead (DataLoader workers and ranks read batches
of 2: as many threads). 0: each file is read when the trainer takes it."""
READ_AHEAD_BYTES = 512 * 2**20
"""At most this many bytes of a batch's files are read ahead (always the next file): a
batch of long samples (GBs each) is not all mapped at once."""

Checked = tuple[OutputSample, FileIdentity]
Ahead = Future[Checked] | None
"""A file's read and check begun in a thread (None: read when the trainer takes it)."""
Reads = ThreadPoolExecutor | None


def read_ahead(
    pool: Reads, run_dir: Path, got: list[Delivery], nows: list[bytes | None], *, raw: bool
) -> list[Ahead]:
    """The batch's file reads begun in `pool`, in order, up to READ_AHEAD_BYTES (the first
    always); None for an entry that is stale (`nows`: each sample's done entry as stored
    when the batch was read) or does not parse: the iterating thread says which."""
    out: list[Ahead] = [None] * len(got)
    if pool is None:
        return out
    total = 0
    for i, (d, now) in enumerate(zip(got, nows, strict=True)):
        entry = MANIFEST_CODEC.decode(d.sample_id, d.stored) if now == d.stored else None
        if entry is None:
            continue
        total += entry.bytes
        if i and total > READ_AHEAD_BYTES:
            break
        out[i] = pool.submit(read_checked, run_dir, d.sample_id, entry, raw=raw)
    return out


class CheckedFile:
    """A delivered file a DataLoader worker read and checked, as it crosses to the
    trainer's process: its name and identity, a few hundred bytes pickled. The tensors
    themselves would be copied into new shared memory and each passed as a descriptor
    through a socket handshake with the worker (torch's sharing of a mapped file's
    tensors; measured: most of the trainer's time per item). The trainer's process maps
    the same file again, under the run's directory following no link; a file that is no
    longer the one checked (device, inode, size, mtime) is checked again in full there."""

    def __init__(
        self,
        run_dir: Path,
        delivery: Delivery,
        identity: FileIdentity,
        position: tuple[str, str],
        max_length: int | None,
        raw: bool,
    ) -> None:
        self.run_dir = run_dir
        self.delivery = delivery
        self.identity = identity
        self.position = position
        self.max_length = max_length
        self.raw = raw

    @property
    def sample_id(self) -> str:
        return self.delivery.sample_id

    def open(self) -> dict[str, Any]:
        """The item (OutputError if the file fails its checks now)."""
        entry = MANIFEST_CODEC.decode(self.sample_id, self.delivery.stored)
        if entry is None:
            raise OutputError(f"sample {self.sample_id}: its done entry does not parse")
        out, _ = read_checked(self.run_dir, self.sample_id, entry, raw=self.raw,
                              checked=self.identity)  # fmt: skip
        return item_of(self.sample_id, out, self.max_length)
