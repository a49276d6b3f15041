"""Reading ahead of the trainer: a streamed read batch's files read and checked in threads
while the trainer works on the item before (hsq.data.stream's iterator).

One core checks ~4-5 GB/s of outputs (xxh3 over the file's mapping, and the page faults
that mapping takes); the stream must outrun the extraction, which runs on many. xxh3
leaves the GIL, so the checks of the next files run on other cores. Only the pure part
goes ahead (open under the run's directory, size, checksum, structure: read_checked):
what follows from a read (a stale entry skipped, a bad file rejected and requeued) is
still done by the iterating thread, in the order the trainer gets the items. A batch's
entries are already this consumer's when their reads begin, so nothing waits on a read
ahead: the trainer gets each item as soon as its own read is done.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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
