"""Writes one request's states as an hsq dump (hsq.dump.write.write_dump, the one writer):
``req_<N>.tmp/`` -> tensors, meta.json, done -> rename. Called from vLLM's writer threads
(several at once), so the next index is taken under a lock."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import hsq
from hsq.dump.format import DumpMeta, ModelIdentity, dtype_name, expected_shapes, fingerprint
from hsq.dump.ready import ReadyMarker, write_ready
from hsq.dump.write import first_free_index, write_dump
from hsq.engines.vllm.checkpoint import FinalNorm
from hsq.engines.vllm.states import dump_tensors, shape_problem

log = logging.getLogger("hsq.engines.vllm")
SERVER = "vllm"


@dataclass(frozen=True)
class DumpContext:
    """What every dump of this server shares."""

    model: ModelIdentity
    layer_ids: tuple[int, ...]
    """The run's aux layers (hsq's convention), in the aux tensor's order."""
    captured: tuple[int, ...]
    """The ids vLLM captures (sorted, the final state's ``L`` last)."""
    norm: FinalNorm
    encoding: str = "plain"
    prenorm: bool = False


class DumpWriter:
    def __init__(self, dump_dir: Path, ctx: DumpContext, *, fsync: bool = True) -> None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        self.dump_dir = dump_dir
        self.ctx = ctx
        self.fsync = fsync
        self.errors = 0
        self._lock = threading.Lock()
        self._next = first_free_index(dump_dir)

    def _take_index(self) -> int:
        with self._lock:
            index, self._next = self._next, self._next + 1
            return index

    def write(self, rid: str, token_ids: torch.Tensor, hidden: torch.Tensor) -> Path | None:
        """One request's dump; None (logged, counted) when it cannot be written: the worker
        then sees no dump for its rid and retries the sample, never a wrong one."""
        ctx = self.ctx
        problem = shape_problem(hidden, token_ids, ctx.captured)
        if problem:
            self.errors += 1
            log.error("hsq_vllm: %s not written: %s", rid, problem)
            return None
        tensors = dump_tensors(
            hidden,
            ctx.captured,
            ctx.layer_ids,
            ctx.norm,
            prenorm=ctx.prenorm,
            encoding=ctx.encoding,
        )
        t, _, h = hidden.shape
        shapes = expected_shapes(
            t, len(ctx.layer_ids), h, encoding=ctx.encoding, prenorm=ctx.prenorm
        )
        for _ in range(1000):
            index = self._take_index()
            meta = DumpMeta(
                rid=rid,
                num_tokens=int(t),
                input_fingerprint=fingerprint(token_ids),
                layer_ids=list(ctx.layer_ids),
                hidden_size=int(h),
                dtype=dtype_name(hidden.dtype),
                model=ctx.model,
                tensors=shapes,
                request_index=index,
                encoding=ctx.encoding,
                prenorm=ctx.prenorm,
            )
            try:
                return write_dump(self.dump_dir, index, meta, tensors, fsync=self.fsync)
            except FileExistsError:
                continue  # an old run's dump (or another writer) holds this index
            except OSError as exc:
                self.errors += 1
                log.error("hsq_vllm: writing %s failed: %s", rid, exc)
                return None
        self.errors += 1
        log.error("hsq_vllm: no free req_<N> index for %s", rid)
        return None

    def announce(self, server_version: str) -> Path:
        """The readiness marker the worker waits for (hsq.dump.ready)."""
        ctx = self.ctx
        marker = ReadyMarker(
            layer_ids=ctx.layer_ids,
            model=ctx.model,
            server=SERVER,
            server_version=server_version,
            hook_version=hsq.__version__,
            pid=os.getpid(),
            created_unix=time.time(),
            encoding=ctx.encoding,
            prenorm=ctx.prenorm,
        )
        return write_ready(self.dump_dir, marker, fsync=self.fsync)
