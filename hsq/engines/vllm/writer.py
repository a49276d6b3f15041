"""Writes one request's states as an hsq dump (hsq.engines.common.DumpFiles, over
hsq.dump.write.write_dump, the one writer): ``req_<N>.tmp/`` -> tensors, meta.json, done ->
rename. Called from vLLM's writer threads (several at once); DumpFiles takes the next index
under a lock."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from hsq.engines.common import DumpContext, DumpFiles
from hsq.engines.vllm.checkpoint import FinalNorm
from hsq.engines.vllm.states import dump_tensors, shape_problem

log = logging.getLogger("hsq.engines.vllm")
SERVER = "vllm"


class DumpWriter(DumpFiles):
    def __init__(
        self,
        dump_dir: Path,
        ctx: DumpContext,
        *,
        captured: Sequence[int],
        norm: FinalNorm,
        fsync: bool = True,
    ) -> None:
        """`captured`: the ids vLLM captures (sorted, the final state's ``L`` last);
        `norm`: the model's final norm, applied to the final state's row."""
        super().__init__(dump_dir, ctx, fsync=fsync, log=log, tag="hsq_vllm")
        self.captured = tuple(captured)
        self.norm = norm

    def write(self, rid: str, token_ids: torch.Tensor, hidden: torch.Tensor) -> Path | None:
        """One request's dump; None (logged, counted) when it cannot be written: the worker
        then sees no dump for its rid and retries the sample, never a wrong one."""
        ctx = self.ctx
        problem = shape_problem(hidden, token_ids, self.captured)
        if problem:
            self.errors += 1
            log.error("hsq_vllm: %s not written: %s", rid, problem)
            return None
        tensors = dump_tensors(
            hidden,
            self.captured,
            ctx.layer_ids,
            self.norm,
            prenorm=ctx.prenorm,
            encoding=ctx.encoding,
        )
        return self.store(rid, token_ids, tensors, hidden_size=hidden.shape[2], dtype=hidden.dtype)
