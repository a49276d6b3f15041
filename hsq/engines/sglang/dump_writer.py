"""Device-to-host copies, a bounded queue and the writer thread that writes dumps.

The scheduler thread only starts copies and enqueues. On CUDA the copies run on a side
stream into pinned memory (torch's caching host allocator reuses freed pinned blocks, so
steady state allocates nothing new), and an event tells the writer when they landed: the
scheduler never synchronizes. The queue is bounded in items and bytes; when the disk
falls behind, ``submit`` blocks the scheduler (backpressure) instead of growing RAM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hsq.engines.common import DumpContext, DumpFiles
from hsq.engines.sglang.accumulator import Accumulator, Chunk, Complete
from hsq.states import LAST_TENSOR

log = logging.getLogger("hsq.sglang_hook")


class HostCopier:
    """Copies tensors to host memory without blocking the caller.

    After queueing the copies of SGLang's own tensors on the side stream, the compute
    stream is made to wait for them: the next forward may overwrite the sources in place
    (CUDA-graph output buffers are reused without going through the allocator, so
    record_stream alone would not protect them). That orders GPU work only; the CPU never
    waits, but the next forward starts only once the copy is done. Tensors the hook made
    itself (``owned``: fp8 values and scales, device-side clones) go through the allocator
    only, so record_stream protects them and the next forward need not wait.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(
        self, tensors: Sequence[torch.Tensor], *, owned: bool = False
    ) -> tuple[list[torch.Tensor], object | None]:
        """Host copies and an event to wait on (None when they are ready already). The
        event is a blocking-sync one: the writer thread sleeps on it instead of spinning
        in the CUDA driver while the scheduler launches the next forward."""
        if not tensors or not tensors[0].is_cuda:
            # Plain copies: the forward reuses its buffers, so views would change under us.
            return [t.detach().to("cpu", copy=True) for t in tensors], None
        device = tensors[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        compute = torch.cuda.current_stream(device)
        stream.wait_stream(compute)
        out: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the allocator must not reuse it mid-copy
                out.append(host)
            ready = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ready.record(stream)
        if not owned:
            compute.wait_event(ready)
        return out, ready


@dataclass
class _Item:
    chunks: list[Chunk]
    ready: object | None
    nbytes: int


class DumpSink(DumpFiles):
    """The writer thread's side of the queue, writing through DumpFiles (the next free
    req_<N>, the readiness marker). The context's layer ids are the effective HF
    hidden_states indices; for fp8 the chunks hold values quantized on the device plus
    scales, with prenorm last_hidden_state_prenorm too."""

    def __init__(
        self,
        dump_dir: Path,
        ctx: DumpContext,
        *,
        max_items: int = 8,
        max_bytes: int = 8 << 30,
        evict_after_s: float = 600.0,
        fsync: bool = True,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 5.0,
    ) -> None:
        super().__init__(dump_dir, ctx, fsync=fsync, log=log, tag="hs_dump")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.acc = Accumulator(evict_after_s, clock)
        self.written: list[Path] = []
        self._tick_s = tick_s
        self._items: deque[_Item | None] = deque()
        self._bytes = 0
        self._busy = 0  # items taken by the writer and not finished
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hs-dump-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ scheduler side

    def submit(self, chunks: list[Chunk], ready: object | None) -> None:
        """Queue one forward's chunks; blocks while the queue is full (backpressure)."""
        item = _Item(chunks, ready, sum(c.nbytes for c in chunks))
        with self._cond:
            while self._items and (
                len(self._items) >= self.max_items or self._bytes + item.nbytes > self.max_bytes
            ):
                self._cond.wait()
            self._items.append(item)
            self._bytes += item.nbytes
            self._cond.notify_all()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until everything submitted so far has been handled."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("dump writer did not drain")
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._items.append(None)
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._items:
                    self._cond.wait(self._tick_s)
                if not self._items:
                    item: _Item | None = None
                    tick = True
                else:
                    item, tick = self._items.popleft(), False
                    if item is None:
                        return  # close()
                    self._busy += 1
                    self._cond.notify_all()  # a queue slot is free
            if tick or item is None:
                self.acc.evict()  # idle: still drop abandoned requests
                continue
            try:
                self._handle(item)
            except Exception:  # a bug here must not kill the thread and stall the server
                self.errors += 1
                log.exception("hs_dump: writer failed")
            finally:
                nbytes = item.nbytes
                # Drop the pinned copies now, not when the next item arrives: the caching
                # host allocator can only hand a block out again once it is freed.
                del item
                with self._cond:
                    self._busy -= 1
                    self._bytes -= nbytes
                    self._cond.notify_all()

    def _handle(self, item: _Item) -> None:
        if item.ready is not None:
            item.ready.synchronize()  # type: ignore[attr-defined]
        for chunk in item.chunks:
            done = self.acc.add(chunk)
            if done is not None:
                self._write(done)
        self.acc.evict()

    def _write(self, done: Complete) -> None:
        ids, tensors = done.assemble()
        last = tensors[LAST_TENSOR]
        total, hidden = int(ids.shape[0]), int(last.shape[1])
        k = len(self.ctx.layer_ids)
        want = self.ctx.shapes(total, hidden)
        got = {name: list(t.shape) for name, t in tensors.items()}
        if got != want or ids.dim() != 1:
            self.errors += 1
            log.error(
                "hs_dump: %s not written: tensors %s, ids %s; %d tokens, %d layers of %d need %s",
                done.rid,
                got,
                tuple(ids.shape),
                total,
                k,
                hidden,
                want,
            )
            return
        dtype = done.chunks[0].dtype or last.dtype  # fp8: what the states were quantized from
        path = self.store(done.rid, ids, tensors, hidden_size=hidden, dtype=dtype)
        if path is not None:
            self.written.append(path)
