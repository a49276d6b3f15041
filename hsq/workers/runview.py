"""What the worker knows about its run: config, output dir and the pinned dump identity.

Pins (model, layers, dtype, hidden size) come from the run's config or, if unset, from the
first dump that validated *completely* (meta and tensors): a dump that fails validation
never pins anything. A dump that disagrees with a pin fails meta_mismatch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta, fingerprint
from hsq.dump.read import Expected
from hsq.errors import MetaMismatchError
from hsq.runconfig import RunConfig

PIN_FIELDS = ("model_id", "layer_ids", "dump_dtype", "hidden_size")


class Pinner(Protocol):
    def pin_dump_identity(
        self, model_id: str, layer_ids: list[int], dump_dtype: str, hidden_size: int
    ) -> dict[str, Any]: ...


def _identity(meta: DumpMeta) -> dict[str, Any]:
    return {
        "model_id": meta.model.model_id,
        "layer_ids": list(meta.layer_ids),
        "dump_dtype": meta.dtype,
        "hidden_size": meta.hidden_size,
    }


@dataclass
class RunView:
    cfg: RunConfig
    out_root: Path
    pins: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, cfg: RunConfig, run: str) -> RunView:
        pins = {name: getattr(cfg, name) for name in PIN_FIELDS}
        return cls(cfg, Path(cfg.out) / run, pins)

    @property
    def dataset(self) -> Path:
        return Path(self.cfg.dataset)

    def expected(self, rid: str, sample: Sample) -> Expected:
        with self._lock:
            p = dict(self.pins)
        return Expected(
            rid=rid,
            input_fingerprint=fingerprint(sample.input_ids),
            num_tokens=len(sample.input_ids),
            layer_ids=p["layer_ids"],
            hidden_size=p["hidden_size"],
            dtype=p["dump_dtype"],
            model_id=p["model_id"],
            store_dtype=self.cfg.store_dtype,
            prenorm=self.cfg.prenorm,
        )

    def confirm(self, meta: DumpMeta, store: Pinner) -> None:
        """After a dump validated completely: pin what is not pinned yet (one Redis round
        trip, once per worker), then check the dump against every pin."""
        got = _identity(meta)
        with self._lock:
            if any(self.pins[name] is None for name in PIN_FIELDS):
                recorded = store.pin_dump_identity(**got)
                self.pins = {
                    n: recorded.get(n) if recorded.get(n) is not None else self.pins[n]
                    for n in PIN_FIELDS
                }
            pins = dict(self.pins)
        for name in PIN_FIELDS:
            if pins[name] is not None and got[name] != pins[name]:
                raise MetaMismatchError(
                    f"dump {name} is {got[name]!r}, the run expects {pins[name]!r}"
                )
