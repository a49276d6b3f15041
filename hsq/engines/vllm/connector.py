"""The vLLM shim: ``HsqConnector``, loaded by vLLM through ``kv_connector_module_path``.

Read against vLLM 0.26.0 (distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py). ExampleHiddenStatesConnector finds the states in the
cache-only KV group, and once a request finishes copies its ``[T, k, H]`` rows to pinned
host memory and hands them to ``_write_tensors`` on a writer thread. This subclass:

- at construction (scheduler and worker), reads its settings and vLLM's config and
  refuses what would give wrong or partial dumps (core.ConnectorCore);
- in ``request_finished`` (scheduler) keeps the worker's rid from the request's
  ``kv_transfer_params`` in the pending save (it crosses to the worker with it), and
  drops requests without one (warm-ups, probes) before anything is copied;
- in ``register_kv_caches`` (worker, TP rank 0) starts the dump writer and writes the
  readiness marker;
- in ``_write_tensors`` (writer thread) writes an hsq dump instead of the example's file.

vLLM imports this module in its API server, engine core and workers: nothing at import
touches CUDA. No lock files (hsq's dumps are complete once renamed).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from hsq.engines.common import model_identity
from hsq.engines.vllm.config import ConnectorConfig
from hsq.engines.vllm.core import ConnectorCore, prompt_computed, rid_of
from hsq.engines.vllm.refusals import ServingFacts

log = logging.getLogger("hsq.engines.vllm")


@dataclasses.dataclass
class HsqPendingSave(PendingSave):  # type: ignore[misc,unused-ignore]
    hsq_rid: str = ""


def serving_facts(vllm_config: Any, rank_zero_writes: bool) -> ServingFacts:
    """The values refusals.refusals checks, out of vLLM's config objects."""
    mc = vllm_config.model_config
    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config if spec is not None else None
    par = vllm_config.parallel_config
    archs = getattr(mc.hf_config, "architectures", None) or ["unknown"]
    context = max(
        int(getattr(par, "prefill_context_parallel_size", 1) or 1),
        int(getattr(par, "decode_context_parallel_size", 1) or 1),
    )
    return ServingFacts(
        architecture=str(archs[0]),
        num_layers=int(mc.get_total_num_hidden_layers()),
        hidden_size=int(mc.get_hidden_size()),
        captured_ids=list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []),
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        tensor_parallel_size=int(par.tensor_parallel_size),
        pipeline_parallel_size=int(par.pipeline_parallel_size),
        data_parallel_size=int(par.data_parallel_size),
        context_parallel_size=context,
        rank_zero_writes=rank_zero_writes,
        dump_dtype=str(mc.dtype).removeprefix("torch."),
    )


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class HsqConnector(ExampleHiddenStatesConnector):  # type: ignore[misc,unused-ignore]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.use_lock = False  # no .lock files: a dump is complete once renamed
        self.allow_custom_save_path = False  # the dump dir is the worker's, not a client's
        cfg = ConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        # The example's rule, present since vLLM 0.24: TP rank 0 writes, others no-op.
        facts = serving_facts(vllm_config, hasattr(self, "_is_tp_rank_zero"))
        mc = vllm_config.model_config
        ident = model_identity(
            str(mc.model),
            facts.architecture,
            facts.num_layers,
            facts.hidden_size,
            mc.hf_config.to_dict(),
        )
        self._hsq = ConnectorCore(cfg, facts, ident, str(mc.model))
        if role == KVConnectorRole.WORKER:
            try:
                first = _tp_rank() == 0
            except Exception:  # no TP group yet: register_kv_caches writes the marker anyway
                first = False
            if first:
                self._hsq.forget_marker()

    # -------------------------------------------------------------- scheduler side

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, _params = super().request_finished(request, block_ids)
        req_id = request.request_id
        rid = rid_of(request.kv_transfer_params)
        pending = self._pending_saves.pop(req_id, None)
        computed = prompt_computed(
            len(request.prompt_token_ids or ()),
            int(getattr(request, "num_computed_tokens", 0)),
            str(getattr(request, "status", "")),
        )
        if rid is None or pending is None or not computed:
            if rid is not None:
                log.warning("hsq_vllm: %s ended before its prompt was computed: no dump", rid)
            return False, None  # nothing to copy: free the blocks now
        fields = {f.name: getattr(pending, f.name) for f in dataclasses.fields(PendingSave)}
        self._pending_saves[req_id] = HsqPendingSave(**fields, hsq_rid=rid)
        return delay, {"hsq_rid": rid}

    # -------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self._is_tp_rank_zero:
            self._hsq.start_writer(importlib.metadata.version("vllm"))
            log.info(
                "hsq_vllm: dumping to %s, layers %s",
                self._hsq.cfg.dump_dir,
                list(self._hsq.cfg.layer_ids),
            )

    def _submit_async_write(self, pending: Any) -> None:
        rid = getattr(pending, "hsq_rid", "")
        if not rid or not self._is_tp_rank_zero:
            return
        self._hsq.remember(pending.filename, rid)
        super()._submit_async_write(pending)

    def _write_tensors(  # an instance method: the base calls it as self._write_tensors
        self, tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None
    ) -> None:
        try:
            self._hsq.write_tensors(tensors, event, filename)
        finally:
            if lock_fd is not None:
                import os

                os.close(lock_fd)
