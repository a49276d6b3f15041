"""The hook's core: from a batch plan and one forward's tensors to queued chunks.

No SGLang import: the glue (plugin.py) passes plain values in, so everything here runs
and is tested on a CPU. One DumpHook lives in each scheduler process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from hsq.engines.common import DumpContext
from hsq.engines.sglang.accumulator import Chunk
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.dump_writer import DumpSink, HostCopier
from hsq.engines.sglang.plan import BatchPlan, ReqLike, RidFilter, build_plan
from hsq.quant import quantize_on_device
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR, PRENORM_TENSOR, scale_name

log = logging.getLogger("hsq.sglang_hook")

AuxStates = torch.Tensor | Sequence[torch.Tensor] | None
"""SGLang passes one packed [T, k*H] tensor (DeepSeek) or a list of k [T, H] (Llama)."""


def aux_parts(aux: AuxStates) -> list[torch.Tensor]:
    if aux is None:
        return []
    if isinstance(aux, torch.Tensor):
        return [aux]
    return list(aux)


def batch_input_ids(input_ids: torch.Tensor | None, logits_metadata: object) -> torch.Tensor | None:
    """The forward's token ids, also when the logits processor gets ``input_ids=None``.

    Multimodal wrappers (Kimi-K2.5, through mm_utils.general_mm_embed_routine) call the
    language model with ``input_ids=None`` and embeddings, text-only batches included;
    DeepseekV2ForCausalLM passes that None on. Its ``logits_metadata`` argument is then
    the ForwardBatch, whose ``input_ids`` hold the batch's rows (image tokens as pad
    values: their fingerprint cannot match, and the worker reports stale_dump).
    """
    if input_ids is not None:
        return input_ids
    ids = getattr(logits_metadata, "input_ids", None)
    return ids if isinstance(ids, torch.Tensor) else None


class DumpHook:
    """Plans prefill batches and captures their states; only attention-TP rank 0 writes.

    With plain TP the hidden states after the all-reduce are identical on every rank, so
    one writer per attention-TP group is enough, and more would write every dump twice.
    """

    def __init__(
        self,
        cfg: HookConfig,
        ctx: DumpContext,
        *,
        attn_tp_rank: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        # What the dumps declare comes from the settings that decide what is captured.
        self.ctx = ctx = replace(ctx, encoding=cfg.encoding, prenorm=cfg.prenorm)
        self.is_writer = attn_tp_rank == 0
        self.rid_filter = RidFilter(cfg.rid_prefix)
        self.skipped_batches = 0
        self.sink: DumpSink | None = None
        self._copier: HostCopier | None = None
        if self.is_writer:
            self._copier = HostCopier()
            self.sink = DumpSink(
                cfg.dump_dir,
                ctx,
                max_items=cfg.queue_items,
                max_bytes=cfg.queue_bytes,
                evict_after_s=cfg.evict_after_s,
                fsync=cfg.fsync,
                clock=clock,
            )

    def plan(
        self,
        reqs: Sequence[ReqLike],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        *,
        skip: Sequence[bool] | None = None,
    ) -> BatchPlan | None:
        """The plan of a prefill batch, or None when this rank has nothing to write."""
        if not self.is_writer:
            return None
        return build_plan(reqs, prefix_lens, extend_lens, self.rid_filter, skip=skip)

    def capture(
        self,
        plan: BatchPlan,
        input_ids: torch.Tensor | None,
        hidden: torch.Tensor,
        aux: AuxStates,
        prenorm: torch.Tensor | None = None,
    ) -> bool:
        """Start host copies of every planned request's rows and queue them.

        ``hidden`` is the final state after the norm, as the logits processor gets it;
        ``prenorm`` the final norm's input (plugin.py taps it when SGLANG_HS_PRENORM is on).
        With SGLANG_HS_DUMP_ENCODING=fp8-e4m3 the states are quantized on the device first,
        so half the bytes cross to the host. Returns False (and logs why) when the tensors
        do not fit the plan: nothing of the batch is queued then, and its requests end up
        broken or evicted, never wrong.
        """
        if self.sink is None or self._copier is None:
            return False
        problem = (
            "no input ids (neither the logits call nor its ForwardBatch has them)"
            if input_ids is None
            else self._mismatch(plan, input_ids, hidden, aux, prenorm)
        )
        if problem or input_ids is None:
            self.skipped_batches += 1
            log.error("hs_dump: batch not captured: %s", problem)
            return False
        states = self._states(plan, hidden, aux, prenorm)
        flat: list[torch.Tensor] = []
        for e in plan.entries:
            flat.append(input_ids[e.rows])
            flat += [p[e.rows] for pieces in states.values() for p in pieces]
        # fp8 values and scales are the hook's own tensors already; with device staging
        # the rest are cloned on the device (HBM: far faster than the copy to the host),
        # so the next forward need not wait for the host copy (HostCopier, `owned`).
        quantized = self.cfg.encoding == FP8
        owned = quantized or self.cfg.device_staging
        if owned:
            per_entry = 1 + sum(len(pieces) for pieces in states.values())
            flat = [
                t if quantized and i % per_entry else t.clone()  # i % per_entry == 0: ids
                for i, t in enumerate(flat)
            ]
        host, ready = self._copier.copy(flat, owned=owned)
        chunks = []
        it = iter(host)
        source = hidden.dtype if self.cfg.encoding == FP8 else None
        for e in plan.entries:
            ids = next(it)
            tensors = {name: [next(it) for _ in pieces] for name, pieces in states.items()}
            chunks.append(Chunk(e, ids, tensors, source))
        self.sink.submit(chunks, ready)  # blocks when the writer is behind
        return True

    def _states(
        self,
        plan: BatchPlan,
        hidden: torch.Tensor,
        aux: AuxStates,
        prenorm: torch.Tensor | None,
    ) -> dict[str, list[torch.Tensor]]:
        """The dump's tensors for the whole batch, in file order, as column pieces."""
        states: dict[str, list[torch.Tensor]] = {
            AUX_TENSOR: aux_parts(aux),
            LAST_TENSOR: [hidden],
        }
        if self.cfg.prenorm and prenorm is not None:
            # SGLang may keep the residual in float32 (fp32_residual): dump it as the rest.
            states[PRENORM_TENSOR] = [prenorm.to(hidden.dtype)]
        if self.cfg.encoding != FP8:
            return states
        width = hidden.shape[1]
        out: dict[str, list[torch.Tensor]] = {}
        for name, pieces in states.items():
            # Only the planned rows: padding and unplanned requests are never dumped.
            coded = [quantize_on_device(p[: plan.num_rows], p.shape[1] // width) for p in pieces]
            out[name] = [q for q, _ in coded]
            out[scale_name(name)] = [sc for _, sc in coded]
        return out

    def _mismatch(
        self,
        plan: BatchPlan,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: AuxStates,
        prenorm: torch.Tensor | None = None,
    ) -> str | None:
        # More rows than planned is padding at the end (CUDA-graph buckets); fewer means
        # the rows are not what the plan says (DP-attention, sequence-parallel norms).
        if input_ids.dim() != 1 or input_ids.shape[0] < plan.num_rows:
            return f"input_ids {tuple(input_ids.shape)} for {plan.num_rows} planned rows"
        if hidden.dim() != 2 or hidden.shape[0] < plan.num_rows:
            return f"hidden states {tuple(hidden.shape)} for {plan.num_rows} planned rows"
        if self.cfg.prenorm:
            if prenorm is None:
                return "no pre-norm state (the final norm's hook did not fire in this forward)"
            if prenorm.dim() != 2 or prenorm.shape[1] != hidden.shape[1]:
                return f"pre-norm state {tuple(prenorm.shape)} for hidden {tuple(hidden.shape)}"
            if prenorm.shape[0] < plan.num_rows:
                return f"pre-norm state {tuple(prenorm.shape)} for {plan.num_rows} planned rows"
        parts = aux_parts(aux)
        want = len(self.ctx.layer_ids) * hidden.shape[1]
        width = sum(p.shape[-1] for p in parts)
        if width != want:
            return (
                f"aux states {width} wide, {len(self.ctx.layer_ids)} layers of "
                f"{hidden.shape[1]} need {want} (is aux capture on for this model?)"
            )
        if any(p.dim() != 2 or p.shape[0] < plan.num_rows for p in parts):
            return f"aux rows {[tuple(p.shape) for p in parts]} for {plan.num_rows} planned"
        if any(p.dtype != hidden.dtype for p in parts):
            return f"aux dtype {[p.dtype for p in parts]} differs from {hidden.dtype}"
        if any(p.shape[-1] % hidden.shape[1] for p in parts):
            return f"aux pieces {[tuple(p.shape) for p in parts]} are not whole layers"
        return None

    def flush(self, timeout: float = 60.0) -> None:
        if self.sink is not None:
            self.sink.flush(timeout)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
