"""Moves captured states off the device and writes dumps on a background thread.

On CUDA the states are copied on a side stream into a fixed ring of pinned host buffers,
allocated once (a pageable `.cpu()` caps at about 1.3 GB/s on an H200, and a fresh pinned
allocation per request costs milliseconds), so the next forward starts while the copy runs.
A writer thread waits on the copy's event, then writes the dumps (one thread by default: on
the H200 VM, 4 or 8 threads interfered more with the forward, 10.6-11.6 % against 9.7 % at
8192 tokens). The event is a blocking-sync one: the writer sleeps until the copy lands
instead of spinning in the CUDA driver for the whole next forward. The queue is bounded:
when the disk is slower than the GPU, requests block (backpressure) instead of buffering
without end; `stats` says how long the engine was held up that way, and how long the writer
waited and wrote (bench/dump_cost.py prints them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from hsq.dump.format import DumpMeta
from hsq.dump.write import write_dump

log = structlog.get_logger("hsq.reference.dumper")


@dataclass
class DumpPart:
    index: int
    meta: DumpMeta
    tensors: dict[str, torch.Tensor]
    mark_done: bool = True
    before_done: Callable[[Path], None] | None = None


@dataclass
class HostBatch:
    """Host copies of one request's tensors, valid once `ready` has completed."""

    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None
    buffer: torch.Tensor | None = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class _Job:
    parts: list[DumpPart]
    batch: HostBatch
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class WriterStats:
    """Seconds summed over a writer's life; `held_s` is the forward path's share."""

    held_s: float = 0.0
    """The engine blocked on the writer: no free host buffer, or the queue full."""
    copy_wait_s: float = 0.0
    """Writer threads waiting for device-to-host copies to land."""
    write_s: float = 0.0
    """Writer threads writing dump files."""
    dumps: int = 0
    bytes: int = 0


class DumpWriter:
    def __init__(
        self,
        dump_dir: Path,
        depth: int = 2,
        fsync: bool = True,
        *,
        device: torch.device | None = None,
        max_bytes: int = 0,
        threads: int = 1,
        blocking_event: bool = True,
    ) -> None:
        self.dump_dir = dump_dir
        self.fsync = fsync
        self.errors = 0
        self.stats = WriterStats()
        self._stats_lock = threading.Lock()
        depth = max(1, depth)
        threads = max(1, threads)
        self._blocking = blocking_event
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=depth)
        self._cuda = device is not None and device.type == "cuda"
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        if self._cuda:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            # One buffer per queued job, one being written per thread, one being filled.
            for _ in range(depth + threads + 1):
                self._free.put(torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True))
        self._threads = [
            threading.Thread(target=self._run, name=f"dump-writer-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _held(self, since: float) -> None:
        with self._stats_lock:
            self.stats.held_s += time.perf_counter() - since

    def to_host(self, tensors: dict[str, torch.Tensor]) -> HostBatch:
        """Start copying to host memory; on CUDA asynchronously, on a side stream."""
        if not self._cuda:
            return HostBatch({k: v.detach().contiguous() for k, v in tensors.items()})
        t0 = time.perf_counter()
        buf = self._free.get()  # blocks while every buffer is in use: backpressure
        self._held(t0)
        compute = torch.cuda.current_stream()
        out: dict[str, torch.Tensor] = {}
        offset = 0
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            for name, t in tensors.items():
                nbytes = t.numel() * t.element_size()
                if offset + nbytes > buf.numel():
                    self._free.put(buf)
                    raise ValueError(f"dump of {offset + nbytes} bytes exceeds the host buffer")
                host = buf[offset : offset + nbytes].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # the allocator must not reuse it mid-copy
                out[name] = host
                offset += (nbytes + 63) // 64 * 64
            # Blocking sync: the writer sleeps on it rather than spinning in the driver
            # while the next forward is being launched from this process.
            ready = torch.cuda.Event(blocking=self._blocking)  # type: ignore[no-untyped-call]
            ready.record(self._stream)
        return HostBatch(out, ready, buf)

    def release(self, batch: HostBatch) -> None:
        """Return a batch's buffer without writing it (after `batch.wait()`)."""
        if batch.buffer is not None:
            self._free.put(batch.buffer)

    def submit(self, parts: list[DumpPart], batch: HostBatch) -> None:
        t0 = time.perf_counter()
        self._queue.put(_Job(parts, batch))  # blocks while the queue is full: backpressure
        self._held(t0)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=60)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            finally:
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        t0 = time.perf_counter()
        job.batch.wait()
        t1 = time.perf_counter()
        try:
            for part in job.parts:
                try:
                    write_dump(
                        self.dump_dir,
                        part.index,
                        part.meta,
                        part.tensors,
                        mark_done=part.mark_done,
                        fsync=self.fsync,
                        before_done=part.before_done,
                    )
                except OSError as exc:
                    # The dump never appears; the client sees no_dump/incomplete and retries.
                    self.errors += 1
                    log.error("dump_write_failed", index=part.index, error=str(exc))
        finally:
            self.release(job.batch)
        t2 = time.perf_counter()
        with self._stats_lock:
            self.stats.copy_wait_s += t1 - t0
            self.stats.write_s += t2 - t1
            self.stats.dumps += len(job.parts)
            self.stats.bytes += sum(
                t.numel() * t.element_size() for p in job.parts for t in p.tensors.values()
            )
        log.debug(
            "dump_written",
            indices=[p.index for p in job.parts],
            queued_ms=round((t0 - job.submitted) * 1e3, 2),
            copy_wait_ms=round((t1 - t0) * 1e3, 2),
            write_ms=round((t2 - t1) * 1e3, 2),
        )
