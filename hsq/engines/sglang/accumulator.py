"""Collects the chunks of one request (chunked prefill) until its prompt is complete.

A request must arrive as contiguous chunks starting at token 0. Anything else (a radix
cache hit skipped a prefix, a chunk was lost, chunks came out of order) marks it broken:
nothing is written for it, because a dump with a hole would pass every shape check.
The client then sees no dump and retries. Requests that never finish (aborted, client
gone) are evicted after a timeout so their chunks do not pin host memory forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hsq.engines.sglang.plan import PlanEntry

log = logging.getLogger("hsq.sglang_hook")


@dataclass
class Chunk:
    """Host copies of one request's rows of one forward."""

    entry: PlanEntry
    input_ids: torch.Tensor
    """[n] token ids the forward computed: the fingerprint is taken from these."""
    tensors: dict[str, list[torch.Tensor]]
    """The dump's tensors by hsq.states name, in file order, each as column pieces
    [n, w] of this chunk's rows: the aux states come as one packed piece (DeepSeek) or one
    per layer (Llama), widths summing to k*H; fp8 values and their scales alike."""
    dtype: torch.dtype | None = None
    """The dtype the states were computed in, when the tensors are not in it (fp8)."""

    @property
    def nbytes(self) -> int:
        ts = [self.input_ids, *(p for pieces in self.tensors.values() for p in pieces)]
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class Complete:
    rid: str
    chunks: list[Chunk]

    def assemble(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(input_ids [T], {name: [T, width]}) from the chunks, in token order."""
        first = self.chunks[0]
        if len(self.chunks) == 1 and all(len(p) == 1 for p in first.tensors.values()):
            return first.input_ids, {k: p[0].contiguous() for k, p in first.tensors.items()}
        total = sum(int(c.input_ids.shape[0]) for c in self.chunks)
        out = {
            name: torch.empty((total, sum(p.shape[1] for p in pieces)), dtype=pieces[0].dtype)
            for name, pieces in first.tensors.items()
        }
        for c in self.chunks:
            rows = slice(c.entry.prefix_len, c.entry.prefix_len + int(c.input_ids.shape[0]))
            for name, pieces in c.tensors.items():
                col = 0
                for part in pieces:
                    out[name][rows, col : col + part.shape[1]] = part
                    col += part.shape[1]
        ids = torch.cat([c.input_ids for c in self.chunks])
        return ids, out


@dataclass
class _Open:
    chunks: list[Chunk] = field(default_factory=list)
    rows: int = 0
    broken: bool = False
    last_seen: float = 0.0


class Accumulator:
    """Per-rid chunk state. Used by the writer thread only: no locking."""

    def __init__(self, evict_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.evict_after_s = evict_after_s
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self.broken = 0
        self.evicted = 0

    @property
    def open_rids(self) -> list[str]:
        return [rid for rid, s in self._open.items() if not s.broken]

    def add(self, chunk: Chunk) -> Complete | None:
        e = chunk.entry
        now = self._clock()
        state = self._open.get(e.rid)
        if state is None:
            state = self._open[e.rid] = _Open()
        state.last_seen = now
        if not state.broken and e.prefix_len != state.rows:
            # Out of order, a gap or a cached prefix: the dump would have a hole.
            self._break(e, state, f"chunk starts at token {e.prefix_len}, expected {state.rows}")
        if state.broken:
            # Kept as a tombstone until evicted, so a late earlier chunk cannot reopen it.
            return None
        state.chunks.append(chunk)
        state.rows += e.extend_len
        if state.rows < e.total_len:
            return None
        del self._open[e.rid]
        return Complete(e.rid, state.chunks)

    def _break(self, e: PlanEntry, state: _Open, why: str) -> None:
        state.broken = True
        state.chunks.clear()  # free the host memory now
        self.broken += 1
        log.error("hs_dump: request %s is broken and will not be dumped: %s", e.rid, why)

    def evict(self) -> list[str]:
        """Drop requests not seen for ``evict_after_s`` (aborted or abandoned)."""
        now = self._clock()
        stale = [r for r, s in self._open.items() if now - s.last_seen >= self.evict_after_s]
        for rid in stale:
            state = self._open.pop(rid)
            if not state.broken:
                self.evicted += 1
                log.warning(
                    "hs_dump: evicted unfinished request %s after %.0fs (%d of its tokens seen)",
                    rid,
                    self.evict_after_s,
                    state.rows,
                )
        return stale
