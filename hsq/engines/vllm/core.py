"""The connector's logic without vLLM: refusals at start, the rid a request carries, and
the write of what vLLM's writer thread receives. connector.py only adapts vLLM's class to
it, so everything here is tested on a CPU (tests/test_vllm_connector.py)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from hsq.dump.format import ModelIdentity
from hsq.engines.common import DumpContext, forget_marker
from hsq.engines.vllm.checkpoint import FinalNorm, read_final_norm
from hsq.engines.vllm.config import RID_PARAM, ConnectorConfig
from hsq.engines.vllm.layers import vllm_aux_ids
from hsq.engines.vllm.refusals import ServingFacts, refusals
from hsq.engines.vllm.writer import SERVER, DumpWriter
from hsq.errors import ConfigError

log = logging.getLogger("hsq.engines.vllm")
_RID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,256}$")
"""A rid as hsq's worker makes them (hsq-<sample>-a<attempt>-<hex>), bounded: it comes
from a client's JSON body and ends up in meta.json."""


class Synchronizable(Protocol):
    def synchronize(self) -> None: ...


def rid_of(kv_transfer_params: Mapping[str, object] | None) -> str | None:
    """The worker's rid from a request's ``kv_transfer_params``; None for a request hsq
    did not make (a warm-up, a health probe, an operator's curl), which is not dumped."""
    rid = (kv_transfer_params or {}).get(RID_PARAM)
    if isinstance(rid, str) and _RID_RE.match(rid):
        return rid
    if rid is not None:
        log.warning("hsq_vllm: ignoring a request with a malformed %s: %r", RID_PARAM, rid)
    return None


def prompt_computed(num_prompt: int, num_computed: int, status: str) -> bool:
    """Whether every prompt row reached the capture cache: a request aborted mid-prefill
    (its client gone, a preemption that gave up) leaves rows never written, and a dump
    of them would carry the right rid, count and fingerprint over wrong states."""
    return num_prompt > 0 and num_computed >= num_prompt and "ABORTED" not in status


class ConnectorCore:
    """One per connector instance (the scheduler's and each worker's)."""

    def __init__(
        self, cfg: ConnectorConfig, facts: ServingFacts, model: ModelIdentity, model_path: str
    ) -> None:
        problems = refusals(facts, cfg)
        if problems:
            raise ConfigError("hsq_vllm: refusing to start: " + "; ".join(problems))
        self.cfg = cfg
        self.facts = facts
        self.model = model
        self.model_path = cfg.model_path or model_path
        self.captured = tuple(vllm_aux_ids(cfg.layer_ids, facts.num_layers))
        self.writer: DumpWriter | None = None
        self._rids: dict[str, str] = {}
        self._lock = threading.Lock()

    def forget_marker(self) -> None:
        """A marker an earlier server left must not vouch for this one while it loads."""
        forget_marker(self.cfg.dump_dir)

    def start_writer(self, server_version: str, norm: FinalNorm | None = None) -> DumpWriter:
        """The writer (TP rank 0 only), then the readiness marker the worker waits for."""
        if norm is None:
            model_dir = Path(self.model_path)
            norm = read_final_norm(model_dir, self.facts.hidden_size)
        ctx = DumpContext(self.model, self.cfg.layer_ids, self.cfg.encoding, self.cfg.prenorm)
        self.writer = DumpWriter(
            self.cfg.dump_dir, ctx, captured=self.captured, norm=norm, fsync=self.cfg.fsync
        )
        self.writer.announce(SERVER, server_version)
        return self.writer

    def remember(self, key: str, rid: str) -> None:
        """The writer thread gets a file name, not the request: keep the rid by it."""
        with self._lock:
            self._rids[key] = rid

    def write_tensors(
        self, tensors: Mapping[str, torch.Tensor], event: Synchronizable, key: str
    ) -> Path | None:
        """What ExampleHiddenStatesConnector._write_tensors receives: ``hidden_states``
        [T, k, H] (pinned host memory, valid once ``event`` synchronized), ``token_ids``
        [T] int64, and the file name it would have written (our key)."""
        with self._lock:
            rid = self._rids.pop(key, None)
        event.synchronize()
        if rid is None or self.writer is None:
            return None
        try:
            return self.writer.write(rid, tensors["token_ids"], tensors["hidden_states"])
        except Exception:  # a bug here must not take the writer pool (or vLLM) down
            self.writer.errors += 1
            log.exception("hsq_vllm: dump of %s failed", rid)
            return None
